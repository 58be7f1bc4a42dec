"""A local Hugging Face `datasets` folder as a data source: one that `Dataset.save_to_disk` wrote (a DatasetDict's
too, whose split is chosen), or a folder of .parquet, .arrow or .jsonl files that `load_dataset(folder)` reads.
Nothing is downloaded (HF_DATASETS_OFFLINE is set); what load_dataset caches goes into a temporary folder, removed
once the rows are read."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import Any

from mobiuspipe.data.token_file import data_error

__all__ = ["is_dataset_folder", "dataset_records"]

SAVED = ("dataset_info.json", "dataset_dict.json")
"""Files that mark a folder `save_to_disk` wrote (a Dataset's, a DatasetDict's)."""


def is_dataset_folder(path: str) -> bool:
    """Whether `path` is a folder (a datasets folder, as data sources go: a file is text, JSONL or tokens)."""
    return os.path.isdir(path)


def _load(path: str, key: str) -> Any:
    import datasets

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        if any(os.path.isfile(os.path.join(path, name)) for name in SAVED):
            return datasets.load_from_disk(path), None
        cache = tempfile.TemporaryDirectory(prefix="mobiuspipe-datasets-")
        return datasets.load_dataset(path, cache_dir=cache.name), cache
    except Exception as e:
        raise data_error(
            key,
            "a datasets folder: save_to_disk's, or .parquet, .arrow or .jsonl files that load_dataset reads",
            f"{path}: {type(e).__name__}: {e}",
            "save it with Dataset.save_to_disk(DIR), or put the data files in the folder",
        ) from e


def dataset_records(path: str, split: str, key: str) -> Iterator[tuple[dict[str, Any], str]]:
    """Each row of the folder's dataset (of `split` when it holds several) as (row, "row N of PATH[split]")."""
    loaded, cache = _load(path, key)
    try:
        if hasattr(loaded, "keys"):  # a DatasetDict
            if split not in loaded:
                splits = ", ".join(loaded.keys())
                raise data_error(
                    key,
                    f"a split {split!r} in the datasets folder",
                    f"{path} with splits {splits}",
                    "give --split one of them"
                    if key == "--input"
                    else "set data.split (data.eval_split for eval_path) to one of them",
                )
            loaded, path = loaded[split], f"{path}[{split}]"
        for n, row in enumerate(loaded):
            yield row, f"row {n} of {path}"
    finally:
        if cache is not None:
            cache.cleanup()
