"""The messages of process groups between workers (protocol.md §19): data-parallel training.

They live beside :mod:`remotorch.codec.messages`, which takes them into its
``Request`` and ``Reply`` unions; import them from there (``m.JoinGroup``).
"""

from __future__ import annotations

import msgspec


class OpenStore(msgspec.Struct, frozen=True, tag="open_store", omit_defaults=True):
    """Host a rendezvous store for a group on this worker's group host (answered ``StoreReply``)."""

    timeout_s: float = 60.0


class StoreReply(msgspec.Struct, frozen=True, tag="store_reply", omit_defaults=True):
    """Where the store listens: ``host:port`` on the worker's group host."""

    address: str


class JoinGroup(msgspec.Struct, frozen=True, tag="join_group", omit_defaults=True):
    """Become ``rank`` of a ``world``-member group ``group`` (this session's id for it), meeting the
    others at ``store`` under ``prefix``; answered ``Ok`` once every member joined."""

    group: int
    store: str
    prefix: str
    rank: int
    world: int
    timeout_s: float = 60.0


class LeaveGroup(msgspec.Struct, frozen=True, tag="leave_group", omit_defaults=True):
    group: int


class BroadcastSlots(msgspec.Struct, frozen=True, tag="broadcast_slots", omit_defaults=True):
    """Every member's ``slots`` (its own ids, the same parameters in the same order) take rank
    ``root``'s values; members create the slots they lack with these shapes and dtypes."""

    group: int
    slots: list[int]
    shapes: list[list[int]]
    dtypes: list[str]
    root: int = 0


class ReduceGrads(msgspec.Struct, frozen=True, tag="reduce_grads", omit_defaults=True):
    """Each slot's gradient becomes the sum over the members of ``weight`` x theirs (a missing one
    counts as zeros), all-reduced in buckets of about ``bucket_bytes``. ``wait=False`` starts the
    reduction and answers at once (it runs while later requests compute); a request with
    ``wait=True`` (``slots`` may be empty) answers once every reduction of the group is done."""

    group: int
    slots: list[int]
    weight: float = 1.0
    bucket_bytes: int = 25 << 20
    wait: bool = True


REQUESTS = (OpenStore, JoinGroup, LeaveGroup, BroadcastSlots, ReduceGrads)
