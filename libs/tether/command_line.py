"""One way to add a `tether` subcommand: a `Command` names it, adds its arguments and runs
it (an exit code); `tether.cli` registers the commands of every package that has some."""

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from tether.config import Settings


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, Settings], int]

    def register(self, commands: "argparse._SubParsersAction") -> argparse.ArgumentParser:
        parser = commands.add_parser(self.name, help=self.help)
        self.arguments(parser)
        return parser
