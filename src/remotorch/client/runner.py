"""How a session runs a captured graph: the runner interface that captured graphs call.

A session (:class:`~remotorch.client.session.Session`) is the runner of the
graphs captured for it: plain graphs run through the connection of their
worker, sent without waiting once they ran there (:mod:`remotorch.client.launch`);
graphs that keep state on the worker (a training forward and its backward,
and every graph once parameters live in worker slots) through the session's
training client, which :mod:`remotorch.training` provides (:class:`Trainer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from .connection import Graph
from .launch import Plan, launch, launchable, nbytes
from .values import recompute_locally


class Trainer(Protocol):
    """What a session's training client offers it (see :class:`remotorch.training.client.TrainingClient`)."""

    keep_outputs: bool  # a forward's outputs Python has not read stay on the worker
    keep_min_bytes: int

    @property
    def bound(self) -> bool:
        """Some parameter lives in a worker slot: every graph of the session must use the slots."""

    def run(self, graph: Graph, args: Sequence) -> list: ...

    def owns_state_in(self, args: Sequence) -> bool:
        """Some argument stands for state on the worker (an activation handle)."""

    def refresh_local(self, tensors: Sequence) -> int: ...

    def pull(self, module: torch.nn.Module, grads: bool = False) -> int: ...

    def flush(self) -> None: ...


class GraphRunner:
    """The part of a session that captured graphs call (``remotorch.capture.graph.GraphRunner``).

    It uses the session's ``connection_for``, ``trainer``, ``_trainers``,
    ``keep_outputs``, ``keep_min_bytes`` and ``_fallbacks``.
    """

    def run_graph(self, graph: Graph, args: Sequence) -> list:
        """Run a captured graph on its worker (the first unless it names one); uploads what that
        worker lacks first; outputs Python has not read stay there.

        Once the graph ran there (waited for: upload, compile, refusals), a
        call is sent without waiting and its outputs stand here at once
        (:mod:`remotorch.client.launch`); only a read of one waits.
        """
        conn = self.connection_for(graph.worker)
        training = self._trainers.get(id(conn))
        if graph.kind != "inference" or (training is not None and training.bound):
            return self.trainer(conn).run(graph, args)
        policy = conn.policies.of(graph)
        eager = getattr(graph, "eager_outputs", None)  # an eager call's: every output stays (client.eager)
        unread = policy.keep(graph) if eager is None else eager
        keep = unread if self.keep_outputs else []
        # Python reads its outputs at once: waiting costs no round trip, and placeholders cost more
        waits = policy.ran and not graph.must_real and policy.waits()
        layout = None if waits else launchable(graph, policy, args)
        if layout is not None:  # unread outputs stay until the reply: a later call may name them at once
            echo = [i for i in unread if i not in keep or nbytes(layout[i]) < self.keep_min_bytes
                    or i in policy.read_outputs]
            outs = launch(conn, graph, args, Plan(conn, graph, layout, unread, echo=echo), fields={},
                          on_read=policy.launched())
        else:
            keep = [i for i in keep if i not in policy.read_outputs]  # (an eager call's: those not read at once)
            fields = dict(keep=keep, handle_base=conn.handles.reserve(len(keep)),
                          keep_min_bytes=self.keep_min_bytes) if keep else None
            reply, frames = conn.run(graph, args, fields=fields)
            outs = conn.unpack(graph, reply.outputs, frames)
            policy.ran = True
        if getattr(graph, "fallback", "raise") == "local":
            recompute_locally(graph, args, outs)  # kept values are remade here if their worker is lost
        return outs

    def prepare_local(self, graph: Graph, args: Sequence, reached_worker: bool) -> bool:
        """May this graph run locally instead? Brings back what it needs first.

        Once parameters live on the worker, or the arguments stand for
        activations kept there, a graph that reached the worker and failed
        must not quietly run here (the local side has placeholders and stale
        parameters). A graph the worker cannot take at all still runs here,
        after pulling the parameters an optimizer stepped on the worker.
        """
        training = self._trainers.get(id(self.connection_for(graph.worker)))
        if training is None:
            return True
        if not reached_worker:
            if training.bound:
                training.refresh_local([args[i] for i in graph.resident])
            return True
        return not (training.bound or training.owns_state_in(args))

    def note_fallback(self) -> None:
        """A graph ran locally instead (counted in ``stats()["fallbacks"]``)."""
        self._fallbacks += 1

    def attention_backends(self, worker: int | str | None, calls: list) -> list[str]:
        """The attention kernel the worker picks for each call signature (asked once per signature)."""
        return self.connection_for(worker).attention.choose(calls)

    def allowed_ops(self, graph: Graph) -> frozenset[str]:
        """Namespaces of custom operators the graph's worker allows (from its health reply, asked once)."""
        return frozenset(self.connection_for(graph.worker).info().get("allowed_ops") or ())


