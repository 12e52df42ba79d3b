"""A2A JSON-RPC requests whose `params` do not have the shape of their method's request,
refused naming the field (`params.message.parts[0].text: must be a string, not a
number`) before the SDK parses them: its parser answers a bare "Invalid params" for
some, and for others (an object given as a string) parses nothing at all, so the
message the caller sent is not the one the gateway would run."""

from typing import Any, cast

from a2a.server.request_handlers.response_helpers import build_error_response
from a2a.server.routes.jsonrpc_dispatcher import JsonRpcDispatcher
from a2a.utils.errors import InvalidParamsError
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message as ProtoMessage
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tether.gateway.answers import json_kind

# Well-known types with a JSON form of their own (Value: any JSON value).
_WELL_KNOWN_KINDS: dict[str, tuple[type, str]] = {
    "google.protobuf.Struct": (dict, "an object"), "google.protobuf.ListValue": (list, "a list"),
    "google.protobuf.Timestamp": (str, "a string"), "google.protobuf.Duration": (str, "a string"),
    "google.protobuf.FieldMask": (str, "a string"),
}
_SCALAR_KINDS: dict[int, tuple[tuple[type, ...], str]] = {
    FieldDescriptor.CPPTYPE_STRING: ((str,), "a string"),
    FieldDescriptor.CPPTYPE_BOOL: ((bool,), "true or false"),
    FieldDescriptor.CPPTYPE_ENUM: ((str, int), "an enum name"),
    FieldDescriptor.CPPTYPE_INT32: ((int, str), "an integer"),
    FieldDescriptor.CPPTYPE_INT64: ((int, str), "an integer"),
    FieldDescriptor.CPPTYPE_UINT32: ((int, str), "an integer"),
    FieldDescriptor.CPPTYPE_UINT64: ((int, str), "an integer"),
    FieldDescriptor.CPPTYPE_FLOAT: ((int, float, str), "a number"),
    FieldDescriptor.CPPTYPE_DOUBLE: ((int, float, str), "a number"),
}


def params_problem(params: Any, request: Descriptor) -> str | None:
    """What is wrong with the shape of `params` as a `request`, naming the field; None
    when nothing is (the values themselves are the handler's to check)."""
    if not isinstance(params, dict):
        return f"params: must be an object (a {request.name}), not {json_kind(params)}"
    return _object_problem(params, request, "params")


def _object_problem(value: dict[str, Any], message: Descriptor, path: str) -> str | None:
    fields = {**message.fields_by_name, **{f.json_name: f for f in message.fields}}
    for name, item in value.items():
        field = fields.get(name)
        if field is None or item is None:  # unknown fields are ignored, null is unset
            continue
        where = f"{path}.{name}"
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            if not isinstance(item, dict):
                return f"{where}: must be an object, not {json_kind(item)}"
            entry = field.message_type.fields_by_name["value"]
            for key, entry_value in item.items():
                problem = _value_problem(entry_value, entry, f"{where}.{key}")
                if problem:
                    return problem
        elif field.is_repeated:
            if not isinstance(item, list):
                return f"{where}: must be a list, not {json_kind(item)}"
            for index, element in enumerate(item):
                problem = _value_problem(element, field, f"{where}[{index}]")
                if problem:
                    return problem
        else:
            problem = _value_problem(item, field, where)
            if problem:
                return problem
    return None


def _value_problem(value: Any, field: FieldDescriptor, where: str) -> str | None:
    if value is None:
        return None
    message = field.message_type
    if message is not None:
        if message.full_name in _WELL_KNOWN_KINDS:
            kind, said = _WELL_KNOWN_KINDS[message.full_name]
            if not isinstance(value, kind):
                return f"{where}: must be {said}, not {json_kind(value)}"
            return None
        if message.full_name.startswith("google.protobuf."):
            return None  # Value and the wrappers: any JSON value of theirs
        if not isinstance(value, dict):
            return f"{where}: must be an object, not {json_kind(value)}"
        return _object_problem(value, message, where)
    kinds, said = _SCALAR_KINDS.get(field.cpp_type, ((object,), "a value"))
    wrong = (not isinstance(value, kinds)
             or (isinstance(value, bool) and bool not in kinds)
             # Protobuf's JSON takes numbers as strings too, when they are numerals.
             or (isinstance(value, str) and kinds[0] is not str and not _numeral(value)))
    return f"{where}: must be {said}, not {json_kind(value)}" if wrong else None


def _numeral(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class NamedParamsDispatcher(JsonRpcDispatcher):
    """The SDK's JSON-RPC dispatcher, with `params` checked for shape first."""

    async def handle_requests(self, request: Request) -> Response:
        try:
            body = await request.json()  # Starlette keeps it for the SDK's own read
        except (ValueError, HTTPException):
            body = None  # not JSON, or too large: the SDK answers that
        method = body.get("method") if isinstance(body, dict) else None
        model = self.METHOD_TO_MODEL.get(method) if isinstance(method, str) else None
        if isinstance(body, dict) and model is not None and "params" in body:
            problem = params_problem(body["params"],
                                     cast("type[ProtoMessage]", model).DESCRIPTOR)
            if problem is not None:
                request_id = body.get("id")
                if not isinstance(request_id, str | int) or isinstance(request_id, bool):
                    request_id = None
                return JSONResponse(build_error_response(
                    request_id, InvalidParamsError(message=problem)))
        return await super().handle_requests(request)
