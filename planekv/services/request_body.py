"""What a JSON request body may hold, on both services: finite numbers only, and no type coercion.

Python's json module reads ``NaN``, ``Infinity`` and ``-Infinity`` (none of them JSON) and turns
``1e999`` into infinity; such a value used to reach the models and break the 422 answer (a 500).
Routers built with ``route_class=FiniteJSONRoute`` refuse the body instead (400, naming the field).
Request models derive from :class:`RequestBody`: strict, so ``false`` is not the integer 0.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import HTTPException, Request
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict
from starlette.responses import Response


class _NonFinite:
    """Stands in for a non-finite number while the body is searched for where it is."""

    def __init__(self, token: str) -> None:
        self.token = token


def _locate(value: Any, where: str) -> tuple[str, str] | None:
    """(path, token) of the first non-finite number in a parsed body, if any."""
    if isinstance(value, _NonFinite):
        return where, value.token
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _locate(item, f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]")
        if found:
            return found
    return None


def loads_finite(body: bytes) -> Any:
    """The JSON body, or HTTPException(400) naming the first NaN or infinite number in it."""
    seen = False

    def constant(token: str) -> _NonFinite:
        nonlocal seen
        seen = True
        return _NonFinite(token)

    def number(token: str) -> float | _NonFinite:
        x = float(token)
        return x if math.isfinite(x) else constant(token)

    data = json.loads(body, parse_constant=constant, parse_float=number)
    if seen:
        found = _locate(data, "body")
        assert found is not None
        where, token = found
        raise HTTPException(400, f"{where} is {token}, which is not a finite number: JSON bodies may hold only "
                                 "finite numbers (no NaN or Infinity, magnitude below 1.8e308); send a finite "
                                 "value there")
    return data


class FiniteJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads_finite(await self.body())
        return self._json


class FiniteJSONRoute(APIRoute):
    """A route whose JSON body is read by :func:`loads_finite` (FastAPI passes its HTTPException on)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def finite_json_handler(request: Request) -> Response:
            return await handler(FiniteJSONRequest(request.scope, request.receive))

        return finite_json_handler


class RequestBody(BaseModel):
    """Base of the request models: unknown fields refused, no coercion (a boolean is not a number,
    a string is not an integer). Strictness stops at nested models that do not derive from this."""

    model_config = ConfigDict(extra="forbid", strict=True)
