"""Data files read strictly and written exactly: YAML, or JSON by the .json suffix.

Reading catches what plain parsers let through: a key written twice in one mapping (YAML and JSON would
keep the last silently), and `3e-3` read as a float (YAML 1.1 wants `3.0e-3` and would give a string).
JSON is read as JSON, where YAML 1.1 would read floats such as 1e-05 as strings. Writing quotes every
string the reader would take for something else, so a written file reads back equal.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from foundation.checked import Problem, format_problems, join_key

__all__ = ["read_file", "write_file", "write_text_whole", "fsync_folder", "dump_text", "StrictLoader", "StrictDumper"]

_FLOAT_TAG = "tag:yaml.org,2002:float"
_EXPONENT_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
_DUPLICATE_FIX = "delete one of the two (the parser would silently keep the last)"


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that records duplicate keys (with dotted paths) and reads `3e-3` as a float."""

    duplicates: list[Problem] = []

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        self.duplicates = list(_yaml_duplicates(node, "", set()))
        return self.construct_document(node)


class StrictDumper(yaml.SafeDumper):
    """SafeDumper that quotes strings StrictLoader would read as floats (`"1e5"`)."""


for _cls in (StrictLoader, StrictDumper):  # YAML 1.1 wants a dot and a signed exponent; people write 3e-3
    _cls.add_implicit_resolver(_FLOAT_TAG, _EXPONENT_FLOAT, list("-+0123456789"))


def _twice(first: tuple[int, int], again: tuple[int, int]) -> str:
    """Where a key was written twice: by line, and by column too when both are on one line (a flow mapping)."""
    if first[0] != again[0]:
        return f"it at line {first[0]} and again at line {again[0]}"
    return f"it at line {first[0]}, column {first[1]} and again at column {again[1]}"


def _yaml_duplicates(node: yaml.Node, path: str, seen: set[int]) -> Iterator[Problem]:
    """Every key written twice in one mapping, anywhere under `node`."""
    if id(node) in seen:
        return
    seen.add(id(node))
    children: list[tuple[str, yaml.Node]] = []
    if isinstance(node, yaml.MappingNode):
        places: dict[str, tuple[int, int]] = {}  # key -> (line, column) where it was first written, from 1
        for key_node, value_node in node.value:
            name = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
            here = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            if name in places:
                yield Problem(
                    join_key(path, name), "each key once per mapping", _twice(places[name], here), _DUPLICATE_FIX
                )
            places.setdefault(name, here)
            children.append((join_key(path, name), value_node))
    elif isinstance(node, yaml.SequenceNode):
        children = [(f"{path}[{i}]", item) for i, item in enumerate(node.value)]
    for child_path, child in children:
        yield from _yaml_duplicates(child, child_path, seen)


class _JsonObject(dict):
    """A JSON object that had keys written twice (`twice` names them); only ever seen on the way to an error."""

    twice: list[str]


def _json_object(pairs: list[tuple[str, Any]]) -> dict:
    """object_pairs_hook: a plain dict, or a _JsonObject that remembers its doubled keys."""
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    marked = _JsonObject(obj)
    names = [k for k, _ in pairs]
    marked.twice = sorted({k for k in names if names.count(k) > 1}, key=names.index)
    return marked


def _json_duplicates(data: Any, path: str) -> Iterator[Problem]:
    """Every key written twice in one JSON object, anywhere in `data`."""
    if isinstance(data, dict):
        for name in getattr(data, "twice", ()):
            yield Problem(join_key(path, name), "each key once per object", "it twice", _DUPLICATE_FIX)
        for key, value in data.items():
            yield from _json_duplicates(value, join_key(path, key))
    elif isinstance(data, list):
        for i, item in enumerate(data):
            yield from _json_duplicates(item, f"{path}[{i}]")


