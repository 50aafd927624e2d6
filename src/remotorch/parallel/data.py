"""``DataParallel``: one replica of a model per worker, each step's batch split across them.

::

    dp = remotorch.parallel.DataParallel(model, session=s, loss_fn=loss_fn)   # one replica per worker of s
    opt = dp.optimizer(torch.optim.AdamW, lr=1e-3)
    loss = dp.step(x, y)     # the batch split on dim 0 across replicas; the mean loss
    opt.step(); opt.zero_grad()
    dp.pull(model)           # replica 0's parameters -> the local module

It is a one-stage :class:`~remotorch.pipeline.Pipeline` with a replica per
worker: the first step traces ``loss_fn(model(*x), y)``, uploads the
parameters once (to replica 0; the other replicas take them worker to
worker), and every step runs forward and backward on every replica at
once, then averages the gradients over the replicas' process group. The
optimizer runs on every replica with identical state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..client.session import Session, default_session
from ..pipeline.optim import PipelineOptimizer
from ..pipeline.pipe import Pipeline


class DataParallel:
    """``model`` trained by data parallelism over ``workers`` of ``session`` (default: all of them).

    A batch must split into replicas x ``microbatches`` equal parts along
    dimension 0; an uneven batch is refused with a ``ValueError`` (no
    weighting). ``microbatches`` > 1 accumulates gradients over that many
    parts per replica before the all-reduce. ``group_timeout`` (seconds)
    bounds forming the group and every collective; ``bucket_mb`` is the
    all-reduce bucket size.

    ``overlap_before`` (submodule names, as ``Pipeline``'s ``split_before``)
    cuts each replica's model into parts that stay on its worker, so that
    the average of a later part's gradients runs while the earlier parts'
    backward computes (default: none, every gradient averaged after the
    whole backward; ``benchmarks/data_parallel.py`` measures both).

    ``weights`` (``ROOT/path`` under the workers' ``--weights`` roots) with a
    model built on meta: every replica's worker reads the weights from its own
    disk; none go through this process or from one worker to another.
    """

    def __init__(self, model: torch.nn.Module, *, loss_fn: Callable, session: Session | None = None,
                 workers: Sequence[int | str] | None = None, microbatches: int = 1, engine: str = "eager",
                 group_timeout: float = 60.0, bucket_mb: float = 25.0,
                 overlap_before: Sequence[str] = (), weights: str | None = None,
                 revision: str | None = None) -> None:
        session = session if session is not None else default_session()
        replicas = len(workers) if workers is not None else len(session.connections())
        self.pipe = Pipeline(model, list(overlap_before), loss_fn=loss_fn, session=session, schedule="GPipe",
                             microbatches=microbatches, engine=engine, replicas=replicas, workers=workers,
                             group_timeout=group_timeout, bucket_mb=bucket_mb, overlap=bool(overlap_before),
                             weights=weights, revision=revision)

    @property
    def model(self) -> torch.nn.Module:
        return self.pipe.model

    @property
    def replicas(self) -> int:
        return self.pipe.replicas

    def step(self, x, y) -> torch.Tensor:
        """Forward and backward of the batch, split across the replicas; gradients averaged; the mean loss."""
        return self.pipe.step(x, y)

    def optimizer(self, optimizer_class: type[torch.optim.Optimizer], **hyperparameters) -> PipelineOptimizer:
        """``optimizer_class`` on every replica (its ``state_dict()`` is replica 0's)."""
        return self.pipe.optimizer(optimizer_class, **hyperparameters)

    def pull(self, model: torch.nn.Module | None = None) -> int:
        """Replica 0's parameters into ``model`` (default: the one being trained)."""
        return self.pipe.pull(model)

    def state_dict(self) -> dict:
        """Parameters and optimizer state (replica 0's), for a checkpoint."""
        return self.pipe.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint: parameters go to replica 0 and from it to the others with the next step."""
        self.pipe.load_state_dict(state)

    def __repr__(self) -> str:
        return f"DataParallel(replicas={self.replicas})"
