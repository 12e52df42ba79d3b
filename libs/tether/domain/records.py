"""The base of the domain's immutable records: events, their parts and a run's state.

A record is a frozen `msgspec.Struct`. Every process builds, writes and reads several
per run, and a struct is built, copied (`msgspec.structs.replace`), encoded and decoded
in C. Building one from Python checks only its
identifiers (`tether.domain.ids.check_identifier`, in its `__post_init__`); a record is
checked when it is decoded, and an event also when it is encoded
(`tether.contract.codec.encode_event`). Records that users build by hand check all
their fields as they are made (`CheckedRecord`).

A record can be a field of a pydantic model (a command, a hook message). There msgspec
reads it; what msgspec refuses goes through the record's pydantic mirror
(`pydantic_model`: the same fields and constraints, each constrained type carrying both
libraries' annotations), for pydantic's errors and lax conversions. The mirror is also
the source of the record's JSON Schema. A record given as one is taken as it is, and
written as msgspec writes it.
"""

from functools import cache
from types import UnionType
from typing import Annotated, Any, Literal, Self, Union, get_args, get_origin, get_type_hints

import msgspec
from pydantic import BaseModel, ConfigDict, Field, GetCoreSchemaHandler, create_model
from pydantic_core import CoreSchema, core_schema


class Record(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        mirrored = core_schema.no_info_after_validator_function(
            cls.from_mirror, handler.generate_schema(pydantic_model(cls)))
        return core_schema.no_info_wrap_validator_function(
            cls._from_pydantic, mirrored,
            serialization=core_schema.plain_serializer_function_ser_schema(msgspec.to_builtins))

    @classmethod
    def _from_pydantic(cls, value: Any, mirrored: core_schema.ValidatorFunctionWrapHandler) -> Self:
        # A record is taken as it is. Anything else is converted by msgspec; what msgspec
        # refuses (or would take only with pydantic's lax conversions, a "5" for a 5) goes
        # through the mirror, for pydantic's errors and conversions.
        if isinstance(value, cls):
            return value
        try:
            return msgspec.convert(value, cls)
        except msgspec.ValidationError:
            checked: Self = mirrored(value)
            return checked

    @classmethod
    def from_mirror(cls, model: BaseModel) -> Self:
        """The record a validated instance of its pydantic mirror (`pydantic_model`) holds."""
        values = {}
        for name in cls.__struct_fields__:
            value = getattr(model, name)
            record = _RECORD_OF.get(type(value))
            values[name] = value if record is None else record.from_mirror(value)
        return cls(**values)


class CheckedRecord(Record, frozen=True, kw_only=True):
    """A record that checks its fields as it is made, as decoding would, raising
    `msgspec.ValidationError` naming the field: for the options users write by hand. A
    field given as JSON-like builtins (a dict for a nested record) is converted."""

    def __post_init__(self) -> None:
        # Through a struct of the same fields without this hook, whose types msgspec
        # compiled once: a field at a time would compile its type at every call.
        try:
            shaped = msgspec.convert(msgspec.structs.asdict(self), _shape_of(type(self)))
        except msgspec.ValidationError as error:
            raise msgspec.ValidationError(f"{type(self).__name__}: {error}") from None
        values = msgspec.structs.astuple(shaped)
        if values != msgspec.structs.astuple(self):  # a value in another form (a dict)
            for name, value in zip(self.__struct_fields__, values, strict=True):
                msgspec.structs.force_setattr(self, name, value)


@cache
def _field_types(cls: type) -> dict[str, Any]:
    return get_type_hints(cls, include_extras=True)


@cache
def _shape_of(cls: type[Record]) -> type[msgspec.Struct]:
    """A struct of the record's fields without its `__post_init__`, whose types msgspec
    compiles once."""
    hints = _field_types(cls)
    return msgspec.defstruct(cls.__name__, [(name, hints[name]) for name in cls.__struct_fields__],
                             forbid_unknown_fields=True)


_RECORD_OF: dict[type, type[Record]] = {}  # pydantic mirror -> its record class


@cache
def pydantic_model(cls: type[Record]) -> type[BaseModel]:
    """A pydantic model with the fields of the record class `cls` (its tag included), the
    records it holds as their own mirrors: how pydantic models that hold such records
    check them, and the source of the records' JSON Schemas."""
    hints = {name: _mirrored(_field_types(cls)[name]) for name in cls.__struct_fields__}
    fields: dict[str, Any] = {}
    config = cls.__struct_config__
    if isinstance(config.tag, str) and config.tag_field is not None:
        fields[config.tag_field] = (Literal[config.tag], ...)  # msgspec writes it always
    for info in msgspec.structs.fields(cls):
        if info.default is not msgspec.NODEFAULT:
            default: Any = info.default
        elif info.default_factory is not msgspec.NODEFAULT:
            default = Field(default_factory=info.default_factory)
        else:
            default = ...
        fields[info.name] = (hints[info.name], default)
    extra: Literal["forbid", "ignore"] = "forbid" if config.forbid_unknown_fields else "ignore"
    model: type[BaseModel] = create_model(
        cls.__name__, __config__=ConfigDict(frozen=True, extra=extra), __doc__=cls.__doc__,
        __module__=cls.__module__, **fields)
    _RECORD_OF[model] = cls
    return model


def _mirrored(hint: Any) -> Any:
    """`hint` with every record class in it replaced by its pydantic mirror."""
    if isinstance(hint, type) and issubclass(hint, Record):
        return pydantic_model(hint)
    origin = get_origin(hint)
    if origin is None or origin is Literal:
        return hint
    args = get_args(hint)
    if origin is Annotated:
        return Annotated[(_mirrored(args[0]), *hint.__metadata__)]
    mirrored = tuple(_mirrored(arg) for arg in args)
    if origin in (Union, UnionType):
        return Union[mirrored]  # noqa: UP007
    return origin[mirrored]


