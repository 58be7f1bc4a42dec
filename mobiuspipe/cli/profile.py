"""`mobiuspipe profile`: the per-layer profile of a model, analytic (a GPU spec), measured (this machine), or
refined by a traced run.

The command prints one row per run of identical layers, or with --json one document: Profile.to_dict()
plus "runs" ([{"count", "layer"}]), which `load_profile` (and so `partition --profile`) reads back.
With --refine RUN_DIR [--profile FILE] it reads the plan a run followed (RUN_DIR/plan.yaml, written as run) and
its traced steps (RUN_DIR/trace.json, runtime.trace_steps), and scales the profile the plan was made from by
how each stage's computations ran against the simulator's (mobiuspipe.profiling.refine), so that `partition
[--config RUN.yaml] --profile` plans from the layers as they run in a pipeline on this machine. Without --profile
a run that planned for itself (no plan.file) refines its config's analytic profile. --layout-out FILE writes the
machine the plan records with what posting and taking a message cost in the run and what its training loop took
between steps (Measured.message_send_s, message_recv_s, step_overhead_s), for `partition --topology FILE`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from foundation.units import fmt_bytes
from mobiuspipe.cli._common import CliError, positive_int, write_output
from partition.plan import load_plan
from partition.spec.analytic import DTYPE_BYTES, analytic_profile
from partition.spec.hardware import MFU_DEFAULT, device_spec
from partition.spec.hf import ModelConfigError
from partition.spec.lookup import get_model
from partition.spec.models import ModelSpec
from partition.spec.profile import Profile, compress, load_profile, runs_to_list, save_profile
from topology import Topology
from topology.layout import save_topology

if TYPE_CHECKING:
    from mobiuspipe.profiling.refine import Refinement

__all__ = ["DEFAULT_GPU", "MEASURED_MAX_PARAMS", "register", "run", "render_profile"]

DEFAULT_GPU = "NVIDIA GeForce RTX 3090 Ti"
MEASURED_MAX_PARAMS = 1_000_000_000
"""--measured builds the model's distinct layers on this machine: refused above this many parameters."""


