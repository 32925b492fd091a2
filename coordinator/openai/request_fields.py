"""One field of an OpenAI request body, read with its kind checked: a wrong kind, a non-finite
number or an integer beyond the coordinator's frames is a 400 naming the field."""

from __future__ import annotations

import math
from typing import Any

from fusedserve.coordinator.openai.api_error import ApiError
from fusedserve.coordinator.sampling_params import is_kind


def get(body: dict, key: str, kind: type, default: Any = None) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if not is_kind(value, kind):
        want = "a number" if kind is float else f"of type {kind.__name__}"
        raise ApiError(400, f"'{key}' must be {want}, got {type(value).__name__}", param=key,
                       code="bad_field")
    if kind is float and not math.isfinite(value):
        raise ApiError(400, f"'{key}' must be finite", param=key, code="bad_field")
    if is_kind(value, int) and not wire_int(value):
        raise ApiError(400, f"'{key}' is {value}: beyond any accepted value", param=key, code="bad_param")
    return value


def wire_int(value: int) -> bool:
    """Whether an integer fits the coordinator's frames (msgpack: [-2^63, 2^64))."""
    return -(1 << 63) <= value < 1 << 64
