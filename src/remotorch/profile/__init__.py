"""Profiling across workers and engines: ``accelerate``, ``remote_profile``, reports, ``explain``."""

from .accelerate import Accelerated, accelerate
from .explain import Explanation, explain
from .profiler import Profiler, remote_profile
from .report import BackendSummary, Report, Segment, SequenceReport, Stats

__all__ = ["Accelerated", "BackendSummary", "Explanation", "Profiler", "Report", "Segment",
           "SequenceReport", "Stats", "accelerate", "explain", "remote_profile"]
