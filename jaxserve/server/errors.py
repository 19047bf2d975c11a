"""HTTP errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Validation messages name the bad value and, for a number out of range, the allowed range, which
is read from the model's own JSON schema so that the message and the OpenAPI document agree.
"""

from __future__ import annotations

import functools

from aiohttp import web
from pydantic import BaseModel, ValidationError

from jaxserve.server import openai_protocol
from jaxserve.server.openai_protocol import ErrorInfo, ErrorResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
          500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error reply; raise it from a handler and the error middleware sends it."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def info(self) -> ErrorInfo:
        return ErrorInfo(message=self.message, type=_TYPES.get(self.status, "error"), param=self.param,
                         code=self.code)

    def response(self) -> web.Response:
        body = ErrorResponse(error=self.info()).model_dump_json()
        return web.Response(status=self.status, text=body, content_type="application/json",
                            headers=self.headers)


def validation_error(error: ValidationError, model: type[BaseModel]) -> APIError:
    """The most specific problem pydantic found, as a 400 naming the field, its value and what is
    allowed."""
    problems = [(_path(e["loc"]), e) for e in error.errors(include_url=False)]
    path, problem = max(problems, key=lambda p: len(p[0]))  # the deepest: the union member that got furthest
    param = path[0] if path else None
    shown = ".".join(path) or "body"
    if problem["type"] == "extra_forbidden":
        name = ".".join(str(p) for p in problem["loc"])
        return APIError(400, f"{name} is not a supported parameter", name, "unknown_parameter")
    if problem["type"] == "missing":
        return APIError(400, f"{shown} is required", param, "missing_field")
    allowed = _allowed_range(model, param) if len(path) == 1 else None
    if allowed and problem["type"] in _BOUND_ERRORS:
        return APIError(400, f"{shown}={problem['input']!r} is out of range: must be {allowed}", param,
                        "invalid_value")
    reasons = dict.fromkeys(e["msg"] for p, e in problems if p == path)
    return APIError(400, f"{shown}={problem.get('input')!r} is invalid: {'; or '.join(reasons)}", param,
                    "invalid_value")


def _path(loc: tuple) -> list[str]:
    # Drops the union-member tags pydantic puts in locations ("str", "list[int]", ...).
    return [str(p) for p in loc if isinstance(p, int) or p in _FIELD_NAMES]


_BOUND_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")
_FIELD_NAMES = frozenset(name for model in vars(openai_protocol).values()
                         if isinstance(model, type) and issubclass(model, BaseModel)
                         for name in model.model_fields)


@functools.cache
def _schema_properties(model: type[BaseModel]) -> dict:
    return model.model_json_schema().get("properties", {})


def _allowed_range(model: type[BaseModel], field: str | None) -> str | None:
    """'in [0, 2]', 'in (0, 1]', '>= 1', ... from the field's JSON schema; None if it has no bounds."""
    schema = _schema_properties(model).get(field or "", {})
    for option in [schema, *schema.get("anyOf", [])]:
        low = ("[", option["minimum"]) if "minimum" in option else (
            ("(", option["exclusiveMinimum"]) if "exclusiveMinimum" in option else None)
        high = (option["maximum"], "]") if "maximum" in option else (
            (option["exclusiveMaximum"], ")") if "exclusiveMaximum" in option else None)
        if low and high:
            return f"in {low[0]}{low[1]}, {high[0]}{high[1]}"
        if low:
            return f"{'>=' if low[0] == '[' else '>'} {low[1]}"
        if high:
            return f"{'<=' if high[1] == ']' else '<'} {high[0]}"
    return None
