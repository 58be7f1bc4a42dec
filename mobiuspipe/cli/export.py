"""`mobiuspipe export`: a finished run's weights (OUT_DIR/weights) as a Hugging Face folder from_pretrained loads;
a LoRA run's as PEFT's adapter folder, or with --merge the model with its adapters merged in."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from mobiuspipe.cli._common import CliError

__all__ = ["register", "run"]


def register(sub) -> None:
    """Add the `export` subcommand to the CLI's subparsers."""
    p = sub.add_parser("export", help="write a run's fine-tuned Hugging Face model as safetensors + config.json")
    p.add_argument("--run", required=True, help="the run's train.out_dir (holds config.yaml, plan.yaml, weights/)")
    p.add_argument("--to", required=True, help="a new or empty folder to write the model into")
    p.add_argument(
        "--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="dtype of the written weights (fp32)"
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: write the whole model with the adapters merged into its weights (W + scale * B A), "
        "which from_pretrained loads without peft; default: the adapter folder PeftModel.from_pretrained loads",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace, out) -> int:
    """Write one shard per stage (one stage's weights in memory at a time), then the index and config."""
    import torch

    from mobiuspipe.config import load_config
    from mobiuspipe.models.hf import open_hf
    from mobiuspipe.models.hf_export import check_export_dir, finish_export, partial_dir, write_shard
    from mobiuspipe.profiling.profiler import TORCH_DTYPES
    from mobiuspipe.startup.lora import lora_spec
    from partition.plan import load_plan

    run_dir, to = Path(args.run), Path(args.to)
    cfg = load_config(_need(run_dir / "config.yaml", "its resolved config"))
    if cfg.model.hf is None:
        raise CliError(
            f"--run {run_dir}: the run trained the built-in GPT, not a Hugging Face model; its weights are in "
            f"{run_dir / 'weights'} (torch.load each stage{{j}}.pt)"
        )
    plan = load_plan(_need(run_dir / "plan.yaml", "its plan"))
    files = [_need(run_dir / "weights" / f"stage{j}.pt", f"stage {j}'s weights") for j in range(plan.num_stages)]
    owner = str(run_dir.resolve())  # the run's out_dir: its own export at the end of training is the same owner's
    check_export_dir(to, "--to", owner)
    hf, dtype = open_hf(cfg.model.hf, cfg.model.seq_len), TORCH_DTYPES[args.dtype]
    spec = lora_spec(cfg)
    if spec is None and args.merge:
        raise CliError(
            f"--merge: expected a LoRA run (its adapters are merged into the base), found {run_dir}, which trained "
            f"every weight: drop --merge, its export is the whole model"
        )
    if spec is not None and not args.merge:
        _adapter(hf, spec, files, to, dtype, owner)
        print(f"mobiuspipe: exported {run_dir}'s LoRA adapter to {to} ({args.dtype}; PeftModel loads it)", file=out)
        return 0
    folder = partial_dir(to)
    shutil.rmtree(folder, ignore_errors=True)  # an earlier, interrupted export's remains
    shards = {}
    for j, file in enumerate(files):
        weights = torch.load(file, weights_only=True)
        if spec is not None:
            weights = _merged(hf, spec, plan.stages[j].layers, weights)
        shards[j] = write_shard(hf, j, plan.num_stages, weights, folder, dtype)
    finish_export(hf, shards, plan.num_stages, to, dtype, owner)
    merged = ", LoRA adapters merged" if spec is not None else ""
    print(f"mobiuspipe: exported {run_dir} to {to} ({args.dtype}, {plan.num_stages} shards{merged})", file=out)
    return 0


def _adapter(hf, spec, files: list[Path], to: Path, dtype, owner: str) -> None:
    """PEFT's adapter folder of the run's adapters (weights/stage{j}.pt hold them alone)."""
    import torch

    from mobiuspipe.startup.lora import write_adapter

    write_adapter(hf, spec, {k: v for file in files for k, v in torch.load(file, weights_only=True).items()}, to,
                  dtype, owner)  # fmt: skip


def _merged(hf, spec, layers: range, adapters: dict) -> dict:
    """A stage's weights ("layer.name") with the base read from model.hf and the run's adapters merged in."""
    from mobiuspipe.lora.layers import add_adapters, load_adapter_tensors, merge_adapters
    from mobiuspipe.models.hf import build_layer

    out = {}
    for l in layers:
        layer = build_layer(hf, l)
        add_adapters(layer, spec)
        mine = {k.split(".", 1)[1]: v for k, v in adapters.items() if k.split(".", 1)[0] == str(l)}
        load_adapter_tensors(layer, mine, l)
        merge_adapters(layer)
        out.update({f"{l}.{k}": v for k, v in layer.state_dict().items()})
    return out


def _need(path: Path, what: str) -> Path:
    if not path.is_file():
        raise CliError(
            f"--run: {path} is missing ({what}); give the out_dir of a finished `mobiuspipe train` run, which "
            f"writes config.yaml, plan.yaml and weights/stage{{j}}.pt"
        )
    return path
