"""The training run's configuration: one frozen, checked dataclass per section, loaded from YAML.

Paths: every path in a config file is relative to the folder of that file, whatever the current folder, and
the loaded config holds it absolute (`~` expanded). That is true of what the run reads (data.path,
data.tokens, data.tokenizer, data.eval_path, model.hf, plan.file, plan.topology when it names a layout file:
they must exist when the config is loaded; field metadata `path_fix` or `folder_fix`, see foundation/loader.py)
and of what it writes (train.out_dir, train.export_dir, train.checkpoint_dir, memory.ssd_dir: metadata
WRITTEN_PATH, they need not exist); train.resume alone is relative to the current folder, as --resume is.
A path given on the command line (`partition --topology`, `export --to`, ...) is relative to the current
folder. A config built from a dict (config_from_dict) takes its relative paths from `base_dir`, the
current folder by default; sections built in Python keep their paths as given. A new path key follows the
same rule: give its field one of those metadata.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from foundation.loader import Problem, at_least, dump_text, from_plain, load_file, positive, rule, to_plain
from mobiuspipe.config.data import DataConfig
from mobiuspipe.config.lora import LoraConfig
from mobiuspipe.config.lr_schedule import SCHEDULES, lr_at
from mobiuspipe.config.memory import MemoryConfig
from mobiuspipe.config.model import ModelConfig
from mobiuspipe.config.runtime import RuntimeConfig
from mobiuspipe.config.section import AUTO_COUNT, WRITTEN_PATH, Section, mebibytes
from mobiuspipe.errors import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16")
"""Training precisions: the dtype of the weights and gradients on the device (master weights stay fp32)."""
DEFAULT_GPUS = 2
"""CPU stand-ins a run plans for when the config names neither a topology nor plan.num_gpus."""
MAPPINGS = ("cross", "round-robin", "search")
"""The stage->gpu mappings a plan may ask for."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig(Section):
    """The optimizer (AdamW) and the training loop."""

    steps: int = 20
    """Optimizer steps to run (count)."""
    lr: float = 3e-3
    """AdamW learning rate (per step, dimensionless); > 0. The peak of the schedule."""
    lr_schedule: str = "constant"
    """"constant", "linear" or "cosine" decay from lr to min_lr over the steps after warmup
    (mobiuspipe/config/lr_schedule.py has the formulas)."""
    warmup_steps: int = 0
    """Steps of linear warmup from lr / warmup_steps up to lr (count); 0 = none."""
    min_lr: float = 0.0
    """The rate the linear and cosine schedules end at, in [0, lr]."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW decay rates of the first and second moment estimates; each in [0, 1)."""
    eps: float = 1e-8
    """AdamW term added to the denominator for numerical stability (dimensionless); >= 0."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay (fraction of lr * weight per step); >= 0."""
    max_grad_norm: float | None = None
    """Clip the gradients to this global L2 norm (over every stage and rank) before each update, as
    torch.nn.utils.clip_grad_norm_ does; None = no clipping. The norm is known only after the whole backward: the
    updates start before it speculatively (speculative_update), or wait for it."""
    speculative_update: bool = True
    """With max_grad_norm or fp16: each stage's host update starts as soon as its gradients are offloaded, assuming
    no clipping and no overflow, and keeps what it overwrites (host states: a copy of the master and the moments, 12
    bytes a parameter, and of the weights it writes; SSD states: a second set of records on the SSD) until the step's
    norm and overflow check are known. Then it stands, or is rolled back and redone with the clipped gradients (or
    dropped with a skipped step): the weights are bit for bit those of updates that wait for the norm. A step that
    clips costs its updates twice, so after a step that clipped or overflowed the next one's updates wait, and the
    speculation resumes after a step that did neither. false: every update waits for the whole backward. Stages
    holding a tied parameter always wait."""
    accumulation_steps: int = 1
    """Pipeline passes per optimizer step (count): each pass is data.batch_size sequences, their gradients
    summed before one update, so a step trains on accumulation_steps * batch_size sequences."""
    delayed_update: int | None = None
    """ZeRO-Offload's one-step delayed parameter update from this optimizer step on (0-based): step s >= N computes
    its gradients on the weights before the update of step s - 1, which the host runs meanwhile, so the update leaves
    the critical path (the steps before N update before the next step starts). Clipping, fp16's skipped steps and
    accumulation apply to each step's own gradients as without it. Every pending update is applied before each
    checkpoint, the export and the end of the run; a checkpoint keeps the weights the next step loads, so a resume
    repeats the run bit for bit. The weights the device loads and the offloaded gradients are kept twice (in host
    memory, or as two sets of records on the SSD with memory.weights ssd); refused with memory.optimizer device.
    null = off."""
    precision: str = "bf16"
    """Dtype of the weights and gradients on the device: "bf16" (default), "fp16" (with dynamic loss
    scaling) or "fp32"; the master weights and Adam moments stay fp32 on the host. The plan's dtype."""
    seed: int = 0
    """Seed of every random generator (weights init, data order); same seed, same run."""
    log_every: int = 1
    """Log the loss every this many steps (steps)."""
    eval_every: int = 0
    """With data.eval_path: evaluate on the held-out data every this many optimizer steps and after the last
    (steps); 0 = after the last step only. Each evaluation reports the mean loss and its perplexity."""
    eval_batches: int | None = None
    """Held-out batches (of data.batch_size sequences) per evaluation (count); None = every full batch."""
    eval_at_start: bool = False
    """With data.eval_path: also evaluate before the first step (the starting weights' loss, e.g. the
    pretrained model's), recorded as step -1."""
    out_dir: str | None = field(default=None, metadata=WRITTEN_PATH)
    """Folder for metrics.jsonl, the resolved config and plan, TensorBoard files and the weights, relative to
    the config file's folder (made if missing); None = write nothing."""
    export_dir: str | None = field(default=None, metadata=WRITTEN_PATH)
    """A new (or empty) folder the fine-tuned model is written to at the end of the run, as a Hugging Face
    folder that from_pretrained loads (safetensors shards, config.json, the source's tokenizer files);
    model.hf only; relative to the config file's folder. A folder holding this run's own export (the same
    out_dir's: a finished run extended or resumed) is replaced at the end, after the last checkpoint; any other
    is refused. None = no export (`mobiuspipe export` can make one later from out_dir)."""
    export_dtype: str = "fp32"
    """Dtype of the exported weights: "fp32" (the master weights as they are), "bf16" or "fp16"."""
    tensorboard: bool = True
    """With out_dir: rank 0 also writes TensorBoard event files there (`tensorboard --logdir OUT_DIR`)."""
    checkpoint_every: int = 0
    """Write a checkpoint every this many optimizer steps (steps); 0 = only when the run is stopped by
    SIGTERM or SIGINT. Each holds every rank's master weights, optimizer states, loss scaler, random state
    and step, so that `resume` continues the run bit-identically."""
    checkpoint_dir: str | None = field(default=None, metadata=WRITTEN_PATH)
    """Folder of the checkpoints (step-N folders), relative to the config file's folder; None =
    OUT_DIR/checkpoints."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept (count, >= 1): older ones are removed once a newer one is committed. A run whose
    checkpoint folder holds checkpoints after the step it starts at (another run's, or the steps a resume from an
    older one leaves) is refused before it writes anything ([checkpoints](checkpoints.md))."""
    resume: str | None = None
    """"auto": continue from the newest complete checkpoint in the checkpoint folder (start at step 0 when
    there is none: what a job restarted by `torchrun --max-restarts` needs); a step-N folder: continue from
    it (absolute, or relative to the current directory as `--resume PATH` is: the one path key not relative to
    the config file, since the command line usually names it); None = start at step 0. `mobiuspipe train
    --resume` sets it."""

    @property
    def checkpoint_root(self) -> str | None:
        """The folder checkpoints go in: checkpoint_dir, else OUT_DIR/checkpoints; None without either."""
        if self.checkpoint_dir:
            return self.checkpoint_dir
        return os.path.join(self.out_dir, "checkpoints") if self.out_dir else None

    def lr_of(self, step: int) -> float:
        """The learning rate of optimizer step `step` under this schedule."""
        return lr_at(step, self.lr, self.lr_schedule, self.warmup_steps, self.steps, self.min_lr)

    def check_values(self) -> list[Problem]:
        return [
            *at_least(self, "steps", 1, "run at least 1 step, e.g. 20"),
            *(
                at_least(self, "delayed_update", 0, "start the delayed update at a step >= 0, e.g. 2, or null (off)")
                if self.delayed_update is not None
                else []
            ),
            *positive(self, "lr", "use a positive learning rate such as 0.003"),
            *rule(
                self.lr_schedule in SCHEDULES,
                "lr_schedule",
                "one of " + ", ".join(SCHEDULES),
                repr(self.lr_schedule),
                "use `lr_schedule: cosine` (or linear, constant)",
            ),
            *rule(
                0 <= self.warmup_steps <= self.steps,
                "warmup_steps",
                f"a count in [0, steps = {self.steps}]",
                repr(self.warmup_steps),
                "use fewer warmup steps than the run has steps",
            ),
            *rule(
                0 <= self.min_lr and (self.lr <= 0 or self.min_lr <= self.lr),  # a bad lr is reported alone
                "min_lr",
                f"a rate in [0, lr = {self.lr:g}]",
                repr(self.min_lr),
                "use e.g. a tenth of lr",
            ),
            *rule(
                all(0 <= b < 1 for b in self.betas),
                "betas",
                "two numbers each in [0, 1)",
                repr(list(self.betas)),
                "use e.g. [0.9, 0.95]",
            ),
            *positive(self, "eps", "use a small non-negative number such as 1.0e-8", zero_ok=True),
            *positive(self, "weight_decay", "use 0.0 (none) or a small value such as 0.01", zero_ok=True),
            *rule(
                self.max_grad_norm is None or 0 < self.max_grad_norm < math.inf,
                "max_grad_norm",
                "a positive finite norm or null",
                repr(self.max_grad_norm),
                "use e.g. 1.0, or null for no clipping",
            ),
            *rule(
                0 <= self.seed < 2**32,
                "seed",
                "a seed in [0, 2**32 - 1]",
                repr(self.seed),
                "use e.g. `seed: 0`",
            ),
            *at_least(self, "accumulation_steps", 1, "use 1 (no accumulation) or more passes per step"),
            *at_least(self, "log_every", 1, "log every 1 or more steps"),
            *at_least(self, "checkpoint_every", 0, "checkpoint every 1 or more steps, or 0 for only on a stop"),
            *at_least(self, "keep_checkpoints", 1, "keep at least the newest checkpoint, e.g. 2"),
            *at_least(self, "eval_every", 0, "evaluate every 1 or more steps, or 0 for after the last only"),
            *rule(
                self.eval_batches is None or self.eval_batches >= 1,
                "eval_batches",
                "a count >= 1 or null (every full batch)",
                repr(self.eval_batches),
                "use e.g. 4, or null",
            ),
            *rule(
                self.precision in PRECISIONS,
                "precision",
                "one of " + ", ".join(PRECISIONS),
                repr(self.precision),
                "use `precision: bf16` (or fp16 / fp32)",
            ),
            *rule(
                self.export_dtype in PRECISIONS,
                "export_dtype",
                "one of " + ", ".join(PRECISIONS),
                repr(self.export_dtype),
                "use `export_dtype: fp32` (or bf16 / fp16)",
            ),
            *rule(
                self.out_dir != "",
                "out_dir",
                "a folder name or null",
                "an empty string",
                "write a folder such as `out_dir: runs/tiny`, or null to write nothing",
            ),
        ]


