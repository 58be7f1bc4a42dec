"""The one loader: typed frozen dataclasses from YAML/JSON files or plain data, every problem reported at once.

    plan = load_file(Plan, "plan.yaml", what="plan", error=PlanFileError, fix="write one with ...")
    save_file(plan, "plan.json")                         # JSON by suffix; load_file gives back an equal Plan

Building checks, for every key of every mapping: unknown keys (with the closest valid one), missing
required keys, types (see foundation.hints; an integer must fit in 64 bits), then impossible values (a
Checked class's check_values(), or a check passed in `checks` for a class the caller does not own). One
exception of the caller's class is raised naming the file (or "<dict>"), and for each problem the dotted
key, what was expected, what was found and the fix. Field metadata tunes a field:
  "convert": callable   raw value -> field value, ValueError(what was expected) when it cannot
                        (e.g. foundation.units.as_bytes for "24GiB")
  "fix": str            the fix shown when "convert" fails
  "path_fix": str       the field holds a file path: made absolute against the file's folder, it must
                        exist, else this fix is shown
  "path_suffixes": tuple  with "path_fix": only a value ending in one of these is a path (e.g. a layout
                        file); any other (e.g. a preset name) is left as written
  "or_folder": True     with "path_fix": an existing folder is taken too
  "folder_fix": str     the same for a folder path: it must be an existing folder
  "out_path": True      the field holds a path the program writes (it need not exist yet): made absolute
                        against the file's folder; "" is left as written (for the class's own check)
  "in_file": False      the field is not a key of the file (pass it in `extra`)
  "example": str        the value shown in the fix when the key is missing (default: one of its type)
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from foundation.checked import (
    Checked,
    InvalidValues,
    Problem,
    at_least,
    check_fields,
    format_problems,
    join_key,
    non_empty,
    part_of,
    positive,
    rule,
)
from foundation.files import dump_text, read_file, write_file
from foundation.hints import (
    Mismatch,
    describe,
    example,
    field_hints,
    found_text,
    scalar,
    tuple_items,
    type_fix,
    unwrap_optional,
)

__all__ = [
    "Builder",
    "from_plain",
    "load_file",
    "to_plain",
    "save_file",
    "file_fields",
    "INVALID",
    "Check",
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
    "part_of",
    "read_file",
    "write_file",
    "dump_text",
    "found_text",
    "field_hints",
]

INVALID: Any = object()
"""Marker for a value that could not be made; its problems are in the Builder."""

Check = Callable[[types.SimpleNamespace], list[Problem]]
"""A check of a class's values (a namespace of every field, defaults filled in): the problems, keys
relative to the object."""


def file_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of `cls` that are keys of its files (metadata `in_file: False` marks one that is not)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("in_file", True)]


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default_factory is dataclasses.MISSING else f.default_factory()


def _unknown_key(key: Any, valid: list[str], prefix: str) -> Problem:
    """An unknown key, with the closest valid key and the list of valid keys."""
    name = str(key)
    close = difflib.get_close_matches(name.lower(), valid, n=1, cutoff=0.5)
    fix = f"did you mean {close[0]!r}?" if close else "remove it or correct its spelling"
    return Problem(
        join_key(prefix, name),
        f"one of the keys of {prefix or 'the top level'}: {', '.join(valid)}",
        f"unknown key {name!r}",
        fix,
    )


def _missing_key(f: dataclasses.Field, hint: Any, prefix: str) -> Problem:
    """A required key that is not there."""
    return Problem(
        join_key(prefix, f.name),
        f"{describe(hint)} (a required key)",
        "nothing: the key is missing",
        f"add `{f.name}: {f.metadata.get('example') or example(hint)}`" + (f" under {prefix}" if prefix else ""),
    )


def _not_mapping(cls: type, data: Any, prefix: str) -> Problem:
    """A section, a list item or the whole file that is not a mapping of keys to values."""
    keys = [f.name for f in file_fields(cls)]
    if prefix:
        fix = f"write `{keys[0]}: ...` and the other keys as a mapping under {prefix}"
    else:
        fix = f"write the file as `key: value` lines, such as `{keys[0]}: ...`"
    return Problem(prefix or "(top level)", f"a mapping with keys among {', '.join(keys)}", found_text(data), fix)


class Builder:
    """Makes dataclasses from plain data (mappings, lists, scalars), recording every problem; `finish`
    raises them all as one `error` naming `where`."""

    def __init__(
        self,
        where: str,
        error: type[Exception],
        *,
        base_dir: str | os.PathLike | None = None,
        checks: Mapping[type, Check] | None = None,
    ):
        self.where, self.error = where, error
        self.base_dir = os.path.abspath(base_dir or os.getcwd())
        self.checks = dict(checks or {})
        self.problems: list[Problem] = []

    def add(self, problems: typing.Iterable[Problem], prefix: str = "") -> None:
        """Record problems whose keys are relative to `prefix`."""
        self.problems.extend(p.under(prefix) for p in problems)

    def finish(self, obj: Any) -> Any:
        """`obj` when nothing was wrong; else raise `error` listing every problem."""
        if self.problems:
            raise self.error(format_problems(self.where, self.problems))
        return obj

    def build(self, cls: type, data: Any, prefix: str = "", extra: Mapping[str, Any] | None = None) -> Any:
        """An instance of dataclass `cls` from a mapping; INVALID (problems recorded) where it cannot be made.

        `extra` holds field values given in code rather than in the data (INVALID there fails the build).
        """
        if isinstance(data, cls):
            return data
        if data is None and prefix and not any(_required(f) for f in file_fields(cls)):
            data = {}  # an empty section (`train:` alone) means all its defaults
        if not isinstance(data, Mapping):
            self.problems.append(_not_mapping(cls, data, prefix))
            return INVALID
        values = self._fields(cls, data, prefix, extra or {})
        if any(v is INVALID for v in values.values()):
            return INVALID
        return self._construct(cls, values, prefix)

    def _fields(self, cls: type, data: Mapping, prefix: str, extra: Mapping[str, Any]) -> dict[str, Any]:
        """The value of every key in `data`, then `extra`; unknown and missing keys recorded (a missing one
        as INVALID)."""
        fields, hints = {f.name: f for f in file_fields(cls)}, field_hints(cls)
        values: dict[str, Any] = {}
        for key, raw in data.items():
            if not isinstance(key, str) or key not in fields:
                self.problems.append(_unknown_key(key, list(fields), prefix))  # the known keys are still checked
                continue
            values[key] = self.value(hints[key], raw, join_key(prefix, key), fields[key])
        for name, f in fields.items():
            if name not in data and name not in extra and _required(f):
                self.problems.append(_missing_key(f, hints[name], prefix))
                values[name] = INVALID
        return values | dict(extra)

    def _construct(self, cls: type, values: dict[str, Any], prefix: str) -> Any:
        """Run the caller's check of `cls`, then `cls(**values)`, recording a Checked class's problems."""
        check = self.checks.get(cls)
        if check is not None:
            every = {f.name: _default(f) for f in dataclasses.fields(cls) if not _required(f)} | values
            problems = check(types.SimpleNamespace(**every))
            if problems:
                self.add(problems, prefix)
                return self._despite(cls, values)
        try:
            return cls(**values)
        except InvalidValues as err:
            self.add(err.problems, prefix)
            return INVALID
        except self.error as err:  # a class's own check that a `checks` entry missed: still name the file
            if self.problems:  # built from parts with problems already named: those say it
                return INVALID
            raise self.error(f"{self.where}: {prefix or '(top level)'}: {err}") from err

    def _despite(self, cls: type, values: dict[str, Any]) -> Any:
        """`cls` built from values whose check found problems (recorded: finish() raises them), so that the checks
        of what holds it still run and every problem is named at once; INVALID where it cannot be built."""
        try:
            return cls(**values)
        except (ValueError, TypeError, self.error):  # the values are known to be wrong: its objection adds nothing
            return INVALID

    def value(self, hint: Any, raw: Any, key: str, field: dataclasses.Field | None = None) -> Any:
        """`raw` made into a value of type `hint` at dotted `key`; INVALID (problems recorded) when it cannot."""
        meta = field.metadata if field is not None else {}
        inner, optional = unwrap_optional(hint)
        if raw is None and optional:
            return None
        if "convert" in meta:
            try:
                raw = meta["convert"](raw)
            except ValueError as err:
                fix = meta.get("fix") or f"write e.g. `{key.rsplit('.', 1)[-1]}: {example(hint)}`"
                self.problems.append(Problem(key, str(err), found_text(raw), fix))
                return INVALID
            if raw is None and optional:  # a word the converter reads as None ("auto")
                return None
        if isinstance(inner, type) and dataclasses.is_dataclass(inner):
            return self.build(inner, raw, key)
        if typing.get_origin(inner) is tuple:
            return self._items(inner, raw, key, field)
        try:
            made = scalar(raw, inner)
        except Mismatch:
            self._wrong_type(hint, raw, key, field)
            return INVALID
        if inner is int and not -(2**63) <= made < 2**63:  # what torch, numpy and the C++ side can hold
            name = key.rsplit(".", 1)[-1]
            self.problems.append(
                Problem(
                    key,
                    "an integer of 64 bits, between -2**63 and 2**63 - 1",
                    found_text(raw),
                    f"write a smaller {name}",
                )
            )
            return INVALID
        if "path_fix" in meta and made.endswith(meta.get("path_suffixes", "")):
            return self._path(made, key, meta["path_fix"], None if meta.get("or_folder") else False)
        if "folder_fix" in meta:
            return self._path(made, key, meta["folder_fix"], folder=True)
        return self._absolute(made) if meta.get("out_path") and made else made

    def _wrong_type(self, hint: Any, raw: Any, key: str, field: dataclasses.Field | None) -> None:
        """Record that `raw` at `key` is not of type `hint`, with a fix for a key or for a list item."""
        if field is None:
            fix = f"write each item as {describe(hint)}, e.g. {example(hint)}"
        else:
            fix = type_fix(field.name, hint, raw, field.default)
        self.problems.append(Problem(key, describe(hint), found_text(raw), fix))

    def _items(self, hint: Any, raw: Any, key: str, field: dataclasses.Field | None) -> Any:
        """A tuple from a list, each item made at `key[i]`; INVALID if the list or any item is wrong."""
        items = tuple_items(hint, len(raw)) if isinstance(raw, (list, tuple)) else None
        if items is None:
            self._wrong_type(hint, raw, key, field)
            return INVALID
        made = tuple(self.value(h, v, f"{key}[{i}]") for i, (h, v) in enumerate(zip(items, raw)))
        return INVALID if any(v is INVALID for v in made) else made

    def _absolute(self, value: str) -> str:
        """`value` with `~` expanded, made absolute against the file's folder (base_dir)."""
        return os.path.normpath(os.path.join(self.base_dir, os.path.expanduser(value)))

    def _path(self, value: str, key: str, fix: str, folder: bool | None = False) -> Any:
        """A relative path made absolute against the file's folder; the file (`folder`: the folder; None: either)
        must exist, else INVALID (the problem recorded): nothing is built on a path that is not there."""
        path = self._absolute(value)
        ok = os.path.exists(path) if folder is None else os.path.isdir(path) if folder else os.path.isfile(path)
        if not ok:
            if os.path.exists(path):
                what = "a file" if folder else "a folder"
            else:
                what = "which does not exist"
            kind = "file or folder" if folder is None else "folder" if folder else "file"
            self.problems.append(
                Problem(
                    key,
                    f"an existing {kind} (a relative path is read from {self.base_dir})",
                    f"{value!r}, i.e. {path}, {what}",
                    fix,
                )
            )
            return INVALID
        return path


