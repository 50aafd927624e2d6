"""Pipeline parallelism: a model split into stages on several workers, run by a schedule.

``Pipeline`` (:mod:`.pipe`) splits a model (:mod:`.split`) and trains it;
:mod:`.runtime` is the one interpreter that runs any valid schedule on the
workers, stage requests in :mod:`.stage`, optimizers in :mod:`.optim`.
``pipeline.schedules`` holds schedules as data (parse, validate);
``pipeline.builders`` builds the textbook ones; ``pipeline.simulate`` times them; ``pipeline.chart`` draws the timeline.
Importing this package imports nothing heavy (no torch) until ``Pipeline``
is used, so ``remotorch schedule`` starts fast.
"""

from . import builders, schedules

__all__ = ["Pipeline", "PipelineOptimizer", "PipelineSplitError", "builders", "schedules"]


def __getattr__(name: str):
    if name == "Pipeline":
        from .pipe import Pipeline
        return Pipeline
    if name == "PipelineOptimizer":
        from .optim import PipelineOptimizer
        return PipelineOptimizer
    if name == "PipelineSplitError":
        from .split import PipelineSplitError
        return PipelineSplitError
    raise AttributeError(f"module 'remotorch.pipeline' has no attribute {name!r}")
