"""What one connection counted: runs and the worker's time for them, uploads, values fetched and moved.

Every run is counted in one place (:meth:`Connection.call` with
``expect=RunReply``), whatever sent it: a captured graph, an asynchronous
launch, a training step or a pipeline stage.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class Counters:
    remote_calls: int = 0
    remote_ms: float = 0.0  # the worker's own time running graphs
    graphs_uploaded: int = 0
    tensors_uploaded: int = 0
    graphs_recalled: int = 0  # taken from the worker's disk cache instead of uploaded (protocol.md §20)
    tensors_recalled: int = 0
    values_fetched: int = 0  # values read back from the worker when Python used them
    values_moved: int = 0  # values sent worker to worker
    eager_ops: int = 0  # eager torch calls on kept values sent to the worker (client.eager)

    def ran(self, reply, request=None) -> None:
        """One run answered (a ``RunReply``, or a ``ProfileReply``, which times itself); the values
        its request had the worker send to other workers."""
        self.remote_calls += 1
        self.remote_ms += getattr(reply, "run_ms", 0.0)
        for send in getattr(request, "send", ()):
            self.values_moved += len(send.outputs)

    def as_dict(self) -> dict:
        return asdict(self)
