"""Data parallelism: replicas of a model on several workers, gradients averaged worker to worker.

``DataParallel`` (:mod:`.data`) trains one replica per worker; a
``Pipeline(..., replicas=R)`` replicates every pipeline stage (data x
pipeline). :mod:`remotorch.pipeline.replicas` keeps the replicas equal over
process groups of the workers (:mod:`remotorch.training.groups`,
torch.distributed: gloo on CPU, NCCL on CUDA). Importing this package
imports nothing heavy until they are used.
"""

__all__ = ["DataParallel", "WorkerGroup"]


def __getattr__(name: str):
    if name == "DataParallel":
        from .data import DataParallel
        return DataParallel
    if name == "WorkerGroup":
        from ..training.groups import WorkerGroup
        return WorkerGroup
    raise AttributeError(f"module 'remotorch.parallel' has no attribute {name!r}")
