"""The SSD store's index: one JSON file per store folder, written atomically (temp file, fsync, rename)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from mobiuspipe.errors import SwapIOError

FORMAT = "mobiuspipe-ssd-store"
VERSION = 1
INDEX = "index.json"


@dataclass
class Entry:
    """One stored tensor: its file, type, shape, byte count and checksum (algo 'crc32c' or 'crc32').

    damaged: why the file's bytes cannot be trusted (its last write failed), or "" when they can.
    """

    file: str
    dtype: str
    shape: list[int]
    nbytes: int
    crc: int
    algo: str
    damaged: str = ""


@dataclass
class Index:
    """Everything the folder holds: entries by key, small JSON metadata, the next file number."""

    entries: dict[str, Entry] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    next_file: int = 0

    def new_file(self) -> str:
        """A fresh data file name."""
        name = f"t{self.next_file:08d}.bin"
        self.next_file += 1
        return name


def load(folder: str) -> Index:
    """The index in folder, or an empty one when there is none; a damaged index is a SwapIOError."""
    path = os.path.join(folder, INDEX)
    if not os.path.exists(path):
        return Index()
    try:
        with open(path) as f:
            doc = json.load(f)
        if doc.get("format") != FORMAT or doc.get("version") != VERSION:
            raise ValueError(
                f"format {doc.get('format')!r} version {doc.get('version')!r}, expected {FORMAT!r} version {VERSION}"
            )
        entries = {k: Entry(**e) for k, e in doc["entries"].items()}
        return Index(entries, dict(doc.get("meta", {})), int(doc["next_file"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SwapIOError(
            f"{path} is not a readable store index ({type(exc).__name__}: {exc}): the folder "
            "was not written by this version of mobiuspipe, or the index is damaged; move the "
            "folder away to start afresh",
            path,
        ) from exc


def save(folder: str, index: Index) -> None:
    """Write the index atomically: a reader sees the old one or the new one, never a mix."""
    path = os.path.join(folder, INDEX)
    tmp = f"{path}.tmp{os.getpid()}"
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "next_file": index.next_file,
        "meta": index.meta,
        "entries": {k: asdict(e) for k, e in index.entries.items()},
    }
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(folder)
    except OSError as exc:
        raise SwapIOError(
            f"cannot write the store index {path}: {exc}; the previous index is kept", path, errno=exc.errno or 0
        ) from exc


def fsync_path(path: str | os.PathLike) -> None:
    """Make a file's bytes, or a folder's entries (a rename or a new file in it), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
