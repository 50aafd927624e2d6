"""Pipeline parallelism: a model split into stages on several workers, run by a schedule.

``pipeline.schedules`` holds schedules as data (build, parse, validate);
``pipeline.simulate`` times them; ``pipeline.chart`` draws the timeline.
Importing this package imports nothing heavy (no torch).
"""

from . import schedules

__all__ = ["schedules"]
