"""The public names the README and DESIGN.md promise keep working after the rooms moved."""

from __future__ import annotations

import importlib


def test_the_public_api_imports_from_the_package_root():
    import mobiuspipe
    from mobiuspipe import Pipeline, Plan, RunConfig, load_config, load_plan, make_plan

    assert all(callable(x) for x in (Pipeline, Plan, RunConfig, load_config, load_plan, make_plan))
    assert set(mobiuspipe.__all__) >= {
        "Pipeline",
        "Plan",
        "make_plan",
        "load_plan",
        "RunConfig",
        "load_config",
        "LoraSpec",
    }


def test_the_torchrun_entry_and_the_cli_are_where_they_were():
    assert callable(importlib.import_module("mobiuspipe.train").main)
    assert callable(importlib.import_module("mobiuspipe.cli").main)
