"""`mobiuspipe profile` on its own parser (register(sub)): table, JSON, files, --measured and user errors."""

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
import torch

from foundation.errors import UserError
from mobiuspipe import cli
from mobiuspipe.cli.profile import register
from partition.spec.models import MODELS
from partition.spec.profile import load_profile

DATA = Path(__file__).resolve().parents[2] / "partition" / "data"


def run(argv: list[str]) -> tuple[int, str, str]:
    """Like cli.main: (exit code, stdout, stderr), user errors as one line and code 2."""
    parser = argparse.ArgumentParser(prog="mobiuspipe")
    register(parser.add_subparsers(dest="command", required=True))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            args = parser.parse_args(argv)
            code = args.func(args, sys.stdout)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except UserError as e:
            print(f"mobiuspipe: error: {e}", file=err)
            code = 2
    return code, out.getvalue(), err.getvalue()


def test_analytic_table_has_one_row_per_run():
    code, out, err = run(["profile", "--model", "gpt3-175b"])
    assert code == 0, err
    assert "gpt3-175b on NVIDIA GeForce RTX 3090 Ti (analytic" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("0-0", "embedding", "1"),
        ("1-96", "block", "96"),
        ("97-97", "head", "1"),
    ]
    assert "175.222e9 parameters" in out


def test_json_document_loads_back(tmp_path):
    code, out, err = run(
        [
            "profile",
            "--model",
            "llama2-70b",
            "--gpu",
            "H100 PCIe",
            "--microbatch-size",
            "2",
            "--dtype",
            "bf16",
            "--json",
        ]
    )
    assert code == 0 and err == ""
    d = json.loads(out)
    assert (d["model"], d["device"], d["dtype"], d["microbatch_size"], d["seq_len"]) == (
        "llama2-70b",
        "NVIDIA H100 PCIe",
        "bf16",
        2,
        4096,
    )
    assert len(d["layers"]) == 82 and [r["count"] for r in d["runs"]] == [1, 80, 1]
    assert sum(x["param_count"] for x in d["layers"]) == MODELS["llama2-70b"].param_count
    path = tmp_path / "p.json"
    path.write_text(out)
    assert load_profile(path).to_dict() == {k: v for k, v in d.items() if k != "runs"}


def test_output_file_and_json_stdout_stays_clean(tmp_path):
    path = tmp_path / "prof.yaml"
    code, out, err = run(
        ["profile", "--model", str(DATA / "mistral-7b.json"), "--seq-len", "4096", "-o", str(path), "--json"]
    )
    assert code == 0
    d = json.loads(out)
    assert load_profile(path).to_dict() == {k: v for k, v in d.items() if k != "runs"}
    assert d["model"] == "mistral-7b" and d["seq_len"] == 4096
    assert f"profile written to {path}" in err


def test_measured_tiny_gpt2_config(tmp_path):
    path = tmp_path / "m.yaml"
    code, out, err = run(
        ["profile", "--model", str(DATA / "tiny-gpt2"), "--measured", "--dtype", "fp32", "-o", str(path)]
    )
    assert code == 0, err
    assert "3 of 8 layers run" in out
    p = load_profile(path)
    assert p.dtype == "fp32" and p.num_layers == 8 and all(x.fwd_s > 0 for x in p.layers)
    assert [x.name for x in p.layers] == ["embedding"] + ["block"] * 6 + ["head"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU default and the fp16 refusal are CPU rules")
def test_measured_on_cpu_defaults_to_bf16_and_refuses_fp16():
    code, out, err = run(["profile", "--model", str(DATA / "tiny-gpt2"), "--measured", "--json"])
    assert code == 0, err
    assert json.loads(out)["dtype"] == "bf16"
    code, out, err = run(["profile", "--model", str(DATA / "tiny-gpt2"), "--measured", "--dtype", "fp16"])
    assert code == 2 and "bf16" in err


@pytest.mark.parametrize(
    "argv,needles",
    [
        (["--model", "gpt3-7b"], ["unknown model 'gpt3-7b'", "gpt3-175b", "llama2-70b"]),
        (
            ["--model", str(DATA / "no-ffn-llama.json")],
            ["no-ffn-llama.json", "missing 'intermediate_size'", "MLP width"],
        ),
        (["--model", "gpt3-125m", "--gpu", "RTX 2080"], ["--gpu", "RTX 2080", "RTX 3090 Ti"]),
        (["--model", "gpt3-1.3b", "--measured"], ["gpt3-1.3b", "1e9", "drop --measured"]),
        (["--model", "llama2-7b", "--measured"], ["llama", "drop --measured"]),
        (["--model", str(DATA / "tiny-gpt2"), "--measured", "--gpu", "RTX 4090"], ["--gpu", "this machine"]),
        (["--model", "gpt3-125m", "-o", "/nonexistent/dir/p.yaml"], ["cannot write the profile", "p.yaml"]),
    ],
)
def test_user_errors_are_one_line(argv, needles):
    code, out, err = run(["profile", *argv])
    assert code == 2 and out == ""
    assert err.startswith("mobiuspipe: error:") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err


def test_bad_numbers_are_argparse_errors():
    code, _, err = run(["profile", "--model", "gpt3-125m", "--microbatch-size", "0"])
    assert code == 2 and "positive integer" in err


def test_partition_with_a_profile_of_another_model_names_both(tmp_path):
    path = tmp_path / "p.yaml"
    assert run(["profile", "--model", "gpt3-350m", "-o", str(path)])[0] == 0
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["partition", "--model", "gpt3-125m", "--topology", "2+2", "--profile", str(path)])
    assert code == 2 and out.getvalue() == "" and err.getvalue().count("\n") == 1, err.getvalue()
    for needle in ("model 'gpt3-350m' (26 layers)", "--model is 'gpt3-125m' (14 layers)", "--model gpt3-350m"):
        assert needle in err.getvalue()
    assert "mobiuspipe profile --model gpt3-125m -o FILE" in err.getvalue()
    with contextlib.redirect_stdout(out):
        assert cli.main(["partition", "--model", "GPT3-350M", "--topology", "2+2", "--profile", str(path)]) == 0