def register(sub) -> None:
    """Add the `profile` subcommand to the CLI's subparsers."""
    p = sub.add_parser("profile", help="per-layer time and bytes of a model (analytic, or --measured here)")
    p.add_argument(
        "--model",
        metavar="NAME_OR_CONFIG_JSON",
        help="model name (gpt3-175b, llama2-70b, ...) or a Hugging Face config.json (or its folder); not with --refine",
    )
    p.add_argument(
        "--gpu",
        default=None,
        metavar="NAME",
        help=f"device type of the analytic profile ({DEFAULT_GPU!r}); an unknown name lists them",
    )
    p.add_argument("--microbatch-size", type=positive_int, default=1, help="sequences per microbatch (1)")
    p.add_argument(
        "--seq-len",
        type=positive_int,
        default=None,
        help="tokens per sequence (default: the model's; a gpt's position table follows it)",
    )
    p.add_argument(
        "--dtype",
        choices=tuple(DTYPE_BYTES),
        default=None,
        help="parameter dtype (fp16; bf16 for --measured on a CPU, where fp16 takes a slow path)",
    )
    p.add_argument(
        "--measured",
        action="store_true",
        help="run the runtime's GPT layers on this machine's device (gpt family, <= 1e9 parameters)",
    )
    p.add_argument(
        "--refine",
        metavar="RUN_DIR",
        help="refine --profile by a traced run: RUN_DIR is its train.out_dir (plan.yaml and trace.json of "
        "runtime.trace_steps; a first traced step 0 is left out)",
    )
    p.add_argument(
        "--profile",
        metavar="FILE",
        help="with --refine: the profile the run's plan was made from (default: the analytic profile of the run's "
        "config, for a run without plan.file)",
    )
    p.add_argument(
        "--layout-out",
        metavar="LAYOUT",
        help="with --refine: write the machine the run's plan records, with what posting and taking a message cost "
        "in the run and what its loop took between steps (measured.message_send_s, message_recv_s, "
        "step_overhead_s), as a layout file for `partition --topology`",
    )
    p.add_argument("-o", "--output", metavar="PROFILE", help="write the profile here (.yaml, or .json by suffix)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.set_defaults(func=run)


def _spec(args: argparse.Namespace) -> ModelSpec:
    try:
        spec = get_model(args.model)
        return dataclasses.replace(spec, seq_len=args.seq_len) if args.seq_len else spec
    except ModelConfigError as e:
        raise CliError(str(e)) from e


def _analytic(spec: ModelSpec, args: argparse.Namespace) -> tuple[Profile, str]:
    try:
        device = device_spec(args.gpu or DEFAULT_GPU)
    except ValueError as e:
        raise CliError(f"--gpu: {e}") from e
    prof = analytic_profile(spec, device, microbatch_size=args.microbatch_size, dtype=args.dtype or "fp16")
    return prof, f"analytic, {device.peak_tflops:g} TFLOP/s peak at mfu {MFU_DEFAULT}"


def _check_measurable(spec: ModelSpec, args: argparse.Namespace) -> None:
    if args.gpu:
        raise CliError(f"--measured profiles this machine's device, not --gpu {args.gpu!r}: drop one of them")
    if spec.family != "gpt" or spec.ffn != 4 * spec.d_model:
        raise CliError(
            f"--measured runs the runtime's GPT layers (4*d_model MLP); model {spec.name!r} is a "
            f"{spec.family} spec with MLP width {spec.ffn}: drop --measured for its analytic profile"
        )
    if spec.param_count > MEASURED_MAX_PARAMS:
        raise CliError(
            f"--measured builds the model on this machine; {spec.name!r} has {spec.param_count / 1e9:.2f}e9 "
            f"parameters, above the {MEASURED_MAX_PARAMS / 1e9:g}e9 limit: drop --measured, or pick a "
            f"smaller model (e.g. gpt3-350m)"
        )


def _measured(spec: ModelSpec, args: argparse.Namespace) -> tuple[Profile, str]:
    _check_measurable(spec, args)
    import torch

    from mobiuspipe.models.gpt import build_layers, lm_loss
    from mobiuspipe.profiling.profiler import TORCH_DTYPES, measure_layers

    cuda = torch.cuda.is_available()
    device, device_name = ("cuda", torch.cuda.get_device_name()) if cuda else ("cpu", "cpu-standin")
    dtype = args.dtype or ("fp16" if cuda else "bf16")
    if dtype == "fp16" and not cuda:
        raise CliError(
            "--measured --dtype fp16 on a CPU: fp16 matmuls take a slow reference path there (a "
            "backward 100x slower than bf16), so the times would mean nothing; use --dtype bf16 "
            "(also 2 bytes) or fp32"
        )
    last = spec.num_layers - 1
    built = build_layers(spec, seed=0, which=[0, 1, last])  # the blocks are identical: build one
    layers = [built[0]] + [built[1]] * spec.num_blocks + [built[last]]
    for layer in built.values():
        layer.to(TORCH_DTYPES[dtype])
    g = torch.Generator().manual_seed(0)
    shape = (args.microbatch_size, spec.seq_len)
    tokens = torch.randint(spec.vocab_size, shape, generator=g)
    targets = torch.randint(spec.vocab_size, shape, generator=g).to(device)
    m = measure_layers(
        layers,
        tokens,
        device=device,
        name=spec.name,
        device_name=device_name,
        dtype_name=dtype,
        microbatch_size=args.microbatch_size,
        seq_len=spec.seq_len,
        loss_fn=lambda logits: lm_loss(logits.float(), targets),
    )
    return m.profile, f"measured on {device}, {len(m.measured)} of {spec.num_layers} layers run"


_COLUMNS = ("layers", "name", "count", "params", "param bytes", "activations", "output", "fwd ms", "bwd ms")


def render_profile(profile: Profile, how: str) -> str:
    """A header line, then one row per run of identical layers (numbers per layer), then the totals."""
    rows, first = [], 0
    for layer, n in compress(profile):
        rows.append(
            (
                f"{first}-{first + n - 1}",
                layer.name,
                str(n),
                f"{layer.param_count / 1e6:.2f}M",
                fmt_bytes(layer.param_bytes),
                fmt_bytes(layer.activation_bytes),
                fmt_bytes(layer.output_bytes),
                f"{layer.fwd_s * 1e3:.3f}",
                f"{layer.bwd_s * 1e3:.3f}",
            )
        )
        first += n
    widths = [max(len(c), *(len(r[k]) for r in rows)) for k, c in enumerate(_COLUMNS)]
    p = profile
    total = sum(x.param_count for x in p.layers)
    step = sum(x.fwd_s + x.bwd_s for x in p.layers)
    lines = [
        f"profile: {p.model} on {p.device} ({how}), {p.dtype}, microbatch {p.microbatch_size} x "
        f"{p.seq_len} tokens, {p.num_layers} layers",
        "",
    ]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in (_COLUMNS, *rows)]
    lines += [
        "",
        f"total: {total / 1e9:.3f}e9 parameters, {fmt_bytes(sum(x.param_bytes for x in p.layers))}; "
        f"fwd+bwd of one microbatch {step * 1e3:.2f} ms (numbers per layer, run rows repeat them)",
    ]
    return "\n".join(lines) + "\n"