@dataclass(frozen=True, kw_only=True)
class PlanConfig(Section):
    """Where the stages run: a plan file, or the numbers to plan with at start-up."""

    file: str | None = field(
        default=None,
        metadata={
            "path_fix": (
                "write one with `mobiuspipe partition --config RUN.yaml -o FILE` while RUN.yaml has no plan.file, "
                "then set plan.file; or remove plan.file to plan at start-up"
            )
        },
    )
    """A plan written by `mobiuspipe partition -o plan.yaml`; None = plan at start-up; a relative
    path is resolved against the config file's folder and stored absolute."""
    topology: str | None = field(
        default=None,
        metadata={
            "path_fix": "correct the path, or save a layout with `mobiuspipe topology --save FILE.yaml`",
            "path_suffixes": (".yaml", ".yml", ".json"),
        },
    )
    """The machine to plan for: a preset name ("2+2", "3+1", ...; `mobiuspipe topology --layout NAME`
    shows one) or a layout file (a name ending .yaml, .yml or .json) from `mobiuspipe topology --save`
    (relative to the config file's folder);
    the run has one rank per gpu of it, and on a CPU-only machine each rank is a stand-in for one of its
    gpus, so cross mapping follows its root complexes. None = with GPUs, this host's discovered topology
    (the first num_gpus CUDA devices, default all); without, num_gpus CPU stand-ins of device_memory_mb."""
    num_gpus: int | None = None
    """Gpus (torchrun ranks) the stages are spread over (count); None = the topology's gpu count, or 2
    without a topology; with a topology it must equal its gpu count."""
    num_stages: int | None = field(default=None, metadata=AUTO_COUNT)
    """Stages the layers are cut into (count), >= the gpu count and <= the model's layers (model.num_blocks + 2);
    auto (or null, or left out): the planner searches every count and keeps the fastest, as `mobiuspipe partition`
    does."""
    mapping: str = "cross"
    """How stages are assigned to gpus: "cross" (Mobius cross mapping), "round-robin", or "search" (every
    cyclic gpu order, up to 4 gpus; the fastest predicted wins)."""
    device_memory_mb: float = 64.0
    """Memory budget of each CPU stand-in device (MiB); on CUDA the real GPU memory is used."""
    reserve_mb: float | None = None
    """Memory of each gpu the plan leaves alone (MiB, >= 0) for what the runtime does not allocate itself: the CUDA
    context, NCCL's buffers, the allocator's rounding, other processes on the gpu. null: 1024 on a real gpu (or a
    preset's, or a layout's), 0 on a CPU stand-in, whose budget is device_memory_mb itself."""

    def check_values(self) -> list[Problem]:
        gpus = DEFAULT_GPUS if self.num_gpus is None else self.num_gpus
        stages = gpus if self.num_stages is None else self.num_stages
        return [
            *rule(gpus >= 1, "num_gpus", "an integer >= 1 or null", repr(self.num_gpus), "use at least 1 gpu"),
            *(
                at_least(self, "num_stages", 1, "use at least 1 stage per gpu, e.g. 4, or auto")
                if self.num_stages is not None
                else []
            ),
            *rule(
                stages >= gpus or self.topology is not None,  # with a topology: checked once it is read
                "num_stages",
                "num_stages >= num_gpus (each gpu needs at least one stage)",
                f"num_stages {stages} with num_gpus {gpus}: more gpus than stages",
                f"raise num_stages to at least {gpus} or lower num_gpus to {max(stages, 1)}",
            ),
            *rule(
                self.mapping in MAPPINGS,
                "mapping",
                "one of " + ", ".join(MAPPINGS),
                repr(self.mapping),
                "use `mapping: cross` or `mapping: round-robin`",
            ),
            *mebibytes(self, "device_memory_mb", "use a positive budget in MiB, e.g. 64.0"),
            *(
                at_least(self, "reserve_mb", 0, "use 0 or more MiB, e.g. 1024, or null (1024 on a real gpu)")
                if self.reserve_mb is not None
                else []
            ),
        ]


