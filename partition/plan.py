"""The Plan: stages, their gpus, the arena layout and the predicted step; plain data, saved as YAML/JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path

from partition.errors import PlanFileError
from partition.files import read_data, write_data

__all__ = ["StagePlan", "SolverInfo", "Plan", "load_plan", "save_plan"]


@dataclass(frozen=True)
class StagePlan:
    """Stage j: layers first..last (0-based, inclusive) on `gpu`, with its predicted costs."""

    first: int
    last: int
    gpu: int
    param_count: int
    param_bytes: int
    activation_bytes: int
    """Live activation bytes while the stage runs backward on one microbatch."""
    output_bytes: int
    """Bytes of the stage's output for one microbatch (what goes to the next stage)."""
    fwd_s: float
    """Forward seconds per microbatch."""
    bwd_s: float
    """Backward seconds per microbatch (without the recomputed forward)."""
    load_gbps: float
    """Host->gpu bandwidth this stage's loads get under the mapping's contention, GB/s."""

    @property
    def load_s(self) -> float:
        return self.param_bytes / (self.load_gbps * 1e9)


@dataclass(frozen=True)
class SolverInfo:
    """Which algorithm produced the plan and how it ended."""

    name: str
    status: str
    gap: float
    wall_s: float


@dataclass(frozen=True)
class Plan:
    """Output of `partition`: everything the runtime needs to run a step, and what it should cost."""

    model: str
    topology: str
    num_layers: int
    num_gpus: int
    num_microbatches: int
    microbatch_size: int
    dtype: str
    mapping_rule: str
    mapping_score: float
    """Total contention of the mapping: sum over stage pairs less than N apart of shared / |i - j|."""
    stages: tuple[StagePlan, ...]
    slot_bytes: int
    """W: one weight slot of the device arena = the largest stage's parameter bytes."""
    arena_bytes: int
    """Device arena budget: ARENA_SLOTS * slot_bytes."""
    activation_bytes: int
    """Largest live activation bytes of any stage (one microbatch)."""
    gpu_memory_bytes: int
    """Usable memory per gpu the plan was made for (after the reserve)."""
    predicted_step_time_s: float
    solver: SolverInfo

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def mapping(self) -> list[int]:
        return [s.gpu for s in self.stages]

    def stages_of(self, gpu: int) -> list[int]:
        """Indices j of the stages gpu runs, in forward order."""
        return [j for j, s in enumerate(self.stages) if s.gpu == gpu]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stages"] = [asdict(s) for s in self.stages]
        d["num_stages"] = self.num_stages
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "plan") -> "Plan":
        return _from_dict(d, where)


def _validate(p: Plan) -> None:
    if not p.stages:
        raise PlanFileError("a plan needs at least one stage")
    nxt = 0
    for j, s in enumerate(p.stages):
        if s.first != nxt or s.last < s.first:
            raise PlanFileError(f"stage {j} covers layers {s.first}..{s.last}, expected it to start at layer {nxt}: "
                                f"stages must be contiguous, in order, and non-empty")
        if not 0 <= s.gpu < p.num_gpus:
            raise PlanFileError(f"stage {j} is on gpu {s.gpu}, expected 0..{p.num_gpus - 1}")
        if s.param_bytes > p.slot_bytes:
            raise PlanFileError(f"stage {j} has {s.param_bytes} parameter bytes, more than the slot ({p.slot_bytes})")
        nxt = s.last + 1
    if nxt != p.num_layers:
        raise PlanFileError(f"stages cover layers 0..{nxt - 1}, expected 0..{p.num_layers - 1}")
    unused = sorted(set(range(p.num_gpus)) - set(p.mapping))
    if unused:
        raise PlanFileError(f"gpus {unused} have no stage; every gpu needs at least one (add stages)")


def _from_dict(d: dict, where: str) -> Plan:
    if not isinstance(d, dict):
        raise PlanFileError(f"{where}: expected a mapping at the top level, found {type(d).__name__}")
    d = {k: v for k, v in d.items() if k != "num_stages"}  # derived; written for readers
    try:
        if "stages" in d:  # a missing key is reported by _build(Plan, ...)
            if not isinstance(d["stages"], list):
                raise PlanFileError(f"{where}: key 'stages' expected a list of mappings, found {d['stages']!r}")
            d["stages"] = tuple(_build(StagePlan, s, f"{where}: stages[{j}]") for j, s in enumerate(d["stages"]))
        if "solver" in d:
            d["solver"] = _build(SolverInfo, d["solver"], f"{where}: solver")
        return _build(Plan, d, where)
    except PlanFileError:
        raise
    except (TypeError, ValueError) as e:
        raise PlanFileError(f"{where}: {e}") from e


def _build(cls, d, where: str):
    if not isinstance(d, dict):
        raise PlanFileError(f"{where}: expected a mapping, found {d!r}")
    names = {f.name for f in fields(cls)}
    unknown, missing = sorted(set(d) - names), sorted(names - set(d))
    if unknown or missing:
        raise PlanFileError(f"{where}: unknown keys {unknown}, missing keys {missing}; "
                            f"write plans with `mobiuspipe partition -o FILE`")
    for f in fields(cls):
        want = _SCALARS.get(f.type)
        if want and (isinstance(d[f.name], bool) or not isinstance(d[f.name], want)):
            raise PlanFileError(f"{where}: key {f.name!r} expected {f.type}, found {d[f.name]!r}")
    try:
        return cls(**d)
    except PlanFileError as e:  # Plan's own consistency checks: say which file
        raise PlanFileError(f"{where}: {e}") from None


_SCALARS = {"int": (int,), "float": (int, float), "str": (str,)}


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write YAML (or JSON when the suffix is .json)."""
    write_data(plan.to_dict(), path)


def load_plan(path: str | Path) -> Plan:
    """Read a plan written by save_plan; PlanFileError on anything malformed."""
    d = read_data(path, PlanFileError, "plan", f"`mobiuspipe partition ... -o {Path(path).name}`")
    return Plan.from_dict(d, str(path))