def _refined(args: argparse.Namespace) -> tuple[Profile, str, list[str]]:
    """--profile refined by the traced run in --refine, how, and a line per stage of what the run measured."""
    from mobiuspipe.profiling.refine import refine_profile
    from mobiuspipe.runtime.action_trace import read_chrome
    from partition.rules.tiers import HostBudget
    from partition.search import predict_step

    if args.model or args.measured:
        raise CliError("--refine reads the model from the run's folder: drop --model and --measured")
    folder = Path(args.refine)
    for name, what in (("plan.yaml", "the plan the run followed"), ("trace.json", "its traced steps")):
        if not (folder / name).is_file():
            raise CliError(
                f"--refine {folder}: found no {name} ({what}) there; expected the train.out_dir of a run with "
                f"runtime.trace_steps set"
            )
    plan = load_plan(folder / "plan.yaml")
    profile, source = _run_profile(args.profile, folder)
    if len(profile.layers) != plan.num_layers or plan.layout is None:
        raise CliError(
            f"{source} has {len(profile.layers)} layers, the plan in {folder} {plan.num_layers}"
            f"{'' if plan.layout else ' and no layout'}: give the profile the plan was made from"
        )
    per_rank = read_chrome(folder / "trace.json")
    ran = sorted({r.step for recs in per_rank for r in recs})
    steps = [s for s in ran if s > 0] or ran
    predicted = predict_step(plan, plan.layout, HostBudget(None, "unlimited")).sim
    try:
        got = refine_profile(profile, plan, per_rank, steps, predicted)
    except ValueError as e:
        raise CliError(f"--refine {folder}: {e}") from e
    lines = [
        f"stage {s.stage}: F x{s.forward:.2f}, B x{s.backward:.2f}"
        if s.forward is not None
        else f"stage {s.stage}: B x{s.backward:.2f}"
        for s in got.scales
    ]
    if got.send_s is not None:
        lines.append(f"posting a message to another rank: {got.send_s * 1e3:.3f} ms of the sender's thread")
    if got.recv_s is not None:
        lines.append(
            f"taking a message from another rank: {got.recv_s * 1e3:.3f} ms of the receiver's thread once both ends "
            f"reached it"
        )
    if got.step_overhead_s is not None:
        lines.append(f"the training loop between steps: {got.step_overhead_s * 1e3:.3f} ms a step")
    if args.layout_out:
        lines.append(_write_layout(plan.layout, got, args.layout_out))
    elif (got.send_s, got.recv_s, got.step_overhead_s) != (None, None, None):
        lines.append("(--layout-out FILE writes them into the run's machine for `partition --topology FILE`)")
    return got.profile, f"refined by the traced steps {steps} of {folder}", lines


def _write_layout(layout: Topology, got: Refinement, path: str) -> str:
    """Save the run's machine with the message and loop costs the run measured (Refinement.measured_on: its
    probes, and a cost the run did not measure, kept as the layout had them); returns the line saying so. A bad
    suffix: save_topology's error."""
    measured = got.measured_on(layout.measured)
    write_output("layout", path, lambda: save_topology(dataclasses.replace(layout, measured=measured), path))
    return f"layout written to {path} (measured.message_send_s, message_recv_s, step_overhead_s)"


def _run_profile(path: str | None, folder: Path) -> tuple[Profile, str]:
    """The profile a run's plan was made from: the file given, else the analytic profile of the run's config
    when the run planned for itself from it (no plan.file), as `mobiuspipe train` does."""
    if path:
        return load_profile(path), f"--profile {path}"
    from mobiuspipe.config import load_config
    from mobiuspipe.startup.config_plan import gpt_profile

    config = folder / "config.yaml"
    cfg = load_config(str(config)) if config.is_file() else None
    if cfg is None or cfg.plan.file:
        raise CliError(
            f"--refine {folder}: the run followed a plan file, so give --profile FILE, the profile that plan was made "
            f"from (without one, the analytic profile of the run's config.yaml is used for a run that planned itself)"
        )
    plan = folder / "plan.yaml"
    size = load_plan(str(plan)).microbatch_size if plan.is_file() else None  # the run's, when the planner chose it
    return gpt_profile(cfg, size), f"the analytic profile of {config}"


def run(args: argparse.Namespace, out) -> int:
    """Make the profile, write -o, print the table or the JSON document on `out`."""
    extra: list[str] = []
    if args.layout_out and not args.refine:
        raise CliError("--layout-out writes what a traced run measured: give --refine RUN_DIR too")
    if args.refine:
        profile, how, extra = _refined(args)
    elif not args.model:
        raise CliError("profile needs --model NAME (or --refine RUN_DIR --profile FILE)")
    else:
        spec = _spec(args)
        profile, how = _measured(spec, args) if args.measured else _analytic(spec, args)
    note = None
    if args.output:
        write_output("profile", args.output, lambda: save_profile(profile, args.output))
        note = f"profile written to {args.output}"
    if args.json:
        out.write(json.dumps({**profile.to_dict(), "runs": runs_to_list(profile)}, indent=2) + "\n")
        if note:
            print(note, file=sys.stderr)
    else:
        out.write(render_profile(profile, how) + "".join(f"{x}\n" for x in extra) + (note + "\n" if note else ""))
    return 0
