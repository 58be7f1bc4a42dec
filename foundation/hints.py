"""Field type hints of loadable dataclasses: what a hint accepts, in words, and values checked against it.

Supported hints: bool, int, float, str, a dataclass, `X | None`, `tuple[A, B]` (fixed length) and
`tuple[A, ...]` (any length). An int is a float; a bool is neither; a list is a tuple.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import numbers
import types
import typing
from collections.abc import Mapping
from typing import Any

__all__ = [
    "Mismatch",
    "field_hints",
    "unwrap_optional",
    "tuple_items",
    "describe",
    "found_text",
    "example",
    "scalar",
    "coerce",
    "type_fix",
]

_CHECKS: dict[type, typing.Callable[[Any], bool]] = {
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool),
    float: lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
}
_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_PLURALS = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}
_EXAMPLES = {bool: "true", int: "1", float: "1.0", str: '"text"'}
_KINDS = (
    (bool, "boolean"),
    (numbers.Integral, "integer"),
    (numbers.Real, "number"),
    (str, "string"),
    (list, "list"),
    (tuple, "list"),
    (Mapping, "mapping"),
)


class Mismatch(Exception):
    """A value does not have the type of its hint (internal: always turned into a Problem)."""


@functools.cache
def field_hints(cls: type) -> dict[str, Any]:
    """The resolved type hints of a dataclass's fields."""
    return typing.get_type_hints(cls)


def unwrap_optional(hint: Any) -> tuple[Any, bool]:
    """`X | None` -> (X, True); any other hint -> (hint, False)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1 or len(args) != 2:
            raise TypeError(f"type {hint} is not supported: only `X | None` unions are")
        return rest[0], True
    return hint, False


def tuple_items(hint: Any, length: int) -> tuple[Any, ...] | None:
    """The item hints of a tuple hint for a list of `length` items; None when the length does not fit.

    `tuple[A, ...]` gives `length` A's; `tuple[A, B]` gives (A, B) for length 2 only.
    """
    args = typing.get_args(hint)
    if len(args) == 2 and args[1] is Ellipsis:
        return (args[0],) * length
    return args if len(args) == length else None


def _is_tuple(hint: Any) -> bool:
    return typing.get_origin(hint) is tuple


def describe(hint: Any) -> str:
    """Words for what a hint accepts: `a number`, `a string or null`, `a list of 2 numbers`."""
    inner, optional = unwrap_optional(hint)
    if optional:
        return describe(inner) + " or null"
    if _is_tuple(hint):
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return "a list of " + _plural(args[0])
        if len(set(args)) == 1 and args[0] in _PLURALS:
            return f"a list of {len(args)} {_PLURALS[args[0]]}"
        return "a list [" + ", ".join(describe(a) for a in args) + "]"
    if dataclasses.is_dataclass(hint):
        return "a mapping"
    return _NAMES[hint]


def _plural(hint: Any) -> str:
    """`numbers`, `mappings`, `lists of strings`: the items of a list."""
    if _is_tuple(hint):
        return "lists" + describe(hint).removeprefix("a list")
    return "mappings" if dataclasses.is_dataclass(hint) else _PLURALS.get(hint, describe(hint))


def found_text(value: Any) -> str:
    """The kind and value of what was found: `string '64'`, `boolean True`, `null`."""
    if value is None:
        return "null"
    kind = next((name for t, name in _KINDS if isinstance(value, t)), type(value).__name__)
    try:
        text = repr(value)
    except RecursionError:  # lists in lists thousands deep (plain data given in code; files stop sooner)
        return f"{kind} nested too deeply to show"
    return f"{kind} {text if len(text) <= 60 else text[:57] + '...'}"


def example(hint: Any, default: Any = dataclasses.MISSING) -> str:
    """A YAML value that fits `hint`: the field's default where it has one."""
    if default is not dataclasses.MISSING and default is not None and not dataclasses.is_dataclass(default):
        return json.dumps(default)
    inner, _ = unwrap_optional(hint)
    if _is_tuple(inner):
        items = tuple_items(inner, 1) or typing.get_args(inner)
        return "[" + ", ".join(example(a) for a in items) + "]"
    return "{...}" if dataclasses.is_dataclass(inner) else _EXAMPLES[inner]


def scalar(value: Any, hint: Any) -> Any:
    """`value` checked against a scalar hint (bool, int, float, str), canonical (numpy int -> int, int ->
    float); Mismatch if it does not fit."""
    if hint not in _CHECKS:
        raise TypeError(f"type {hint!r} is not supported")
    if not _CHECKS[hint](value):
        raise Mismatch
    try:
        return hint(value) if hint in (int, float) else value
    except OverflowError:
        raise Mismatch from None


def coerce(value: Any, hint: Any) -> Any:
    """Check an already-made `value` against `hint`, canonical (int -> float, list -> tuple); a dataclass
    hint takes an instance. Mismatch if it does not fit."""
    inner, optional = unwrap_optional(hint)
    if optional:
        return None if value is None else coerce(value, inner)
    if _is_tuple(hint):
        items = tuple_items(hint, len(value)) if isinstance(value, (list, tuple)) else None
        if items is None:
            raise Mismatch
        return tuple(coerce(v, a) for v, a in zip(value, items))
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        raise Mismatch
    return scalar(value, hint)


def type_fix(name: str, hint: Any, value: Any, default: Any = dataclasses.MISSING) -> str:
    """How to write a value of the right type for the key `name`."""
    inner, _ = unwrap_optional(hint)
    if isinstance(value, str) and inner in (int, float):
        try:
            inner(value.strip())
            return f"remove the quotes: `{name}: {value.strip()}`"
        except ValueError:
            pass
    if isinstance(value, bool) and inner in (int, float):
        return f"true/false is not a number; write a number, e.g. `{name}: {example(hint, default)}`"
    if isinstance(value, bool) and inner is str:
        return f'yes/no/on/off/true/false read as a boolean; quote the text, e.g. `{name}: "no"`'
    return f"write e.g. `{name}: {example(hint, default)}`"
