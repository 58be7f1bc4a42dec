"""A resume that changes the optimizer's or the schedule's settings is told which, against the checkpoint's run's
config.yaml (the resumed steps take the new values, on every state tier)."""

from __future__ import annotations

import dataclasses

from mobiuspipe.config import config_from_dict
from mobiuspipe.run.resume import changed_settings


def test_the_changed_settings_are_named_old_to_new(tmp_path):
    cfg = config_from_dict({"train": {"weight_decay": 0.0, "steps": 10}})
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())
    assert changed_settings(tmp_path, cfg.train) is None
    changed = dataclasses.replace(cfg.train, weight_decay=0.9, betas=(0.8, 0.9), steps=20, lr_schedule="cosine")
    assert changed_settings(tmp_path, changed) == (
        "settings changed since the checkpoint's run: steps 10 -> 20, lr_schedule constant -> cosine, betas "
        "[0.9, 0.95] -> [0.8, 0.9], weight_decay 0.0 -> 0.9; the resumed steps take the new values"
    )
    assert changed_settings(tmp_path / "elsewhere", changed) is None  # a checkpoint without config.yaml: no word
