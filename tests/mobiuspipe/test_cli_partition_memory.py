"""`mobiuspipe partition` with memory tiers: --host-memory-gb, the --json `memory` object, the text section."""

import contextlib
import io
import json

import pytest

from foundation.units import GiB
from mobiuspipe import cli
from topology import preset, save_topology

BIG = ["partition", "--model", "gpt3-175b", "--topology", "2+2", "--solver", "dp"]


@pytest.fixture(scope="module")
def big() -> dict:
    """The --json document of gpt3-175b on 2+2 with 512 GiB of host memory."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(BIG + ["--host-memory-gb", "512", "--json"]) == 0
    return json.loads(out.getvalue())


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    """cli.main(argv) -> (exit code, stdout, stderr)."""
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_175b_on_512_gib_puts_the_optimizer_states_on_ssd(big):
    mem = big["memory"]
    assert mem["tiers"]["optimizer"] == "ssd" and mem["tiers"]["weights"] == "host"
    assert mem["host_budget_bytes"] == 512 * GiB and mem["host_budget_source"] == "--host-memory-gb"
    assert mem["host_bytes"] <= 512 * GiB
    params = sum(s["param_count"] for s in big["stages"])
    assert mem["ssd_bytes_by_kind"]["optimizer"] == 12 * params
    assert mem["ssd_bytes"] == sum(mem["ssd_bytes_by_kind"].values()) >= 12 * params
    assert mem["ssd_read_bytes"] == mem["ssd_write_bytes"] == mem["ssd_bytes"]
    ssd_s = mem["ssd_read_bytes"] / 3e9 + mem["ssd_write_bytes"] / 2e9  # unprobed defaults
    assert (
        mem["ssd"]
        == {
            "read_gbps": 3.0,
            "write_gbps": 2.0,
            "measured": False,
            "note": mem["ssd"]["note"],
        }
        and "unprobed" in mem["ssd"]["note"]
    )
    assert mem["bound_by"] == "ssd" and mem["busy_s"]["ssd"] == pytest.approx(ssd_s)
    assert ssd_s <= big["predicted_step_time_s"] <= 1.1 * ssd_s  # the SSD traffic is in the predicted step


def test_memory_totals_add_up(big):
    mem = big["memory"]
    assert mem["host_bytes"] == sum(mem["host_bytes_by_kind"].values())
    assert mem["host_bytes_by_kind"]["weights"] == sum(s["param_bytes"] for s in big["stages"])
    assert mem["device_bytes"] <= big["num_gpus"] * big["gpu_memory_bytes"]
    rows = mem["stages"]
    assert len(rows) == big["num_stages"]
    streaming = mem["host_bytes_by_kind"]["streaming"]
    assert sum(r["host_bytes"] for r in rows) + streaming == mem["host_bytes"]
    assert sum(r["ssd_bytes"] for r in rows) == mem["ssd_bytes"]
    assert {r["optimizer"] for r in rows} == {"ssd"}
    on_ssd = sum(r["gradients"] == "ssd" for r in rows)
    assert mem["tiers"]["gradients"] == ("host+ssd" if 0 < on_ssd < len(rows) else rows[0]["gradients"])


def test_contract_fields_are_kept(big):
    assert {"model", "num_gpus", "num_stages", "stages", "predicted_step_time_s", "solver"} <= set(big)
    assert {"device_bytes", "host_bytes", "ssd_bytes", "tiers", "bound_by"} <= set(big["memory"])
    assert set(big["memory"]["tiers"]) == {"weights", "optimizer", "gradients"}


def test_no_budget_on_a_preset_is_unlimited_and_all_in_memory(capsys):
    code, out, err = run(["partition", "--model", "gpt3-1.3b", "--topology", "2+2", "--solver", "dp", "--json"], capsys)
    assert code == 0, err
    mem = json.loads(out)["memory"]
    assert mem["host_budget_bytes"] is None and mem["host_budget_source"].startswith("unlimited")
    assert mem["ssd_bytes"] == 0 and set(mem["tiers"].values()) == {"host"}
    assert mem["bound_by"] in ("compute", "pcie", "host_adam")


def test_the_topologys_host_memory_is_the_default_budget(tmp_path, capsys):
    import dataclasses

    path = tmp_path / "server.yaml"
    save_topology(dataclasses.replace(preset("2+2"), host_memory_bytes=16 * GiB), path)
    code, out, err = run(
        ["partition", "--model", "gpt3-1.3b", "--topology", str(path), "--solver", "dp", "--json"], capsys
    )
    assert code == 0, err
    mem = json.loads(out)["memory"]
    assert mem["host_budget_bytes"] == 16 * GiB and "host memory of topology" in mem["host_budget_source"]
    assert mem["tiers"]["optimizer"] in ("ssd", "host+ssd") and mem["host_bytes"] <= 16 * GiB


def test_text_has_the_memory_section(capsys):
    code, out, err = run(BIG + ["--host-memory-gb", "512"], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[4].startswith("memory: device ") and "host budget 512.00 GiB (--host-memory-gb)" in lines[4]
    assert lines[5].startswith("tiers: weights host, optimizer ssd, gradients ")
    assert lines[6].startswith("ssd: 3 GB/s read, 2 GB/s write (unprobed") and "a step reads" in lines[6]
    assert lines[7].startswith("step bound by ssd: busy ")


@pytest.mark.parametrize("value", ["-5", "0", "abc", "nan", "inf"])
def test_a_bad_host_memory_is_one_clear_line(value, capsys):
    code, out, err = run(BIG + ["--host-memory-gb", value], capsys)
    assert code == 2 and out == ""
    assert err.startswith("mobiuspipe: error: --host-memory-gb: expected a positive number of GiB")
    assert err.count("\n") == 1 and f"found {value!r}" in err and "leave the option out" in err


def test_a_budget_below_the_weights_is_infeasible(capsys):
    code, out, err = run(BIG + ["--host-memory-gb", "100"], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "of host memory even with every optimizer state and gradient on the SSD" in err
    assert "is 100.0 GiB" in err and "weights 326.4 GiB" in err and "--host-memory-gb 349" in err


def test_compare_says_it_keeps_the_states_in_memory(capsys):
    small = ["partition", "--model", "gpt3-1.3b", "--topology", "2+2", "--solver", "dp", "--compare"]
    code, out, err = run(small + ["--host-memory-gb", "16", "--json"], capsys)
    assert code == 0, err
    d = json.loads(out)
    assert d["memory"]["ssd_bytes"] > 0 and "states in host memory" in d["compare"]["note"]
    code, out, err = run(small + ["--host-memory-gb", "16"], capsys)
    assert code == 0 and out.rstrip().endswith("not applied to the comparison)")
    code, out, err = run(small + ["--json"], capsys)
    assert code == 0 and "note" not in json.loads(out)["compare"]
