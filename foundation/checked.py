"""Problems with a dataclass's values (key, expected, found, fix) and Checked, the mixin that finds them."""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, ClassVar

from foundation.errors import UserError
from foundation.hints import Mismatch, coerce, describe, field_hints, found_text, type_fix

__all__ = [
    "Problem",
    "join_key",
    "format_problems",
    "InvalidValues",
    "Checked",
    "check_fields",
    "rule",
    "at_least",
    "positive",
    "non_empty",
]


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong in some data: where (dotted key), what was expected, what was found, the fix."""

    key: str
    expected: str
    found: str
    fix: str

    def under(self, prefix: str) -> Problem:
        """The same problem with its key placed under `prefix` (a section, or a list item like `gpus[2]`)."""
        return dataclasses.replace(self, key=join_key(prefix, self.key))

    def __str__(self) -> str:
        return f"{self.key}: expected {self.expected}, found {self.found}; fix: {self.fix}"


def join_key(prefix: str, key: str) -> str:
    """`train` + `lr` -> `train.lr`; `gpus` + `[2]` -> `gpus[2]`; an empty prefix leaves the key alone. A key that
    is blank, padded or unprintable (a line break) is quoted as Python writes it: `gpus[0]['\\n']`, so a message
    stays one line and shows the key."""
    if not key.isprintable() or not key.strip() or key != key.strip():
        return f"{prefix}[{key!r}]"
    if not prefix:
        return key
    return f"{prefix}{key}" if key.startswith("[") else f"{prefix}.{key}"


def format_problems(where: str, problems: typing.Sequence[Problem]) -> str:
    """Every problem on one line, after `where`: "f.yaml: k: expected ..." or "f.yaml: 2 errors: (1) ... (2) ..."."""
    if len(problems) == 1:
        return f"{where}: {problems[0]}"
    listed = " ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
    return f"{where}: {len(problems)} errors: {listed}"


class InvalidValues(UserError, ValueError):
    """A Checked dataclass was given values of the wrong type or impossible values; `problems` lists them.

    Subclass it together with a package's error to make that package's classes raise its error, e.g.
    `class InvalidPlan(InvalidValues, PlanFileError)`.
    """

    def __init__(self, owner: str, problems: typing.Iterable[Problem]):
        self.owner = owner
        self.problems = tuple(problems)
        super().__init__(format_problems(owner, self.problems))

    def __reduce__(self):
        return (type(self), (self.owner, self.problems))


def check_fields(obj: Any) -> list[Problem]:
    """Check every field of a dataclass instance against its type hint, canonicalizing it in place."""
    problems = []
    hints = field_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, hint = getattr(obj, f.name), hints[f.name]
        try:
            object.__setattr__(obj, f.name, coerce(value, hint))
        except Mismatch:
            problems.append(
                Problem(f.name, describe(hint), found_text(value), type_fix(f.name, hint, value, f.default))
            )
    return problems


class Checked:
    """Mixin for frozen dataclasses: `__post_init__` checks the field types, then `check_values()`, and
    raises `invalid` (InvalidValues or a subclass) listing every problem; the loader reports them per key."""

    invalid: ClassVar[type[InvalidValues]] = InvalidValues

    def check_values(self) -> list[Problem]:
        """Impossible values (types already checked), keys relative to this object; override per class."""
        return []

    def __post_init__(self) -> None:
        problems = check_fields(self) or self.check_values()
        if problems:
            raise self.invalid(type(self).__name__, problems)


# ---- value rules for check_values(): each gives no problem, or one ----


def rule(ok: bool, key: str, expected: str, found: str, fix: str) -> list[Problem]:
    """No problem if `ok`, else one."""
    return [] if ok else [Problem(key, expected, found, fix)]


def at_least(obj: Any, name: str, low: int, fix: str) -> list[Problem]:
    """Integer field `name` of `obj` must be >= `low`."""
    value = getattr(obj, name)
    return rule(value >= low, name, f"an integer >= {low}", found_text(value), fix)


def positive(obj: Any, name: str, fix: str, zero_ok: bool = False, what: str = "a finite number") -> list[Problem]:
    """Number field `name` of `obj` must be finite and > 0 (>= 0 when `zero_ok`); `what` names the number."""
    value = getattr(obj, name)
    ok = math.isfinite(value) and (value >= 0 if zero_ok else value > 0)
    return rule(ok, name, f"{what} {'>=' if zero_ok else '>'} 0", found_text(value), fix)


def part_of(obj: Any, name: str, whole: str, fix: str) -> list[Problem]:
    """Optional integer field `name` of `obj` must be None (all of it) or within [0, field `whole`]."""
    value, total = getattr(obj, name), getattr(obj, whole)
    ok = value is None or 0 <= value <= total
    return rule(ok, name, f"a count in [0, {whole} = {total}] or null (all of it)", found_text(value), fix)


def non_empty(obj: Any, name: str, fix: str) -> list[Problem]:
    """String field `name` of `obj` must say something."""
    value = getattr(obj, name)
    return rule(value != "", name, "a non-empty string", found_text(value), fix)