def _yaml_reason(err: yaml.YAMLError, text: str) -> str:
    """A YAML error on one line, with its line and column."""
    if isinstance(err, yaml.reader.ReaderError):  # a control character YAML does not allow, before any parsing
        before = text[: err.position]
        line, column = before.count("\n") + 1, err.position - (before.rfind("\n") + 1) + 1
        char = chr(err.character) if isinstance(err.character, int) else err.character
        return f"the character {char!r} (not allowed in YAML) at line {line}, column {column}"
    if isinstance(err, yaml.MarkedYAMLError) and err.problem_mark is not None:
        mark = err.problem_mark
        context = f"{err.context}, " if err.context else ""
        return f"{context}{err.problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(err).split())


def _parse_yaml(text: str, where: str, error: type[Exception]) -> Any:
    try:
        loader = StrictLoader(text)  # its reader already refuses control characters
        try:
            data = loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as err:
        raise error(
            f"{where}: expected valid YAML, found {_yaml_reason(err, text)}; fix: correct the syntax "
            "there (indent with spaces, `key: value`)"
        ) from None
    if loader.duplicates:
        raise error(format_problems(where, loader.duplicates))
    return data


def _parse_json(text: str, where: str, error: type[Exception]) -> Any:
    try:
        data = json.loads(text, object_pairs_hook=_json_object)
    except json.JSONDecodeError as err:
        raise error(
            f"{where}: expected valid JSON, found {err.msg} at line {err.lineno}, column "
            f"{err.colno}; fix: correct the syntax there"
        ) from None
    duplicates = list(_json_duplicates(data, ""))
    if duplicates:
        raise error(format_problems(where, duplicates))
    return data


def read_file(path: str | os.PathLike, *, where: str, error: type[Exception], fix: str) -> Any:
    """The plain data of a YAML file, or a JSON one when the suffix is .json, read strictly.

    Every failure raises `error` starting with `where` (e.g. "plan /x/p.yaml"); `fix` says how to get a
    good file when this one cannot be read.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{where}: file not found (current folder {os.getcwd()}); fix: {fix}") from None
    except UnicodeDecodeError as err:
        raise error(
            f"{where}: expected UTF-8 text, found byte 0x{err.object[err.start]:02x} at offset "
            f"{err.start}; fix: save the file as UTF-8"
        ) from None
    except OSError as err:
        raise error(f"{where}: cannot be read ({err.strerror or err}); fix: {fix}") from None
    parse = _parse_json if Path(path).suffix == ".json" else _parse_yaml
    try:
        return parse(text, where, error)
    except RecursionError:  # the YAML and JSON readers recurse once per level of nesting
        raise error(
            f"{where}: expected lists and mappings nested a few levels deep, found nesting deeper than the "
            f"reader can follow (hundreds of levels); fix: correct the file, whose keys nest only a few levels"
        ) from None


def dump_text(data: Any, suffix: str, header: str = "") -> str:
    """Plain data as JSON text when `suffix` is .json, else as YAML (keys in their order) after `header`
    (comment lines, each starting with "# "); read_file reads it back equal."""
    if suffix == ".json":
        return json.dumps(data, indent=2) + "\n"
    return header + yaml.dump(data, Dumper=StrictDumper, sort_keys=False, allow_unicode=True)


def write_file(data: Any, path: str | os.PathLike, header: str = "") -> Path:
    """Write plain data as dump_text gives it for the path's suffix, replacing the file whole (write_text_whole);
    OSError when the file cannot be written."""
    path = Path(path)
    write_text_whole(path, dump_text(data, path.suffix, header))
    return path


def write_text_whole(path: str | os.PathLike, text: str) -> None:
    """Write `text` (UTF-8) into `path` through a file beside it, flushed to the disk, that then replaces it (a
    symlink's target; the old file's permissions kept): a write that fails (a full disk) leaves the file as it was
    and no partial file. OSError when it cannot be written."""
    path = Path(path).resolve()
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_folder(path.parent)


def fsync_folder(folder: str | os.PathLike) -> None:
    """Flush a folder's entries to the disk (after a rename in it), where the file system allows it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # a file system that cannot sync a folder (EINVAL): the rename stands as the system keeps it
        pass
    finally:
        os.close(fd)


def fsync_files(folder: str | os.PathLike) -> None:
    """Flush every file directly in `folder`, then the folder's entries, to the disk (before a rename publishes it)."""
    for path in sorted(Path(folder).iterdir()):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_folder(folder)
