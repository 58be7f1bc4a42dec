"""Generic strict loading of frozen config dataclasses from YAML mappings, collecting every problem."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import numbers
import os
import re
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any

import yaml

from mobiuspipe.errors import ConfigError

INVALID: Any = object()
"""Marker returned by `build` for a value that could not be made; its problems are in the context."""


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong in a config: where (dotted key), what was expected, what was found, the fix."""

    key: str
    expected: str
    found: str
    fix: str

    def under(self, prefix: str) -> Problem:
        """The same problem with its key placed under a section name."""
        return dataclasses.replace(self, key=join_key(prefix, self.key))

    def __str__(self) -> str:
        return f"{self.key}: expected {self.expected}, found {self.found}; fix: {self.fix}"


def join_key(prefix: str, key: str) -> str:
    """`train` + `lr` -> `train.lr`; an empty prefix leaves the key alone."""
    return f"{prefix}.{key}" if prefix else key


def format_problems(where: str, problems: typing.Sequence[Problem]) -> str:
    """One line for one problem; a header and one line per problem for several."""
    if len(problems) == 1:
        return f"{where}: {problems[0]}"
    return "\n".join([f"{where}: {len(problems)} errors:"] + [f"  - {p}" for p in problems])


class InvalidValues(ConfigError):
    """A config dataclass was given a value of the wrong type or an impossible value."""

    def __init__(self, owner: str, problems: typing.Iterable[Problem]):
        self.owner = owner
        self.problems = tuple(problems)
        super().__init__(format_problems(owner, self.problems))

    def __reduce__(self):
        return (type(self), (self.owner, self.problems))


# ---- types: describe, check and convert a value against a field's type hint ----

_CHECKS: dict[type, typing.Callable[[Any], bool]] = {
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool),
    float: lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
}
_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_PLURALS = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}
_EXAMPLES = {bool: "true", int: "1", float: "1.0", str: '"text"'}
_KINDS = ((bool, "boolean"), (numbers.Integral, "integer"), (numbers.Real, "number"), (str, "string"),
          (list, "list"), (tuple, "list"), (Mapping, "mapping"))


class _Mismatch(Exception):
    """A value does not have its field's type (internal: always turned into a Problem)."""


@functools.lru_cache(maxsize=None)
def field_hints(cls: type) -> dict[str, Any]:
    """The resolved type hints of a dataclass's fields."""
    return typing.get_type_hints(cls)


def unwrap_optional(hint: Any) -> tuple[Any, bool]:
    """`X | None` -> (X, True); any other hint -> (hint, False)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1 or len(args) != 2:
            raise TypeError(f"config type {hint} is not supported: only `X | None` unions are")
        return rest[0], True
    return hint, False


def describe(hint: Any) -> str:
    """Words for what a hint accepts: `a number`, `a string or null`, `a list of 2 numbers`."""
    inner, optional = unwrap_optional(hint)
    if optional:
        return describe(inner) + " or null"
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if len(set(args)) == 1 and args[0] in _PLURALS:
            return f"a list of {len(args)} {_PLURALS[args[0]]}"
        return "a list [" + ", ".join(describe(a) for a in args) + "]"
    if dataclasses.is_dataclass(hint):
        return "a mapping"
    return _NAMES[hint]


def found_text(value: Any) -> str:
    """The kind and value of what was found: `string '64'`, `boolean True`, `null`."""
    if value is None:
        return "null"
    kind = next((name for t, name in _KINDS if isinstance(value, t)), type(value).__name__)
    text = repr(value)
    return f"{kind} {text if len(text) <= 60 else text[:57] + '...'}"


def coerce(value: Any, hint: Any) -> Any:
    """Check `value` against `hint` and return it in canonical form (int -> float, list -> tuple)."""
    inner, optional = unwrap_optional(hint)
    if optional:
        return None if value is None else coerce(value, inner)
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise _Mismatch
        return tuple(coerce(v, a) for v, a in zip(value, args))
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        raise _Mismatch
    if hint not in _CHECKS:
        raise TypeError(f"config type {hint!r} is not supported")
    if not _CHECKS[hint](value):
        raise _Mismatch
    try:
        return hint(value) if hint in (int, float) else value
    except OverflowError:
        raise _Mismatch from None


def example(hint: Any, default: Any = dataclasses.MISSING) -> str:
    """A YAML value that fits `hint`: the field's default where it has one."""
    if default is not dataclasses.MISSING and default is not None:
        return json.dumps(to_plain(default))
    inner, _ = unwrap_optional(hint)
    if typing.get_origin(inner) is tuple:
        return "[" + ", ".join(example(a) for a in typing.get_args(inner)) + "]"
    return "{}" if dataclasses.is_dataclass(inner) else _EXAMPLES[inner]


