"""A schedule: the ordered list of typed actions one gpu runs in one step."""

from mobiuspipe.schedule.actions import Action, Kind
from mobiuspipe.schedule.builders import build_schedule
from mobiuspipe.schedule.check import ScheduleError, check_schedules

__all__ = ["Action", "Kind", "build_schedule", "check_schedules", "ScheduleError"]
