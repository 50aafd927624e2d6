"""The one interpreter: runs any valid schedule on the stages' workers, one thread per worker.

Each worker's thread first tells its worker which transfers it will receive
during the step (the activations its stages take, the gradients of the
outputs they give), under tickets the client chose itself, then sends that
worker's actions in the schedule's order, none waiting for its reply: the
worker runs them in that order, and a run that takes a handle another worker
is still to deliver waits for it there (protocol.md §18.3). No send or
receive is written anywhere: a producer's request carries "deliver output k
to that worker under this ticket", derived from the split's edges, so the
order of transfers is the order of the schedule and cannot disagree with it
(the deadlocks of hand-ordered sends and receives cannot happen).

So a step costs one round trip, not one per action: once every action is
sent, each thread reads its worker's replies as they come (the timeline's
ends, the losses), and the step returns when all are in. A failure on any
worker is raised from :meth:`StepRun.run`; the workers' state for that step
(partial gradients) is then undefined: reload a checkpoint.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import errors
from ..codec import messages as m
from ..codec.tensors import contiguous_strides, dtype_name
from .stage import Delivery, MicrobatchHandles, StageRunner

TICKET_TTL_S = 3600.0  # tickets of a step wait at most this long (the worker may cap it)


class StepAborted(Exception):
    """Another worker's thread failed: this one stops (the other failure is raised)."""


@dataclass(frozen=True)
class Edge:
    """Output ``output`` of stage ``src`` is input ``position`` of stage ``dst``."""

    src: int
    output: int
    dst: int
    position: int


@dataclass
class StageLayout:
    """What does not change between steps: stages, where they run, and the edges between them."""

    runners: list[StageRunner]
    placement: tuple[int, ...]  # stage -> worker index
    urls: list[str]  # worker index -> URL other workers reach it at
    edges: list[Edge] = field(default_factory=list)

    def __post_init__(self) -> None:
        for r in self.runners:
            for pos, src in enumerate(r.graphs.inputs):
                if src.kind == "stage":
                    self.edges.append(Edge(src.stage, src.index, r.index, pos))

    def remote(self, e: Edge) -> bool:
        return self.placement[e.src] != self.placement[e.dst]

    def grad_flows(self, e: Edge) -> bool:
        """The backward of ``dst`` gives a gradient that the backward of ``src`` takes."""
        return e.output in self.runners[e.src].graphs.tangent_of and self.runners[e.dst].has_grad(e.position)


