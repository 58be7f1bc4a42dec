"""A schedule: the ordered list of typed actions one gpu runs in one step."""

from mobiuspipe.schedule.actions import Action, Kind
from mobiuspipe.schedule.ahead import receives_ahead
from mobiuspipe.schedule.builders import build_schedule, build_schedules
from mobiuspipe.schedule.check import ScheduleError, check_schedules

__all__ = ["Action", "Kind", "build_schedule", "build_schedules", "check_schedules", "receives_ahead", "ScheduleError"]
