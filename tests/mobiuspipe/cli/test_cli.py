"""The `mobiuspipe` command in-process: env, topology, partition (text, JSON, files) and its one-line user errors."""

import contextlib
import io
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from mobiuspipe import cli
from partition.mip.solvers import mip_installed
from partition.plan import load_plan
from partition.spec.hardware import LIBRARY_BYTES
from partition.spec.models import MODELS
from topology import preset

PARTITION = ["partition", "--model", "gpt3-175b", "--topology", "2+2"]


def run(argv: list[str]) -> tuple[int, str, str]:
    """cli.main(argv) -> (exit code, stdout, stderr); argparse's SystemExit becomes its code."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def assert_user_error(argv: list[str], *needles: str) -> str:
    code, out, err = run(argv)
    assert code == 2, err
    assert out == ""
    assert err.startswith("mobiuspipe: error:") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err
    return err


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> tuple[dict, Path, Path, str]:
    """partition --json for gpt3-175b on 2+2 with -o and --timeline: (document, plan file, svg, stderr)."""
    folder = tmp_path_factory.mktemp("plan")
    plan, svg = folder / "plan.yaml", folder / "step.svg"
    code, out, err = run(PARTITION + ["--json", "-o", str(plan), "--timeline", str(svg)])
    assert code == 0, err
    return json.loads(out), plan, svg, err  # json.loads fails on anything printed besides the document


def test_env_json_has_every_section(capsys):
    assert cli.main(["env", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert {"python", "packages", "solvers", "cuda", "nvml", "cpu_count", "torch_threads"} <= set(d)
    assert {"mobiuspipe", "torch", "numpy", "highspy", "gurobipy", "nvidia-ml-py"} <= set(d["packages"])
    assert {"dp", "highs", "gurobi"} <= set(d["solvers"])
    assert {"available", "device_count", "devices"} <= set(d["cuda"])
    assert d["nvml"]["ok"] or d["nvml"]["error"]  # failure names the NVML error class
    st = os.statvfs("/dev/shm")
    assert d["shm"]["path"] == "/dev/shm" and d["shm"]["total_bytes"] == st.f_blocks * st.f_frsize
    assert d["shm"]["small"] == (d["shm"]["total_bytes"] < 512 * 2**20)


def test_env_text(capsys):
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    for word in ("python", "torch", "solvers", "cuda", "nvml", "cpus", "shm"):
        assert any(line.startswith(word) for line in out.splitlines()), word


def test_env_text_says_when_shm_is_small():
    from mobiuspipe.cli.env import _shm_line

    small = {"path": "/dev/shm", "total_bytes": 64 * 2**20, "free_bytes": 60 * 2**20, "small": True}
    assert _shm_line(small) == (
        "/dev/shm: 64.00 MiB, 60.00 MiB free; below 512.00 MiB: NCCL between gpus without peer-to-peer may fail "
        "there (a container: --shm-size=1g or --ipc=host)"
    )
    assert _shm_line(dict(small, total_bytes=2**30, small=False)) == "/dev/shm: 1.00 GiB, 60.00 MiB free"


def test_module_entry_runs_env():
    done = subprocess.run(
        [sys.executable, "-m", "mobiuspipe", "env", "--json"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "solvers" in json.loads(done.stdout)


@pytest.mark.parametrize("name", ["2+2", "3+1"])
def test_topology_json_contract(capsys, name):
    assert cli.main(["topology", "--layout", name, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert {"gpus", "contention_groups", "source"} <= set(d)
    for g in d["gpus"]:
        assert {"index", "name", "memory_bytes", "pci_bus_id", "root_complex", "numa_node"} <= set(g)
    assert d["contention_groups"] == preset(name).contention_groups()


def test_partition_json_contract(planned):
    d, _, _, err = planned
    assert err == "" or (not mip_installed() and err.startswith("mobiuspipe: no MIP solver is installed"))
    assert {
        "model",
        "num_gpus",
        "num_stages",
        "stages",
        "predicted_step_time_s",
        "solver",
        "mapping",
        "num_microbatches",
        "slot_bytes",
        "arena_bytes",
        "activation_bytes",
        "gpu_memory_bytes",
    } <= set(d)
    assert set(d["solver"]) == {"name", "status", "gap", "wall_s", "num_vars", "num_rows"}
    if mip_installed():  # the MIP's size (without a solver the DP planned and the counts are 0)
        assert 0 < d["solver"]["num_vars"] <= 2000 and 0 < d["solver"]["num_rows"] <= 2000  # gurobi's pip license
    assert d["model"] == "gpt3-175b" and d["num_gpus"] == 4
    assert d["num_stages"] == len(d["stages"]) > d["num_gpus"]
    assert d["predicted_step_time_s"] > 0
    for s in d["stages"]:
        assert {"layers", "gpu", "param_bytes", "activation_bytes", "fwd_s", "bwd_s", "load_s"} <= set(s)
    # a gpu server's plan: each stage's transients (a block's the largest) within the rule, cuBLAS's workspaces apart
    assert max(s["transient_bytes"] for s in d["stages"]) == max(s["transient_bytes"] for s in d["stages"][1:-1]) > 0
    assert d["workspace_bytes"] == LIBRARY_BYTES


def test_partition_stages_cover_every_layer_in_order(planned):
    d = planned[0]
    nxt = 0
    for s in d["stages"]:
        first, last = s["layers"]
        assert first == nxt and last >= first and 0 <= s["gpu"] < d["num_gpus"]
        nxt = last + 1
    assert nxt == MODELS["gpt3-175b"].num_layers


def test_plan_file_matches_the_json(planned):
    d, path, _, _ = planned
    plan = load_plan(path)
    assert [{"layers": [s.first, s.last], "gpu": s.gpu} for s in plan.stages] == [
        {"layers": s["layers"], "gpu": s["gpu"]} for s in d["stages"]
    ]
    assert plan.predicted_step_time_s == d["predicted_step_time_s"]


def test_timeline_svg_is_well_formed(planned):
    root = ET.parse(planned[2]).getroot()
    assert root.findall("{http://www.w3.org/2000/svg}rect")


def test_partition_text_has_header_table_and_timeline(tmp_path, capsys):
    argv = [
        "partition",
        "--model",
        "gpt3-13b",
        "--topology",
        "2+2",
        "--stages",
        "8",
        "--microbatches",
        "2",
        "-o",
        str(tmp_path / "plan.json"),
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "plan: gpt3-13b on topology 2+2: 8 stages on 4 gpus, cross mapping (contention 3.00), 2 microbatches"
    )
    assert "predicted step time" in out and "solver " in out
    lines = out.splitlines()
    head = next(k for k, line in enumerate(lines) if line.split()[:2] == ["j", "layers"])
    assert [line.split()[0] for line in lines[head + 1 : head + 9]] == [str(j) for j in range(8)]
    for g in range(4):
        assert sum(line.startswith(f"gpu {g} compute") for line in lines) == 1
    assert load_plan(tmp_path / "plan.json").num_stages == 8  # .json suffix -> JSON, read back


@pytest.mark.parametrize("stages", ["3", "99", "0"])
def test_stages_out_of_range(stages):
    assert_user_error(PARTITION + ["--stages", stages], f"--stages {stages}")


def test_unknown_model_lists_the_known_names():
    assert_user_error(["partition", "--model", "gpt5", "--topology", "2+2"], "gpt5", *MODELS)


def test_unknown_topology():
    assert_user_error(["partition", "--model", "gpt3-1.3b", "--topology", "5+5"], "5+5", "2+2")


@pytest.mark.parametrize(
    "text",
    ["gpus: [\n  - name: x\n", "name: box\ngpus: []\nroot_complexes: []\n", "- 1\n"],
    ids=["bad-yaml", "empty-lists", "not-a-mapping"],
)
def test_malformed_layout_file(tmp_path, text):
    path = tmp_path / "box.yaml"
    path.write_text(text)
    assert_user_error(["partition", "--model", "gpt3-1.3b", "--topology", str(path)], str(path))
    assert_user_error(["topology", "--layout", str(path)], str(path))


def test_unknown_gpu_name_in_layout(tmp_path):
    d = preset("2+2").to_dict()
    for g in d["gpus"]:
        g["name"] = "NVIDIA Banana 9000"
    path = tmp_path / "banana.yaml"
    path.write_text(yaml.safe_dump(d))
    assert_user_error(["partition", "--model", "gpt3-1.3b", "--topology", str(path)], "Banana", "known devices")


def test_unwritable_output(tmp_path):
    assert_user_error(
        [
            "partition",
            "--model",
            "gpt3-13b",
            "--topology",
            "2+2",
            "--stages",
            "8",
            "-o",
            str(tmp_path / "no" / "plan.yaml"),
        ],
        "cannot write",
    )


def test_too_large_reserve():
    assert_user_error(PARTITION + ["--reserve-gib", "24"], "--reserve-gib")


def test_usage_errors_exit_2():
    assert run(["partition", "--model", "gpt3-1.3b"])[0] == 2  # --topology missing
    assert run(["partition", "--model", "gpt3-1.3b", "--topology", "2+2", "--microbatches", "0"])[0] == 2
    assert run([])[0] == 2


def test_train_with_a_bad_config_fails_before_launching(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("plan:\n  num_gpus: 0\n")
    assert_user_error(["train", "--config", str(path)], "run.yaml", "plan.num_gpus")
    assert_user_error(["train", "--config", str(tmp_path / "missing.yaml")], "missing.yaml")


def test_partition_from_a_run_config(tmp_path, capsys):
    from mobiuspipe.cli import main

    cfg = tmp_path / "run.yaml"
    cfg.write_text("plan: {num_gpus: 2, num_stages: 3}\n")
    assert main(["partition", "--config", str(cfg), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["num_stages"] == 3 and doc["num_gpus"] == 2 and doc["model"] == "gpt-6x64"
    assert main(["partition", "--config", str(cfg), "--model", "gpt3-175b"]) == 2
    assert "drop them or drop --config" in capsys.readouterr().err
    cfg.write_text("plan: {num_stages: 8}\n")  # the same run planned for a 2+2 server
    assert main(["partition", "--config", str(cfg), "--topology", "2+2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["num_gpus"] == 4 and [s["gpu"] for s in doc["stages"]] == [0, 2, 1, 3] * 2
    assert main(["partition"]) == 2
    assert "partition needs --model and --topology" in capsys.readouterr().err


def test_partition_from_a_run_config_passes_the_solver_limits_on(tmp_path, monkeypatch, capsys):
    """--time-limit and --gap reach the planner with --config as without it (a plan written for plan.file may take
    longer than the run's own start-up would)."""
    from mobiuspipe.startup import config_plan

    seen, plan_batch = [], config_plan.plan_batch

    def spy(*args, **options):
        seen.append((options["time_limit_s"], options["gap"]))
        return plan_batch(*args, **options)

    monkeypatch.setattr(config_plan, "plan_batch", spy)
    cfg = tmp_path / "run.yaml"
    cfg.write_text("plan: {num_gpus: 2, num_stages: 3}\n")
    assert cli.main(["partition", "--config", str(cfg), "--time-limit", "7.5", "--gap", "0.2", "--json"]) == 0
    assert seen == [(7.5, 0.2)]


def test_partition_plans_a_config_for_several_machines_without_the_peer_tier(tmp_path, monkeypatch, capsys):
    """--nnodes N plans as `mobiuspipe train --nnodes N` does: a plan written for plan.file of a multi-machine job
    parks no activations on a peer gpu (its two ranks could be on two hosts, and the ranks would stop at start-up)."""
    from mobiuspipe.startup import config_plan

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    seen, plan_batch = [], config_plan.plan_batch

    def spy(*args, **options):
        seen.append(options["activation_tiers"])
        return plan_batch(*args, **options)

    monkeypatch.setattr(config_plan, "plan_batch", spy)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"plan: {{num_gpus: 4, num_stages: 4}}\nmemory: {{ssd_dir: {tmp_path}}}\n")
    assert cli.main(["partition", "--config", str(cfg), "--json"]) == 0
    assert cli.main(["partition", "--config", str(cfg), "--nnodes", "2", "-o", str(tmp_path / "plan.yaml")]) == 0
    assert seen == [("host", "ssd", "peer"), ("host", "ssd")]
    assert "peer" not in (tmp_path / "plan.yaml").read_text()
    capsys.readouterr()
    assert cli.main(["partition", "--config", str(cfg), "--nnodes", "3"]) == 2
    assert "which --nnodes 3 does not divide" in capsys.readouterr().err
    assert cli.main(["partition", "--model", "gpt3-175b", "--topology", "2+2", "--nnodes", "2"]) == 2
    assert "leave peer out of them" in capsys.readouterr().err