def _type_fix(name: str, hint: Any, value: Any, default: Any) -> str:
    """How to write a value of the right type for field `name`."""
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


def check_fields(obj: Any) -> list[Problem]:
    """Check every field of a dataclass instance against its type hint, canonicalizing in place."""
    problems = []
    hints = field_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, hint = getattr(obj, f.name), hints[f.name]
        try:
            object.__setattr__(obj, f.name, coerce(value, hint))
        except _Mismatch:
            problems.append(Problem(f.name, describe(hint), found_text(value),
                                    _type_fix(f.name, hint, value, f.default)))
    return problems


class Checked:
    """Mixin for config dataclasses: `__post_init__` checks field types, then `check_values()`."""

    def check_values(self) -> list[Problem]:
        """Impossible values of this section (types already checked); override per section."""
        return []

    def __post_init__(self) -> None:
        problems = check_fields(self) or self.check_values()
        if problems:
            raise InvalidValues(type(self).__name__, problems)


def to_plain(obj: Any) -> Any:
    """A dataclass as plain dicts/lists/scalars (YAML keys only), the inverse of `build`."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in yaml_fields(type(obj))}
    if isinstance(obj, (tuple, list)):
        return [to_plain(v) for v in obj]
    return obj


# ---- building a dataclass from a mapping ----

@dataclasses.dataclass
class _Context:
    """What `build` needs beyond the data: the problems found so far and the folder paths start from."""

    problems: list[Problem]
    base_dir: str


def yaml_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of `cls` that are YAML keys (metadata `yaml: False` marks one that is not)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("yaml", True)]


def _unknown_key(key: Any, valid: list[str], prefix: str) -> Problem:
    """An unknown key, with the closest valid key and the list of valid keys."""
    name = str(key)
    close = difflib.get_close_matches(name.lower(), valid, n=1, cutoff=0.5)
    where = f"section {prefix}" if prefix else "the top level"
    fix = f"did you mean {close[0]!r}?" if close else "remove it or correct its spelling"
    return Problem(join_key(prefix, name), f"one of the keys of {where}: {', '.join(valid)}",
                   f"unknown key {name!r}", fix)


def _not_mapping(cls: type, data: Any, prefix: str) -> Problem:
    """A section (or the whole file) that is not a mapping of keys to values."""
    keys = [f.name for f in yaml_fields(cls)]
    if prefix:
        fix = f"write `{prefix}:` and under it indented lines such as `  {keys[0]}: ...`"
    else:
        fix = "write sections such as `train:` with indented `key: value` lines under them"
    return Problem(prefix or "(top level)", f"a mapping with keys among {', '.join(keys)}",
                   found_text(data), fix)


def _resolve_path(field: dataclasses.Field, value: str, key: str, ctx: _Context) -> str:
    """Make a relative path absolute against the config's folder and check that the file exists."""
    path = os.path.normpath(os.path.join(ctx.base_dir, os.path.expanduser(value)))
    if not os.path.isfile(path):
        what = "a folder" if os.path.isdir(path) else "which does not exist"
        ctx.problems.append(Problem(
            key, f"an existing file (a relative path is read from {ctx.base_dir})",
            f"{value!r}, i.e. {path}, {what}", field.metadata["path_fix"]))
    return path


def _prepare(field: dataclasses.Field, hint: Any, value: Any, key: str, ctx: _Context) -> Any:
    """Build nested sections and resolve path fields; other values go to the dataclass as they are."""
    inner, _ = unwrap_optional(hint)
    if dataclasses.is_dataclass(inner):
        return build(inner, value, key, ctx)
    if "path_fix" in field.metadata and isinstance(value, str):
        return _resolve_path(field, value, key, ctx)
    return value


