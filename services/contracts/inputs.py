"""What every input model of every service shares: no extra fields, finite numbers, bounded JSON.

A request or spec body is stored (Redis, JSON) and read back by other processes; a value that
survives validation but not a JSON round trip (NaN, ±Infinity, an overflowing literal such as
``1e309``, a lone UTF-16 surrogate) or that is too deep to serialise would poison the record for
every later reader. So input models refuse them at the door, with the field named.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict

# Free-form JSON (env kwargs, generator options) is bounded so that a body that passed the size
# limit still cannot make a service recurse or allocate without limit.
MAX_JSON_DEPTH = 32
MAX_JSON_ITEMS = 10_000
MAX_STRING_LENGTH = 4_096


class InputModel(BaseModel):
    """Base of every input model: unknown fields, non-finite floats and coerced types are
    refused. Strict, because lax mode reads ``0`` as ``false`` and ``false`` as ``0.0``: a
    client's mistake silently becomes a different experiment."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


def _check_string(value: str, where: str) -> None:
    if len(value) > MAX_STRING_LENGTH:
        raise ValueError(f"{where}: string longer than {MAX_STRING_LENGTH} characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{where}: string is not valid Unicode (lone surrogate)") from None


def check_json_value(value: Any) -> Any:
    """Refuse what JSON cannot carry faithfully, naming the path of the first bad value.

    Iterative (no recursion), so a hostile depth fails on the bound, not on Python's stack.
    """
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    items = 0
    while stack:
        node, path, depth = stack.pop()
        where = path or "(value)"
        items += 1
        if items > MAX_JSON_ITEMS:
            raise ValueError(f"more than {MAX_JSON_ITEMS} values")
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"{where}: nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(node, bool) or node is None:
            continue
        if isinstance(node, float):
            if not math.isfinite(node):
                raise ValueError(f"{where}: must be a finite number, got {node}")
        elif isinstance(node, int):
            continue
        elif isinstance(node, str):
            _check_string(node, where)
        elif isinstance(node, dict):
            for key, child in node.items():
                if not isinstance(key, str):
                    raise ValueError(f"{where}: keys must be strings")
                _check_string(key, f"{where} key")
                stack.append((child, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(node, list | tuple):
            for i, child in enumerate(node):
                stack.append((child, f"{path}[{i}]" if path else f"[{i}]", depth + 1))
        else:
            raise ValueError(f"{where}: {type(node).__name__} is not a JSON value")
    return value


# A JSON object whose every value is finite, bounded in depth and size, and valid Unicode.
JsonObject = Annotated[dict[str, Any], AfterValidator(check_json_value)]