class StepRun:
    """One ``pipe.step``: microbatches through the schedule on every worker."""

    def __init__(self, layout: StageLayout, schedule, leaves: list[list], targets: list[list],
                 loss_scale: float = 1.0, grads_done: Callable[[int], None] | None = None) -> None:
        self.layout = layout
        # called (on the stage's worker thread) once a stage's last backward of the step ran: its
        # parameters' gradients are final (replicas start averaging them while earlier stages compute)
        self.grads_done = grads_done
        self._backwards: dict[int, int] = defaultdict(int)
        self.loss_scale = loss_scale  # the gradient seeds are loss_scale / microbatches (replicas: 1/R)
        self.schedule = schedule
        self.leaves, self.targets = leaves, targets
        self.n = len(leaves)
        self.mbs = [[MicrobatchHandles() for _ in range(self.n)] for _ in layout.runners]
        self.done: dict[tuple, threading.Event] = defaultdict(threading.Event)
        self.tickets: dict[tuple, tuple[threading.Event, list]] = defaultdict(lambda: (threading.Event(), []))
        self.losses: list[torch.Tensor | None] = [None] * self.n
        self._lock = threading.Lock()
        self.failure: BaseException | None = None
        self.scale = None
        self.timeline: list[tuple[int, object, float, float]] = []  # (worker, action, start, end), seconds

    # -------------------------------------------------------------- tickets
    def _incoming(self, worker: int) -> dict[tuple, list[Edge]]:
        """Transfers this worker receives per microbatch, grouped one ticket each:
        ("F", src, dst) activations, ("B", dst, src) gradients."""
        groups: dict[tuple, list[Edge]] = defaultdict(list)
        for e in self.layout.edges:
            if not self.layout.remote(e):
                continue
            if self.layout.placement[e.dst] == worker:
                groups[("F", e.src, e.dst)].append(e)
            if self.layout.placement[e.src] == worker and self.layout.grad_flows(e):
                groups[("B", e.dst, e.src)].append(e)
        return groups

    def _issue_tickets(self, worker: int) -> None:
        """Tell this worker what it will receive, under tickets chosen here (no reply awaited)."""
        for (kind, frm, to), edges in self._incoming(worker).items():
            runner = self.layout.runners[to]
            for mb in range(self.n):
                metas, hids = [], []
                for e in edges:
                    src = self.layout.runners[e.src].graphs
                    dtype, shape, _ = src.output_meta[e.output]
                    metas.append(m.TensorMeta(dtype_name(dtype), list(shape), contiguous_strides(shape), 0))
                    hids.append(runner.client.handles.reserve(1))
                ticket = m.TicketReply(os.urandom(16), os.urandom(32), TICKET_TTL_S)
                runner.client.post(m.ExpectHandles(hids, metas, ttl_s=TICKET_TTL_S, ticket_id=ticket.ticket_id,
                                                   secret=ticket.secret),
                                   what=f"expecting stage {frm}'s {'activations' if kind == 'F' else 'gradients'}",
                                   expect=m.TicketReply)
                slot = self.mbs[to][mb]
                for e, hid in zip(edges, hids):
                    runner.client.handles.seen(hid)
                    if kind == "F":
                        slot.inputs[e.position] = hid
                    else:
                        slot.tangents[e.output] = hid
                event, box = self.tickets[(kind, frm, to, mb)]
                box.append(ticket)
                event.set()

    def _deliveries(self, kind: str, stage: int, mb: int) -> list[Delivery]:
        """What an action sends to other workers: one delivery per receiving stage, with its ticket."""
        out: dict[int, list[Edge]] = defaultdict(list)
        for e in self.layout.edges:
            if not self.layout.remote(e):
                continue
            if kind == "F" and e.src == stage:
                out[e.dst].append(e)
            elif kind == "B" and e.dst == stage and self.layout.grad_flows(e):
                out[e.src].append(e)
        deliveries = []
        for other, edges in sorted(out.items()):
            event, box = self.tickets[(kind, stage, other, mb)]
            self._wait(event)
            outputs = [e.output if kind == "F" else e.position for e in edges]
            deliveries.append(Delivery(outputs, self.layout.urls[self.layout.placement[other]], box[0]))
        return deliveries

    # -------------------------------------------------------------- actions
    def _wait(self, event: threading.Event) -> None:
        while not event.wait(0.05):
            if self.failure is not None:
                raise StepAborted()
        if self.failure is not None:
            raise StepAborted()

    def _forward(self, stage: int, mb: int, ran: Callable[[float], None]) -> None:
        layout = self.layout
        runner = layout.runners[stage]
        for src in sorted({s.stage for s in runner.graphs.inputs if s.kind == "stage"}):
            self._wait(self.done[("F", src, mb)])
        sends = self._deliveries("F", stage, mb)
        local = [e for e in layout.edges if e.src == stage and not layout.remote(e)]
        t0 = time.perf_counter()

        def answered(loss) -> None:
            if loss is not None:
                self.losses[mb] = loss
            ran(t0)

        kept = runner.forward(self.mbs[stage][mb], self.leaves[mb], self.targets[mb], sends,
                              sorted({e.output for e in local}), answered)
        for e in local:
            self.mbs[e.dst][mb].inputs[e.position] = kept[e.output]
        self.done[("F", stage, mb)].set()

    def _backward(self, stage: int, mb: int, ran: Callable[[float], None]) -> None:
        layout = self.layout
        runner = layout.runners[stage]
        self._wait(self.done[("F", stage, mb)])
        for dst in sorted({e.dst for e in layout.edges if e.src == stage and layout.grad_flows(e)}):
            self._wait(self.done[("B", dst, mb)])
        sends = self._deliveries("B", stage, mb)
        local = [e for e in layout.edges if e.dst == stage and not layout.remote(e) and layout.grad_flows(e)]
        last = not runner.graphs.consumers
        t0 = time.perf_counter()
        kept = runner.backward(self.mbs[stage][mb], self.scale if last else None, sends,
                               sorted({e.position for e in local}), lambda _: ran(t0))
        for e in local:
            self.mbs[e.src][mb].tangents[e.output] = kept[e.position]
        self._backwards[stage] += 1  # only this stage's worker thread counts it
        if self.grads_done is not None and self._backwards[stage] == self.n:
            self.grads_done(stage)  # (sent after this backward, on the same worker: runs after it)
        self.done[("B", stage, mb)].set()

    def _worker(self, worker: int, actions) -> None:
        try:
            self._issue_tickets(worker)
            for a in actions:
                if a.kind not in ("F", "B"):
                    raise errors.InvalidRequestError(f"the pipeline runs F and B actions, not {a}")
                run = self._forward if a.kind == "F" else self._backward
                run(a.stage, a.microbatch, lambda t0, a=a: self.timeline.append(
                    (worker, a, t0, time.perf_counter())))
            conns = {id(self.layout.runners[a.stage].conn): self.layout.runners[a.stage].conn for a in actions}
            for conn in conns.values():
                conn.flush(wait=False)  # released handles go now, not with the next step
                conn.link.settle()  # every reply of the step: the timeline's ends, the losses, failures
        except StepAborted:
            pass
        except BaseException as exc:
            with self._lock:
                if self.failure is None:
                    self.failure = exc

    def run(self) -> torch.Tensor:
        """Run every worker's actions; the mean of the microbatches' losses."""
        loss_meta = self.layout.runners[-1].graphs.output_meta[0]
        self.scale = torch.tensor(self.loss_scale / self.n, dtype=loss_meta[0])
        threads = []
        self.started = time.perf_counter()
        for w, actions in enumerate(self.schedule.order):
            t = threading.Thread(target=self._worker, args=(w, actions), name=f"remotorch-pipe-{w}",
                                 daemon=True)
            threads.append(t)
            t.start()
        for t in threads:
            t.join()
        self.ended = time.perf_counter()
        if self.failure is not None:
            for runner in self.layout.runners:  # the step's failure, raised once for every worker's
                try:
                    runner.conn.link.settle()
                except Exception:  # noqa: BLE001 - the first failure is the one raised
                    pass
                runner.conn.link.stream.absorb()
            raise self.failure
        if any(loss is None for loss in self.losses):
            raise errors.ProtocolError("a microbatch's loss never came back")
        return torch.stack([loss.detach().reshape(()) for loss in self.losses]).mean()
