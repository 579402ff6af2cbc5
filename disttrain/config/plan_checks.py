"""Checks of the planner's options (``plan.*``) that need nothing built."""

from __future__ import annotations

from typing import Any

from disttrain.errors import ConfigError
from disttrain.plan.auto import OBJECTIVES


def check_plan_options(plan: Any) -> None:
    """Refuse an objective the planner does not know and power figures that cannot be (``PlanConfig``)."""
    if plan.objective not in OBJECTIVES:
        raise ConfigError("plan.objective", plan.objective, f"one of {list(OBJECTIVES)}")
    if plan.watts is not None and plan.watts <= 0:
        raise ConfigError("plan.watts", plan.watts, "a positive power per device in watts, or null")
    if plan.idle_watts is not None and plan.idle_watts < 0:  # above the power under load: ``profile_of_plan``
        raise ConfigError("plan.idle_watts", plan.idle_watts, "a power per device in watts from 0 up to the power "
                          "under load, or null")
