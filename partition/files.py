"""Plain data files (plans, profiles): YAML, or JSON by suffix, written and read back exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

__all__ = ["write_data", "read_data"]


def write_data(d: Any, path: str | Path) -> None:
    """d as JSON when the suffix is .json, YAML (keys in their order) otherwise."""
    path = Path(path)
    path.write_text(json.dumps(d, indent=2) + "\n" if path.suffix == ".json" else yaml.safe_dump(d, sort_keys=False))


def read_data(path: str | Path, error: type[Exception], what: str, how_to_write: str) -> Any:
    """The parsed file; `error` naming the file for an unreadable, non-UTF-8 or malformed one.

    JSON is read as JSON: YAML 1.1 would read JSON floats such as 1e-05 as strings.
    """
    path = Path(path)
    is_json = path.suffix == ".json"
    try:
        text = path.read_text(encoding="utf-8")
        return json.loads(text) if is_json else yaml.safe_load(text)
    except OSError as e:
        raise error(f"cannot read {what} file {path}: {e.strerror or e}; write one with {how_to_write}") from e
    except UnicodeDecodeError as e:
        raise error(f"{what} file {path} is not UTF-8 text ({e.reason} at byte {e.start}); "
                    f"write one with {how_to_write}") from e
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise error(f"{what} file {path} is not valid {'JSON' if is_json else 'YAML'}: {e}") from e
