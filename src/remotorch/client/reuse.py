"""Large inputs sent once per call, and outputs that need not have come back: learned per graph.

Two things a connection learns from what the program does, so that bytes on
the wire follow what Python reads:

* **inputs**: within one call of a compiled function (its graphs, split by
  graph breaks, run from that function's frame; see
  :func:`call_scope`), a large tensor a later graph
  takes again was sent already. The graph that sent it first learns to keep
  it on the worker as a handle (``keep_inputs``), and from the next call on
  the later graph references it instead of receiving it again. A tensor
  counts as the same while it is the same object with the same version
  counter; the handles are released when the next call starts.
* **outputs**: a graph sends back the outputs Python read before
  (``GraphPolicy.read_outputs``, :mod:`remotorch.client.policy`); when such an output goes straight into
  another graph, it was not needed here after all, and the graph keeps it on
  the worker again.

Only tensors of at least ``min_bytes`` take part: below that, the bookkeeping
costs more than the bytes.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Sequence

import torch

from .handles import HandleTable
from .policy import Policies
from .remote import RemoteTensor


class InputReuse:
    """What one connection sent during the current call, and which outputs it sent back."""

    def __init__(self, handles: HandleTable, policies: Policies, min_bytes: int = 64 << 10) -> None:
        self._handles = handles
        self._policies = policies
        self.min_bytes = min_bytes
        self._scope = None  # the frame of the current call (held, so its id cannot name a later call)
        # id(tensor) -> (tensor ref, version, graph policy, argument index, handle id or None)
        self._sent: dict[int, tuple] = {}
        self._sending: dict[int, tuple] = {}  # this request's additions, committed when it succeeds
        self.keep_inputs: list[list[int]] = []  # this request's [argument index, handle id] pairs
        self._returned: dict[int, tuple] = {}  # id(output) -> (output ref, graph policy, output index)
        self._free: dict[tuple, tuple[int, ...]] = {}  # (resident positions, argument count) -> the others

    def begin(self, args: Sequence, resident: frozenset[int] = frozenset()) -> bool:
        """Before a call's request: whether its large inputs take part (a new call releases the last
        one's). Arguments at ``resident`` indices (weights: sent by content id) never do."""
        key = (resident, len(args))
        free = self._free.get(key)
        if free is None:  # the non-resident positions, once per graph (a model passes many weights)
            free = self._free[key] = tuple(i for i in range(len(args)) if i not in resident)
        least = self.min_bytes
        big = any(type(a) is not RemoteTensor and isinstance(a, torch.Tensor) and a.nbytes >= least
                  for a in map(args.__getitem__, free))
        if not big and not self._sent:
            return False
        scope = call_scope()
        if scope is None:
            return False
        if scope is not self._scope:
            for entry in self._sent.values():
                if entry[4] is not None:
                    self._handles.release(entry[4])
            self._sent.clear()
            self._scope = scope
        return big

    def start_request(self) -> None:
        self._sending.clear()
        self.keep_inputs = []

    def arg(self, graph, i: int, t: torch.Tensor, reuse: bool):
        """A handle id to send instead of ``t`` (it was sent during this call), or None to send it."""
        if self._returned:
            self._came_back(t)
        if not reuse or t.nbytes < self.min_bytes:
            return None
        entry = self._sent.get(id(t))
        if entry is not None and entry[0]() is t and entry[1] == t._version:
            if entry[4] is not None:
                return entry[4]
            entry[2].reused_inputs.add(entry[3])  # sent twice in one call: kept at its first graph next time
            return None
        if id(t) in self._sending:  # the same tensor twice in one request: sent twice
            return None
        hid, policy = None, self._policies.of(graph)
        if i in policy.reused_inputs:
            hid = self._handles.reserve(1)
            self._handles.seen(hid)
            self.keep_inputs.append([i, hid])
        self._sending[id(t)] = (weakref.ref(t), t._version, policy, i, hid)
        return None

    def committed(self) -> None:
        """The request went through: what it sent counts for the rest of the call."""
        if self._sending:
            self._sent.update(self._sending)
            self._sending.clear()

    def failed(self) -> None:
        """The request failed: inputs it asked to keep may or may not be on the worker; let it drop them."""
        for entry in self._sending.values():
            if entry[4] is not None:
                self._handles.release(entry[4])
        self._sending.clear()

    def returned(self, graph, i: int, value) -> None:
        """An output sent back because Python read it before."""
        policy = self._policies.of(graph)
        if i in policy.read_outputs and isinstance(value, torch.Tensor) and value.nbytes >= self.min_bytes:
            key = id(value)
            self._returned[key] = (weakref.ref(value, lambda _, k=key, d=self._returned: d.pop(k, None)),
                                   policy, i)

    def _came_back(self, t) -> None:
        entry = self._returned.pop(id(t), None)
        if entry is not None and entry[0]() is t:
            entry[1].read_outputs.discard(entry[2])


# ------------------------------------------------------------------ one call
_SKIPPED_DIRS = tuple({os.path.dirname(torch.__file__) + os.sep,
                       os.path.dirname(os.path.dirname(__file__)) + os.sep})
_RESUME = ("torch_dynamo_resume_in_", "__resume_at_")


# (file, function) -> whether its frames are the user's (cached: frames are many). Not by code object:
# hashing one hashes its whole bytecode and constants, each time
_USER_CODE: dict = {}


def call_scope():
    """The frame of the user function whose compiled code runs the current graph.

    The graphs of one call of a compiled function (split by graph breaks)
    run from that function's frame or from dynamo's resume functions called
    from it; a new call has a new frame. Inputs sent during one call may be
    referenced by the next graphs of the same call (see ``client.reuse``).
    """
    f = sys._getframe(1)
    known = _USER_CODE.get
    while f is not None:
        code = f.f_code
        key = (code.co_filename, code.co_name)
        user = known(key)
        if user:
            return f
        if user is None:
            if _USER_CODE.setdefault(key, not code.co_filename.startswith(_SKIPPED_DIRS)
                                     and not code.co_name.startswith(_RESUME)):
                return f
        f = f.f_back
    return None
