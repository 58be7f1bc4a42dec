"""An out-of-core AdamW's records in a checkpoint without a second copy: hard links to the store's files
(link_records), and back into a store at resume (adopt_records); a checkpoint of another group size is read
into the records' new layout instead.

A description (JSON) holds the layout (names, shapes, group_elems), the step count and, per record key, its
file in the checkpoint folder with dtype, shape, nbytes and checksum (the store's, computed while writing).
"""

from __future__ import annotations

import errno
import warnings
from dataclasses import asdict
from pathlib import Path

import torch

from mobiuspipe.memory.store.future import checksum
from mobiuspipe.memory.store.index import Entry
from mobiuspipe.optim.ooc_adam import STATE_PARTS, OutOfCoreAdam
from mobiuspipe.optim.ooc_groups import plan_groups, section_elems

__all__ = ["link_records", "adopt_records", "read_records", "RecordError"]


class RecordError(ValueError):
    """A linked record is missing, short or fails its checksum: the message names the file."""


NO_LINKS = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP)
"""os.link's errors where a filesystem cannot link the store's file there: the record is copied instead."""
COPIED = (
    "the checkpoint folder is on another filesystem than memory.ssd_dir (or one without hard links): each SSD "
    "record is copied into it, file by file; a checkpoint folder on the store's filesystem costs no copy"
)
"""Said once a run (one text: Python's warnings show it once)."""


def link_records(opt: OutOfCoreAdam, folder: Path) -> dict:
    """Hard-link every record of opt into folder (created); its description. Call between steps; fsync the
    files before trusting the links (a later write of a record goes to a new file, so they stay as linked).
    Where folder's filesystem cannot link the store's files (NO_LINKS), each record is copied there as a file.
    First the store removes its own names for the records an earlier checkpoint linked and a later write replaced
    (SSDStore.release_replaced), which would otherwise outlive that checkpoint's pruning (a copy of the states a
    checkpoint)."""
    if opt.broken:
        raise RuntimeError(opt.broken)
    opt.store.release_replaced()
    folder.mkdir(parents=True, exist_ok=True)
    records, link = {}, True
    for i in range(len(opt.groups)):
        key = f"{opt.prefix}/g{i:06d}"
        entry = opt.store.info(key)
        if link:
            try:
                opt.store.link_to(key, str(folder / entry.file))
            except OSError as e:
                if e.errno not in NO_LINKS:
                    raise
                warnings.warn(COPIED, RuntimeWarning, stacklevel=2)
                link = False
        if not link:
            opt.store.copy_to(key, str(folder / entry.file))
        records[key] = {k: v for k, v in asdict(entry).items() if k != "damaged"}
    layout = {"prefix": opt.prefix, "names": opt.names, "shapes": [opt.shapes[n] for n in opt.names]}
    return {**layout, "group_elems": opt.group_elems, "step": opt.step_count, "records": records}


def adopt_records(opt: OutOfCoreAdam, folder: Path, desc: dict) -> None:
    """Make the records described by desc (in folder) opt's states and step count: linked into the store
    when the layout is opt's, else read into opt's layout. RecordError when a record fails its check (the
    store is then as it was)."""
    same = (desc["group_elems"], desc["names"], desc["prefix"]) == (opt.group_elems, opt.names, opt.prefix)
    if not same:
        opt.write_state(_read_layout(folder, desc), desc["step"])
        opt.flush()
        return
    for rec in desc["records"].values():
        _verify(folder / rec["file"], rec)
    for key, rec in desc["records"].items():
        opt.store.adopt(key, str(folder / rec["file"]), Entry(**rec))
    opt.restored(desc["step"])
    opt.flush()


def read_records(folder: Path, desc: dict) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
    """The states of the records described by desc (in folder), by parameter name and part (STATE_PARTS), and
    their step count, for states that leave the SSD store (a run that keeps them in memory now); RecordError when a
    record fails its check."""
    return _read_layout(folder, desc), desc["step"]


def _verify(path: Path, rec: dict) -> torch.Tensor:
    """The record's bytes (its first nbytes), checked against its checksum."""
    try:
        with open(path, "rb") as f:
            data = f.read(rec["nbytes"])
    except OSError as e:
        raise RecordError(f"{path}: {e.strerror or e}") from e
    if len(data) != rec["nbytes"]:
        raise RecordError(f"{path} is {len(data)} bytes, its record holds {rec['nbytes']}: it was truncated")
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    got = checksum(t, rec["algo"])
    if got != rec["crc"]:
        raise RecordError(f"{path} fails its {rec['algo']} checksum (stored {rec['crc']:#010x}, read {got:#010x})")
    return t


def _read_layout(folder: Path, desc: dict) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's states out of records of desc's group size (another host budget wrote them)."""
    numels = {n: int(torch.Size(s).numel()) for n, s in zip(desc["names"], desc["shapes"])}
    out = {n: {k: torch.zeros(numels[n]) for k in STATE_PARTS} for n in desc["names"]}
    groups = plan_groups(list(numels.items()), desc["group_elems"])
    for i, segs in enumerate(groups):
        rec = desc["records"][f"{desc['prefix']}/g{i:06d}"]
        flat = _verify(folder / rec["file"], rec).view(torch.float32)
        n = section_elems(segs)
        for key, section in zip(STATE_PARTS, (flat[:n], flat[n : 2 * n], flat[2 * n :])):
            for s in segs:
                out[s.name][key][s.param_off : s.param_off + s.numel] = section[s.group_off : s.group_off + s.numel]
    return out
