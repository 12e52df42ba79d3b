"""A logger that keeps what it is told: each line's event and fields, in order."""


class RecordedLog:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def warning(self, event: str, **fields: object) -> None:
        self.lines.append((event, fields))

    info = error = exception = warning

    @property
    def events(self) -> list[str]:
        return [event for event, _ in self.lines]