@dataclass(frozen=True, kw_only=True)
class RunConfig(Section):
    """A whole training run: every section (each optional in YAML) and the file it came from."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to train."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters to train instead of every weight (none unless lora.rank or model.adapter is set)."""
    data: DataConfig = field(default_factory=DataConfig)
    """The training and held-out data, the tokenizer and the batches."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The optimizer and the loop."""
    plan: PlanConfig = field(default_factory=PlanConfig)
    """Stages and their gpus."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """Where the optimizer states live."""
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """Timeouts and threads of the ranks."""
    source: str = field(default="<defaults>", metadata={"in_file": False})
    """The file this config came from (absolute path), or "<dict>"/"<defaults>"; not a YAML key."""

    @property
    def num_layers(self) -> int:
        """Layers of the model: num_blocks + 2 (embedding, blocks, head)."""
        return self.model.num_layers

    @property
    def microbatch_size(self) -> int | None:
        """Sequences per microbatch: batch_size // num_microbatches; None when the planner chooses them."""
        return self.data.microbatch_size

    def check_values(self) -> list[Problem]:
        stages, layers = self.plan.num_stages or 0, self.model.num_layers
        export = rule(
            self.train.export_dir is None or self.model.hf is not None,
            "train.export_dir",
            "an export folder only with model.hf (the export writes a Hugging Face folder)",
            f"export_dir {self.train.export_dir!r} for the built-in GPT",
            "remove train.export_dir (the run's weights are in out_dir/weights) or train a model.hf",
        )
        t = self.train
        evaluate = rule(
            (t.eval_every == 0 and not t.eval_at_start) or self.data.eval_path is not None,
            "train.eval_every" if t.eval_every else "train.eval_at_start",
            "held-out data (data.eval_path) to evaluate on",
            f"eval_every {t.eval_every}, eval_at_start {t.eval_at_start} without data.eval_path",
            "set data.eval_path to a held-out text or token file, or remove train.eval_every and eval_at_start",
        )
        wants = t.checkpoint_every > 0 or t.resume is not None
        checkpoints = rule(
            not wants or t.checkpoint_root is not None,
            "train.checkpoint_every" if t.checkpoint_every else "train.resume",
            "a folder for the checkpoints (train.out_dir or train.checkpoint_dir)",
            f"checkpoint_every {t.checkpoint_every}, resume {t.resume!r} with neither",
            "set train.out_dir (checkpoints go to OUT_DIR/checkpoints) or train.checkpoint_dir",
        )
        late = [s for s in self.runtime.trace_steps if s >= t.steps]
        trace = rule(
            not late and (not self.runtime.trace_steps or t.out_dir is not None),
            "runtime.trace_steps",
            f"steps below train.steps ({t.steps}) and a train.out_dir to write out_dir/trace.json",
            f"trace_steps {list(self.runtime.trace_steps)}, out_dir {t.out_dir!r}",
            "trace steps the run takes (the first is 0) and set train.out_dir",
        )
        return (
            export
            + self._lora_problems()
            + evaluate
            + checkpoints
            + trace
            + rule(
                stages <= layers,
                "plan.num_stages",
                f"at most {layers} stages, the model's layers (blocks + 2; a stage needs at least one layer)",
                f"{stages} stages for {layers} layers",
                f"lower plan.num_stages to {layers}"
                + ("" if self.model.hf else f" or raise model.num_blocks to {stages - 2}"),
            )
        )

    @property
    def lora_on(self) -> bool:
        """Whether the run trains LoRA adapters (lora.rank, or model.adapter's) rather than every weight."""
        return self.lora.on or self.model.adapter is not None

    def _lora_problems(self) -> list[Problem]:
        """lora keys need a rank (or model.adapter) to apply to; model.adapter needs model.hf (its names)."""
        keys = ("alpha", "dropout", "targets", "rslora", "base_dtype")
        set_keys = [k for k in keys if getattr(self.lora, k) != getattr(LoraConfig, k)]
        return [
            *rule(
                self.lora_on or not set_keys,
                f"lora.{set_keys[0]}" if set_keys else "lora",
                "lora.rank (or model.adapter) for the adapters these keys describe",
                f"{', '.join(f'lora.{k}' for k in set_keys)} without lora.rank",
                "set lora.rank (e.g. 16) to train LoRA adapters, or remove the lora section to train every weight",
            ),
            *rule(
                self.lora_on or self.memory.frozen == "host",
                "memory.frozen",
                "frozen weights to place: LoRA (lora.rank or model.adapter) freezes the base",
                f"frozen {self.memory.frozen!r} without LoRA",
                "set lora.rank to train adapters over a frozen base, or remove memory.frozen",
            ),
            *rule(
                self.model.adapter is None or self.model.hf is not None,
                "model.adapter",
                "an adapter of a Hugging Face model: model.hf beside it",
                f"adapter {self.model.adapter!r} for the built-in GPT",
                "set model.hf to the adapter's base model folder, or remove model.adapter",
            ),
        ]

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every section (not `source`); `config_from_dict` takes it back exactly."""
        return to_plain(self)

    def to_yaml(self) -> str:
        """The config as YAML text, every key written out."""
        return dump_text(self.to_dict(), ".yaml")

    @classmethod
    def from_dict(cls, d: Any, source: str = "<dict>") -> RunConfig:
        """Same as `config_from_dict`."""
        return config_from_dict(d, source)


def config_from_dict(d: Any, source: str = "<dict>", *, base_dir: str | None = None) -> RunConfig:
    """Build a checked RunConfig from a plain dict; relative paths start at `base_dir` (default cwd).

    Raises ConfigError naming `source` and listing every problem found.
    """
    return from_plain(
        RunConfig, d, where=f"config {source}", error=ConfigError, base_dir=base_dir, extra={"source": source}
    )


def load_config(path: str | os.PathLike) -> RunConfig:
    """Read a YAML config file; ConfigError names the file, the dotted key and the fix."""
    source = os.path.abspath(os.fspath(path))
    return load_file(
        RunConfig,
        source,
        what="config",
        error=ConfigError,
        fix="check the path, e.g. examples/tiny-gpt.yaml",
        extra={"source": source},
    )
