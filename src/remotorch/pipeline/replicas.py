"""Replicas of a pipeline's stages on disjoint sets of workers, kept equal by collectives between the workers.

Replica ``r`` runs every stage on its own ``W`` workers, placed as the
schedule places them. Worker ``w`` of every replica holds the same stages,
so the ``R`` workers of column ``w`` form one process group
(:class:`~remotorch.training.groups.WorkerGroup`), and over it:

* **parameters** go up once, to replica 0 (the client uploads what changed
  there, as for a single pipeline), then every other replica takes them
  from it by ``BroadcastSlots``: the client never uploads R copies. The
  other replicas' training clients *mirror* replica 0's (their slots are
  filled worker to worker; only replica 0's bring values back);
* **gradients** of a step are averaged after every replica's backward, by
  ``ReduceGrads`` (an all-reduce of ``weight`` x each gradient, in buckets).

With equal gradients and identical optimizer state, every replica's
optimizer makes the same update, so the replicas stay equal without
another broadcast.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..codec import messages as m
from ..codec.tensors import dtype_name
from ..training.client import TrainingClient
from ..client.ids import stamp
from ..client.pool import run_all
from ..training.groups import WorkerGroup


class Column:
    """Worker ``w`` of every replica: its training clients (replica order), the parameters of its
    stages (local tensors, the same for every replica), and the group they form."""

    def __init__(self, clients: list[TrainingClient], params: list[torch.Tensor], *, timeout_s: float,
                 generation: int) -> None:
        self.clients = clients
        self.params = params
        for mirror in clients[1:]:
            mirror.replica_of = clients[0]
        self.group = WorkerGroup([c.connection for c in clients], timeout_s=timeout_s, generation=generation)

    def sids(self, rank: int) -> list[int]:
        return [self.clients[rank].claim(t).sid for t in self.params]

    def sync(self) -> bool:
        """Broadcast replica 0's parameters to the others where a mirror is behind; True if it did.

        Replica 0's slots must be bound (its stages bind them) before.
        """
        mirrors = [[c.claim(t) for t in self.params] for c in self.clients[1:]]
        if not any(slot.stamp != stamp(t) for slots in mirrors for slot, t in zip(slots, self.params)):
            return False
        shapes = [list(t.shape) for t in self.params]
        dtypes = [dtype_name(t.dtype) for t in self.params]
        ids = [self.sids(r) for r in range(len(self.clients))]
        self.group.ask([m.BroadcastSlots(self.group.id, ids[rank], shapes, dtypes, 0) for rank in range(len(ids))])
        self.mirrored()
        return True

    def mirrored(self) -> None:
        """The mirrors hold replica 0's values, which are the local tensors' (after a sync or a pull)."""
        for client in self.clients[1:]:
            for t in self.params:
                slot = client.claim(t)
                slot.stamp, slot.stepped = stamp(t), False
            client.slots.bound = True

    def start(self, rank: int, params: Sequence[torch.Tensor], bucket_bytes: int) -> None:
        """Replica ``rank`` starts averaging these parameters' gradients and goes on at once (overlap)."""
        client = self.clients[rank]
        ids = [client.claim(t).sid for t in params]
        client.post(m.ReduceGrads(self.group.id, ids, 1.0, bucket_bytes, wait=False),
                    what="averaging gradients over the replicas")

    def finish(self) -> None:
        """Every member waits for the reductions it started (after every replica's last backward).

        Sent without waiting: each member's next request (an optimizer step)
        runs after it; a failed reduction is raised at the next read there.
        """
        for client in self.clients:
            client.post(m.ReduceGrads(self.group.id, []), what="finishing the gradients' averaging")

    def reduce(self, weight: float, bucket_bytes: int) -> None:
        ids = [self.sids(r) for r in range(len(self.clients))]
        self.group.ask([m.ReduceGrads(self.group.id, ids[rank], weight, bucket_bytes) for rank in range(len(ids))])


def each_column(columns: Sequence[Column], call: Callable[[Column], object]) -> list:
    """``call`` on every column at once (their groups are independent)."""
    return run_all([lambda c=c: call(c) for c in columns])
