"""Pipeline schedules as data: the one place to import them from.

A :class:`Schedule` says, for every worker, the ordered list of actions
(:class:`Action`: ``"0F1"`` is stage 0, forward, microbatch 1) it runs, and
which worker holds each stage; :func:`validate`, :func:`parse`,
:func:`dependencies`, :func:`replay` and :mod:`~remotorch.pipeline.simulate`
read that data, and :func:`build` makes the textbook schedules (``GPipe``,
``1F1B``, ``Interleaved1F1B``) as it.

This module is a face: the data and its rules live in
:mod:`remotorch.pipeline.plan`, the textbook schedules in
:mod:`remotorch.pipeline.builders` (which imports the data, so the data
cannot import it back), and both are re-exported here.
"""

from __future__ import annotations

from .builders import SCHEDULES, build
from .plan import (BACKWARD, FORWARD, KINDS, Action, Schedule, ScheduleError, check_static, dependencies, parse,
                   replay, validate)

__all__ = ["KINDS", "SCHEDULES", "Action", "Schedule", "ScheduleError", "build", "check_static", "dependencies",
           "parse", "replay", "validate"]
