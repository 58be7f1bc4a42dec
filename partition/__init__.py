"""Planning: model specs, per-layer profiles, the exact DP, cross mapping, the step simulator and the Plan."""

from partition.errors import PlanFileError, PlanInfeasibleError, UnknownModelError
from partition.plan import Plan, load_plan, save_plan
from partition.search import make_plan

__all__ = ["Plan", "make_plan", "load_plan", "save_plan", "PlanInfeasibleError", "PlanFileError", "UnknownModelError"]