def from_plain(
    cls: type,
    data: Any,
    *,
    where: str,
    error: type[Exception],
    base_dir: str | os.PathLike | None = None,
    extra: Mapping[str, Any] | None = None,
    checks: Mapping[type, Check] | None = None,
) -> Any:
    """Build `cls` from plain data; raise `error` naming `where` and listing every problem.

    Relative paths start at `base_dir` (default: the current folder); `extra` gives fields that are not
    keys of the data; `checks` adds value checks to classes that are not Checked.
    """
    builder = Builder(where, error, base_dir=base_dir, checks=checks)
    return builder.finish(builder.build(cls, data, "", extra))


def load_file(
    cls: type, path: str | os.PathLike, *, what: str, error: type[Exception], fix: str, **options: Any
) -> Any:
    """Read a YAML (or .json) file strictly and build `cls` from it; `error` names "`what` `path`".

    An empty file means every default when `cls` requires no key. `fix` says how to get a good file when
    this one cannot be read; `options` go to from_plain (relative paths start at the file's folder unless
    `base_dir` says otherwise).
    """
    where = f"{what} {os.fspath(path)}"
    data = read_file(path, where=where, error=error, fix=fix)
    if data is None and not any(_required(f) for f in file_fields(cls)):
        data = {}
    options.setdefault("base_dir", os.path.dirname(os.path.abspath(path)))
    return from_plain(cls, data, where=where, error=error, **options)


def to_plain(obj: Any) -> Any:
    """A dataclass as plain dicts, lists and scalars (file keys only): what from_plain builds back."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in file_fields(type(obj))}
    if isinstance(obj, (tuple, list)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj


def save_file(obj: Any, path: str | os.PathLike, header: str = "") -> Path:
    """Write a dataclass (or plain data) as YAML, or JSON when the suffix is .json; load_file reads it back
    equal. OSError when the file cannot be written."""
    return write_file(to_plain(obj), path, header)
