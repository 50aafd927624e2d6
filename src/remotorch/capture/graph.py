"""The callable that stands in for one captured aten graph: runs it remotely, or locally.

aot_autograd calls it with the flat argument list (boxed convention). It
asks its session to run the graph; on a remote failure it follows its
fallback policy: ``"local"`` runs the same aten graph here (one warning per
graph, counted in ``stats()["fallbacks"]``), ``"raise"`` lets the typed
``RemoteError`` through.

Training graphs (a forward whose saved tensors stay on the worker, its
backward) and every graph of a session that holds parameters in worker slots
run through :mod:`remotorch.train_client`. Those never fall back: the local
side has placeholders, not activations, and stale parameters.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable

import torch

from ..codec.graph import GraphPayload
from ..errors import RemoteError, RemoteFallbackWarning
from ..training.handles import handle_of
from ..training.client import has_slots, keeps_state, training_client

log = logging.getLogger(__name__)

FALLBACKS = ("local", "raise")


class RemoteGraph:
    """One uploaded-once graph, its resident arguments, and its fallback."""

    def __init__(self, payload: GraphPayload | None, *, session_getter: Callable, engine: str,
                 fallback: str, resident: list[int], output_devices: list, local: Callable,
                 unsupported: RemoteError | None = None, kind: str = "inference",
                 saved_from: int | None = None) -> None:
        # Instance attribute, not class: dynamo wraps backward graphs with
        # functools.wraps, which copies __dict__ and so keeps the boxed convention.
        self._boxed_call = True
        self.payload = payload
        self.graph_id = payload.graph_id if payload else ""
        self.engine = engine
        self.fallback = fallback
        self.resident = resident
        self.resident_set = frozenset(resident)
        self.output_devices = output_devices
        self._session_getter = session_getter
        self._local = local
        self._unsupported = unsupported
        self._warned = False
        self.kind = kind  # "inference", "forward" (of a training pair) or "backward"
        # forward: outputs from this index on are saved for backward (they stay on the worker)
        self.saved_from = saved_from

    def __call__(self, *args) -> list:
        # Boxed (one list) or unboxed (aot wraps backward graphs): graph
        # arguments are never lists themselves, so the two cannot be confused.
        if len(args) == 1 and isinstance(args[0], list):
            args = args[0]
        session = self._session_getter()
        if self._unsupported is not None:
            if has_slots(session):  # runs here: with the worker's current parameters
                training_client(session).refresh_local([args[i] for i in self.resident])
            return self._fall_back(session, args, self._unsupported)
        if (self.kind != "inference" or has_slots(session)) and keeps_state(session):
            try:
                return training_client(session).run(self, args)
            except RemoteError as exc:
                if has_slots(session) or any(handle_of(a) is not None for a in args):
                    raise
                return self._fall_back(session, args, exc)
        try:
            return session.run_graph(self, args)
        except RemoteError as exc:
            return self._fall_back(session, args, exc)

    def _fall_back(self, session, args: list, exc: RemoteError) -> list:
        if self.fallback == "raise":
            raise exc
        session.note_fallback()
        if not self._warned:
            self._warned = True
            short = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            warnings.warn(f"remotorch: graph {self.graph_id[:12] or '(not encodable)'} runs locally "
                          f"({type(exc).__name__}: {short})", RemoteFallbackWarning, stacklevel=3)
        log.debug("local fallback for graph %s", self.graph_id[:12], exc_info=exc)
        return list(self._local(*args))


def output_devices(gm: torch.fx.GraphModule) -> list:
    """The device each output is expected on (None for non-tensor outputs)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    values = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    devices = []
    for v in values:
        val = v.meta.get("val") if isinstance(v, torch.fx.Node) else None
        devices.append(val.device if isinstance(val, torch.Tensor) else None)
    return devices