def build(cls: type, data: Any, prefix: str, ctx: _Context, extra: dict | None = None) -> Any:
    """Make `cls` from a mapping, recording every problem in `ctx`; INVALID where it cannot."""
    if data is None and prefix:
        data = {}  # an empty section (`train:` alone) means all its defaults
    if not isinstance(data, Mapping):
        ctx.problems.append(_not_mapping(cls, data, prefix))
        return INVALID
    fields = {f.name: f for f in yaml_fields(cls)}
    kwargs, nested_failed = dict(extra or {}), False
    for key, value in data.items():
        if not isinstance(key, str) or key not in fields:
            ctx.problems.append(_unknown_key(key, list(fields), prefix))
            continue
        value = _prepare(fields[key], field_hints(cls)[key], value, join_key(prefix, key), ctx)
        nested_failed = nested_failed or value is INVALID
        kwargs[key] = value
    if nested_failed:
        return INVALID
    try:
        return cls(**kwargs)
    except InvalidValues as err:
        ctx.problems.extend(p.under(prefix) for p in err.problems)
        return INVALID


def load_dataclass(cls: type, data: Any, source: str, base_dir: str | None = None,
                   extra: dict | None = None) -> Any:
    """Build `cls` from `data`; raise one ConfigError naming `source` and listing every problem."""
    ctx = _Context(problems=[], base_dir=os.path.abspath(base_dir or os.getcwd()))
    obj = build(cls, data, "", ctx, extra)
    if ctx.problems:
        raise ConfigError(format_problems(f"config {source}", ctx.problems))
    return obj


# ---- reading YAML strictly ----

class StrictLoader(yaml.SafeLoader):
    """SafeLoader that records duplicate keys (with dotted paths) and reads `3e-3` as a float."""

    duplicates: list[Problem] = []

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        self.duplicates = list(_duplicate_keys(node, "", set()))
        return self.construct_document(node)


StrictLoader.add_implicit_resolver(  # YAML 1.1 wants a dot and a signed exponent; people write 3e-3
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _duplicate_keys(node: yaml.Node, path: str, seen: set[int]) -> Iterator[Problem]:
    """Every key written twice in one mapping, anywhere under `node`."""
    if id(node) in seen:
        return
    seen.add(id(node))
    children: list[tuple[str, yaml.Node]] = []
    if isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            name = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
            line = key_node.start_mark.line + 1
            if name in lines:
                yield Problem(join_key(path, name), "each key once per section",
                              f"it at line {lines[name]} and again at line {line}",
                              "delete one of the two lines (YAML would silently keep the last)")
            lines.setdefault(name, line)
            children.append((join_key(path, name), value_node))
    elif isinstance(node, yaml.SequenceNode):
        children = [(f"{path}[{i}]", item) for i, item in enumerate(node.value)]
    for child_path, child in children:
        yield from _duplicate_keys(child, child_path, seen)


def _yaml_reason(err: yaml.YAMLError) -> str:
    """A YAML error on one line, with its line and column."""
    if isinstance(err, yaml.MarkedYAMLError) and err.problem_mark is not None:
        mark = err.problem_mark
        context = f"{err.context}, " if err.context else ""
        return f"{context}{err.problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(err).split())


def read_yaml(path: str) -> Any:
    """Parse one YAML file strictly; every failure is a ConfigError naming the file."""
    where = f"config {path}"
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        raise ConfigError(f"{where}: file not found (current folder {os.getcwd()}); fix: check the "
                          "path, e.g. examples/tiny-gpt.yaml") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{where}: expected UTF-8 text, found byte 0x{err.object[err.start]:02x} "
                          f"at offset {err.start}; fix: save the file as UTF-8") from None
    except OSError as err:
        raise ConfigError(f"{where}: cannot be read ({err.strerror}); fix: pass a readable "
                          "YAML file") from None
    loader = StrictLoader(text)
    try:
        data = loader.get_single_data()
    except yaml.YAMLError as err:
        raise ConfigError(f"{where}: expected valid YAML, found {_yaml_reason(err)}; fix: correct "
                          "the syntax there (indent with spaces, `key: value`)") from None
    finally:
        loader.dispose()
    if loader.duplicates:
        raise ConfigError(format_problems(where, loader.duplicates))
    return data