def test_a_path_on_the_command_line_is_relative_to_the_current_folder(tmp_path, monkeypatch, capsys):
    """--topology FILE with --config: from the current folder, not the config's (the config's own paths are)."""
    from topology import save_topology

    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "run.yaml").write_text("plan: {num_stages: 8, topology: box.yaml}\n")
    save_topology(preset("3+1"), tmp_path / "configs" / "box.yaml")  # the config's own: beside it
    save_topology(preset("2+2"), tmp_path / "box.yaml")  # the command line's: in the current folder
    monkeypatch.chdir(tmp_path)
    assert cli.main(["partition", "--config", "configs/run.yaml", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["topology"] == "3+1"
    assert cli.main(["partition", "--config", "configs/run.yaml", "--topology", "box.yaml", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["topology"] == "2+2"


@pytest.mark.mip
def test_partition_compare_json_and_text(capsys):
    assert cli.main(["partition", "--model", "gpt3-13b", "--topology", "3+1", "--compare", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert "compare" in d and d["solver"]["name"] in ("highs", "gurobi", "gurobi+highs")
    assert cli.main(["partition", "--model", "gpt3-13b", "--topology", "3+1", "--compare"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO-3 offload" in out and "GPipe" in out and "sequential mapping" in out


def test_simulate_subcommand_is_wired(tmp_path, capsys):
    plan = tmp_path / "p.yaml"
    assert cli.main(["partition", "--model", "gpt3-13b", "--topology", "2+2", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert cli.main(["simulate", "--plan", str(plan), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] > 0


@pytest.mark.parametrize("tiers", ["host", "host,ssd"])
def test_explain_text_and_json_agree_with_the_plan(tiers):
    argv = ["partition", "--model", "gpt3-1.3b", "--topology", "2+2", "--microbatch-size", "8", "--explain"]
    argv += ["--activation-tiers", tiers]
    code, text, _ = run(argv)
    assert code == 0
    assert "activations: per stage, each option with H (held per microbatch from F to B)" in text
    code, out, _ = run([*argv, "--json"])
    assert code == 0
    doc = json.loads(out)
    rows, stages = doc["explain"], doc["stages"]
    assert {r["stage"] for r in rows} == set(range(len(stages)))
    for j, s in enumerate(stages):
        chosen = [r for r in rows if r["stage"] == j and r["chosen"]]
        assert len(chosen) == 1 and chosen[0]["verdict"].startswith("chosen")
        assert (chosen[0]["mode"], chosen[0]["tier"]) == (s["activations"]["mode"], s["activations"]["tier"])
        assert chosen[0]["held_bytes"] == s["activations"]["held_bytes"]
        assert f"stage {j} (layers {s['layers'][0]}-{s['layers'][1]}, gpu {s['gpu']}):" in text
    budget = doc["gpu_memory_bytes"]
    for r in rows:  # an option not chosen is over the device budget or the host's, slower, or as fast holding more
        if not r["chosen"]:
            over, slower = r["peak_bytes"] > budget, r["verdict"].startswith("slower by")
            host = "host memory for activations" in r["verdict"]
            assert over == (r["verdict"].startswith("over gpu") and not host)
            assert over or host or slower or r["verdict"] == "as fast, holds more"
    modes = {r["mode"] for r in rows if r["chosen"]}
    assert "keep" in modes  # at least the last stage (fused)
    assert {r["tier"] for r in rows} == {"device", *tiers.split(",")}


def test_a_wrong_activation_tier_is_named():
    code, _, err = run(["partition", "--model", "gpt3-1.3b", "--topology", "2+2", "--activation-tiers", "host,nvme"])
    assert code == 2 and "--activation-tiers 'host,nvme': expected a comma-separated list of host, ssd and peer" in err


def test_explain_when_even_recompute_does_not_fit_the_walk(monkeypatch):
    import mobiuspipe.cli.partition as cli_partition

    def no_fit(*a, **kw):
        raise ValueError("gpu 1 needs 30.00 GiB even with every stage's held activations off the device")

    monkeypatch.setattr(cli_partition, "with_activations", no_fit)
    code, text, _ = run([*PARTITION, "--explain"])
    assert code == 0 and "activations: no choice: gpu 1 needs 30.00 GiB" in text and "every stage recomputes" in text


def test_an_empty_config_and_a_run_without_out_dir_say_what_they_do(tmp_path):
    from mobiuspipe.cli.train import _has_keys
    from mobiuspipe.config import config_from_dict
    from mobiuspipe.run.banner import writes

    (tmp_path / "empty.yaml").write_text("# nothing but a comment\n")
    (tmp_path / "some.yaml").write_text("train: {steps: 3}\n")
    assert not _has_keys(tmp_path / "empty.yaml") and _has_keys(tmp_path / "some.yaml")
    assert "this run writes no files" in writes(config_from_dict({}))
    assert writes(config_from_dict({"train": {"out_dir": str(tmp_path / "out")}})) == ""


def test_a_run_plans_without_a_reserve_on_stand_ins_and_with_one_on_real_gpus(tmp_path, capsys):
    """plan.reserve_mb: null leaves 1 GiB of a real gpu (a preset's) to the CUDA context, NCCL and the allocator,
    nothing of a stand-in's budget; a number replaces it, and `partition --config --reserve-gib` replaces that."""
    from topology.presets import DEFAULT_RESERVE_BYTES, RTX_3090_TI_BYTES, cpu_standin, reserve_bytes

    assert reserve_bytes(cpu_standin(2, 64 << 20)) == 0 and reserve_bytes(preset("2+2")) == DEFAULT_RESERVE_BYTES
    assert reserve_bytes(preset("2+2"), 512.0) == 512 << 20 and reserve_bytes(cpu_standin(1, 64 << 20), 8.0) == 8 << 20
    cfg = tmp_path / "run.yaml"

    def usable(text: str, *extra: str) -> int:
        """The gpu memory the plan took as its own: its usable bytes and what it held apart (W, buffers)."""
        cfg.write_text(text)
        assert cli.main(["partition", "--config", str(cfg), "--json", *extra]) == 0
        doc = json.loads(capsys.readouterr().out)
        return doc["gpu_memory_bytes"] + doc["workspace_bytes"] + doc["buffer_bytes"]

    assert usable("plan: {num_gpus: 2, num_stages: 4, device_memory_mb: 64}\n") == 64 << 20
    assert usable("plan: {num_stages: 8, topology: 2+2}\n") == RTX_3090_TI_BYTES - DEFAULT_RESERVE_BYTES
    assert usable("plan: {num_stages: 8, topology: 2+2, reserve_mb: 3072}\n") == RTX_3090_TI_BYTES - (3 << 30)
    assert usable("plan: {num_stages: 8, topology: 2+2}\n", "--reserve-gib", "2") == RTX_3090_TI_BYTES - (2 << 30)
    cfg.write_text("plan: {reserve_mb: -1}\n")
    assert_user_error(["partition", "--config", str(cfg)], "plan.reserve_mb", "0 or more MiB")


@pytest.mark.mip
def test_json_on_stdout_is_the_document_alone_with_highs():
    """--json's stdout is one JSON document and nothing else, also with HiGHS, which writes a banner to the
    process's standard output (C's, not Python's) when a process makes its first solver."""
    pytest.importorskip("highspy")
    argv = ["partition", "--model", "gpt3-1.3b", "--topology", "2+2", "--solver", "highs", "--json"]
    proc = subprocess.run([sys.executable, "-m", "mobiuspipe", *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["solver"]["name"] == "highs"
