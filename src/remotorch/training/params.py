"""Which local parameters live in worker-side slots, and whether the local copy moved.

Every trainable parameter a training forward uses gets a slot, so weights
are not uploaded again each step. Its gradients stay on the worker only
while a worker-side optimizer (:class:`remotorch.optim.RemoteOptimizer`)
manages the slot; otherwise they come back to ``p.grad`` as in plain
PyTorch, so a local optimizer keeps working (and its in-place updates are
uploaded before the next call, as below).

Once a trainable parameter is in a slot, the worker's value is the truth: the
optimizer updates it there and the local tensor goes stale without its
version counter moving. So a slot records the local value's stamp
(:func:`remotorch.client.ids.stamp`: the version counter and the data's
address) at the last moment both sides were known equal (bind or pull).
While the stamp stays, calls reference the slot and nothing is uploaded;
when it moved, the user changed the tensor here (in place, by a local
optimizer, or by swapping ``p.data``), and the next call binds the slot to
the new local value (that local change wins, as it would in plain PyTorch).
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass, field

import torch

from ..client.ids import stamp

_OWNER_ATTR = "_remotorch_owner"
_WAITING_ATTR = "_remotorch_waiting_optimizers"


@dataclass
class Slot:
    ref: weakref.ref
    sid: int
    stamp: tuple[int, int] | None  # the local stamp when local and worker were last equal; None before the first bind
    # worker-side optimizers over this slot: while there is one, gradients stay on the worker
    optims: set[int] = field(default_factory=set)
    stepped: bool = False  # an optimizer changed the worker's value since the local copy was equal


class ParamSlots:
    """Slots of one worker-side session (a training client), by local tensor identity."""

    def __init__(self, owner: object) -> None:
        self._owner = weakref.ref(owner)
        self._by_tensor: dict[int, Slot] = {}
        self._next = 1
        self._dropped: deque[int] = deque()
        self.bound = False  # some slot was bound on the worker: it holds parameters of record

    def __len__(self) -> int:
        return len(self._by_tensor)

    def lookup(self, t: torch.Tensor) -> Slot | None:
        """The slot of exactly this tensor object, if it has one."""
        slot = self._by_tensor.get(id(t))
        return slot if slot is not None and slot.ref() is t else None

    def items(self) -> list[tuple[torch.Tensor, Slot]]:
        """(local tensor, slot) of every slot whose tensor is alive."""
        return [(t, slot) for slot in list(self._by_tensor.values()) if (t := slot.ref()) is not None]

    def get_or_new(self, t: torch.Tensor, own: bool = True) -> Slot:
        """The tensor's slot, creating an unbound one (no stamp) if needed; ``own``: record this
        client as the tensor's owner (a replica's mirror slot does not)."""
        slot = self.lookup(t)
        if slot is None:
            key, sid = id(t), self._next
            self._next += 1
            slot = Slot(weakref.ref(t, lambda _, k=key, s=sid: self._dead(k, s)), sid, None)
            self._by_tensor[key] = slot
            if own:
                setattr(t, _OWNER_ATTR, self._owner)
        return slot

    def _dead(self, key: int, sid: int) -> None:
        slot = self._by_tensor.get(key)
        if slot is not None and slot.sid == sid:
            del self._by_tensor[key]
        self._dropped.append(sid)

    def forget_optim(self, oid: int) -> None:
        """An optimizer is gone: its slots' gradients come back to the client again."""
        for slot in self._by_tensor.values():
            slot.optims.discard(oid)

    def stale(self, slot: Slot, t: torch.Tensor) -> bool:
        """True when the worker's slot does not hold this tensor's local value of record."""
        return slot.stamp != stamp(t)

    def take_dropped(self) -> list[int]:
        """Slot ids whose local tensor died since the last call."""
        out = []
        while self._dropped:
            out.append(self._dropped.popleft())
        return out


def owner_of(t: torch.Tensor):
    """The training client whose slots claim (or claimed) this tensor, or None."""
    ref = getattr(t, _OWNER_ATTR, None)
    return ref() if ref is not None else None


def owner_of_live(t: torch.Tensor):
    """The training client that holds this tensor in a slot now (its session open), or None."""
    owner = owner_of(t)
    if owner is None or owner.closed or owner.slots.lookup(t) is None:
        return None
    return owner


def wait_for_binding(t: torch.Tensor, optimizer) -> None:
    """Remember that ``optimizer`` binds to whichever session first puts ``t`` in a slot."""
    waiting = getattr(t, _WAITING_ATTR, None)
    if waiting is None:
        waiting = weakref.WeakSet()
        setattr(t, _WAITING_ATTR, waiting)
    waiting.add(optimizer)


def waiting_optimizers(t: torch.Tensor) -> list:
    """Optimizers over ``t`` still waiting for a session (see :func:`wait_for_binding`); taken off it."""
    waiting = getattr(t, _WAITING_ATTR, None)
    if not waiting:
        return []
    out = list(waiting)
    waiting.clear()
    return out
