"""One pipeline stage on its worker: its graphs uploaded once, and the requests of its forward and backward.

A stage's forward (``RunResident``) takes its parameters as slots of the
worker's training state, buffers by content id, the microbatch's leaves
inline and activations of earlier stages as handles already delivered to
this worker; it keeps what backward needs as handles, and delivers each
output to the stages that take it (``send``: worker to worker under their
tickets) or keeps it here when the taker is on the same worker. The
backward takes the saved handles and the output gradients, accumulates
parameter gradients into the slots (``grads``) and delivers the input
gradients to the stages that produced those inputs. Only the last stage's
loss comes back to the client.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import errors
from ..capture.graph import output_devices
from ..codec import messages as m
from ..codec.frames import FrameReader, FrameWriter
from ..codec.graph import GraphPayload, encode_graph
from ..training.client import TrainingClient
from .split import PipelineSplitError, StageGraphs


@dataclass(eq=False)
class _Graph:
    """The little a connection needs of a graph to upload it (``Connection.ensure_graph``)."""

    payload: GraphPayload
    engine: str

    @property
    def graph_id(self) -> str:
        return self.payload.graph_id


def _payload(gm: torch.fx.GraphModule, what: str) -> GraphPayload:
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    try:
        with unset_fake_temporarily():
            return encode_graph(gm)
    except errors.UnsupportedGraphError as exc:
        raise PipelineSplitError(f"{what} cannot run remotely: {exc}") from exc


@dataclass
class Delivery:
    """Tensors one action sends to one other worker: which outputs, and the ticket to present."""

    outputs: list[int]
    url: str = ""
    ticket: m.TicketReply | None = None


@dataclass
class Microbatch:
    """Handles of one microbatch on one stage's worker (ids in that worker's session)."""

    inputs: dict[int, int] = field(default_factory=dict)  # stage input position -> handle id
    tangents: dict[int, int] = field(default_factory=dict)  # output index -> handle id of its gradient
    saved: list[int] = field(default_factory=list)


class StageRunner:
    """Requests of one stage: ``forward`` and ``backward`` of a microbatch, on its worker."""

    def __init__(self, graphs: StageGraphs, client: TrainingClient, engine: str = "eager") -> None:
        self.graphs = graphs
        self.client = client
        self.conn = client.connection
        self.forward_graph = _Graph(_payload(graphs.forward, f"stage {graphs.index} forward"), engine)
        self.backward_graph = _Graph(_payload(graphs.backward, f"stage {graphs.index} backward"), engine)
        self.grad_devices = output_devices(graphs.backward)
        if len(self.grad_devices) != len(graphs.inputs):
            raise PipelineSplitError(f"stage {graphs.index}: its backward does not give one gradient per input")
        self.params = [t for s, t in zip(graphs.inputs, graphs.tensors) if s.kind == "param"]

    @property
    def index(self) -> int:
        return self.graphs.index

    def has_grad(self, position: int) -> bool:
        """Whether the backward computes a gradient for input ``position``."""
        return self.grad_devices[position] is not None

    def bind(self) -> None:
        """Put the stage's parameters in worker slots (uploading those changed here since)."""
        with self.conn.lock:
            self.client.bind_stale(self.params)

    # ------------------------------------------------------------------ forward
    def forward(self, mb: Microbatch, leaves: list, targets: list, sends: list[Delivery],
                keep: list[int]) -> tuple[torch.Tensor | None, dict[int, int]]:
        """Run the forward of one microbatch: (the loss on the last stage else None, output -> handle
        id of the outputs in ``keep``, kept on this worker for a stage here)."""
        g, conn = self.graphs, self.conn
        w, args = FrameWriter(), []
        buffers = [t for s, t in zip(g.inputs, g.tensors) if s.kind == "buffer"]
        with conn.lock:
            refs = iter(conn.refs(buffers)) if buffers else iter(())
            for pos, src in enumerate(g.inputs):
                if src.kind == "param":
                    args.append(m.SlotArg(self.client.slots.lookup(g.tensors[pos]).sid))
                elif src.kind == "buffer":
                    args.append(m.RefArg(next(refs)))
                elif src.kind == "input":
                    args.append(w.value(leaves[src.index]))
                elif src.kind == "target":
                    args.append(w.value(targets[src.index]))
                else:
                    args.append(m.HandleArg(mb.inputs[pos]))
            base = self.client.handles.reserve(g.n_saved + len(keep))
            req = m.RunResident(self.forward_graph.graph_id, self.forward_graph.engine, args,
                                keep_from=g.n_outputs, handle_base=base, keep=keep, keep_min_bytes=0,
                                send=[_send(d) for d in sends])
        outs, frames, kept = self._run(self.forward_graph, req, w.frames, g.n_outputs + g.n_saved, sends)
        mb.saved = [base + i for i in range(g.n_saved)]
        for hid in mb.saved:
            self.client.handles.seen(hid)
        for pos in [p for p, s in enumerate(g.inputs) if s.kind == "stage"]:
            self.client.handles.release(mb.inputs[pos])  # the forward saved what it needs of them
        loss = None
        if not g.consumers:  # the last stage: its one output is the loss
            loss = FrameReader(frames).value(outs[0])
        return loss, kept

    # ----------------------------------------------------------------- backward
    def backward(self, mb: Microbatch, scale: torch.Tensor | None, sends: list[Delivery],
                 keep: list[int]) -> dict[int, int]:
        """Run the backward of one microbatch; returns input position -> handle id of gradients kept here."""
        g, conn = self.graphs, self.conn
        w, args = FrameWriter(), [m.HandleArg(h) for h in mb.saved]
        for k in g.tangent_of:
            if k in mb.tangents:
                args.append(m.HandleArg(mb.tangents[k]))
            elif scale is not None:  # the loss: d(total)/d(loss of this microbatch)
                args.append(w.value(scale))
            else:  # taken only where no gradient flows
                dtype, shape, _ = g.output_meta[k]
                args.append(w.value(torch.zeros(shape, dtype=dtype)))
        with conn.lock:
            grads = [[pos, self.client.slots.lookup(g.tensors[pos]).sid] for pos in g.params
                     if self.has_grad(pos)]
            base = self.client.handles.reserve(len(keep)) if keep else 0
            req = m.RunResident(self.backward_graph.graph_id, self.backward_graph.engine, args,
                                handle_base=base, grads=grads, keep=keep, keep_min_bytes=0,
                                send=[_send(d) for d in sends])
        _, _, kept = self._run(self.backward_graph, req, w.frames, len(g.inputs), sends)
        for hid in (*mb.saved, *mb.tangents.values()):
            self.client.handles.release(hid)
        mb.saved, mb.tangents = [], {}
        return kept

    def _run(self, graph: _Graph, req: m.RunResident, frames: list, n_outputs: int,
             sends: list[Delivery]) -> tuple[list, list, dict[int, int]]:
        """Send one stage request: (its outputs, their frames, output -> handle id of those it kept)."""
        conn = self.conn
        with conn.lock:
            reply, out_frames = conn.call(lambda: (req, frames), graph)
            conn.stats["remote_calls"] += 1
            conn.stats["remote_ms"] += getattr(reply, "run_ms", 0.0)
            conn.stats["values_moved"] += sum(len(d.outputs) for d in sends)
        if not isinstance(reply, m.ResidentReply) or len(reply.outputs) != n_outputs:
            raise errors.ProtocolError("worker answered a pipeline stage with the wrong reply")
        kept = {}
        for k in req.keep:
            out = reply.outputs[k]
            if not isinstance(out, m.KeptArg):
                raise errors.LimitExceededError("the worker could not keep a stage's activation or gradient "
                                                "(over the session's memory quota)")
            self.client.handles.seen(out.id)
            kept[k] = out.id
        return reply.outputs, out_frames, kept


def _send(d: Delivery) -> m.SendOutputs:
    return m.SendOutputs(d.outputs, d.url, d.ticket.ticket_id, d.ticket.secret)
