"""An eager call's run, prepared once per graph and connection: each call fills in its handles only.

A captured graph's call goes a long way before it leaves (``RemoteGraph`` →
the runner → :func:`~remotorch.client.launch.launch` → ``Connection.run`` →
the link → the stream): the read policy, the layouts, the uploads, resident
arguments and their bindings, inputs reused within a call, the random
generator, a training client, the blocking mode and a trace each have their
say, for every call. For an eager call (:mod:`remotorch.client.eager`) whose
arguments are all values its worker keeps, none of that changes from one call
to the next: the graph is one operator for one argument layout, its outputs
all stay on the worker, its layout is fixed by the key it was made for. So
after the first call went that long way, :func:`prepare` keeps what it
decided (the request's fields, each output's layout, what comes back), and
each later call (:class:`PreparedRun`) only:

* names its arguments' handles and reserves its outputs' handles;
* makes the outputs' placeholders (as :mod:`remotorch.client.launch` does);
* queues its ``Run`` next to the eager calls before it (:mod:`remotorch.client.coalesce`),
  with the housekeeping due (handles released) once :data:`_RELEASES` of them are, or
  :data:`_RELEASE_BYTES` of values (so that the worker reuses a large value's memory while it is
  still in cache, as torch does when Python drops a tensor);

and its reply, when read, settles the placeholders (a brief reply that says
nothing) or goes through the general check (:class:`~remotorch.client.launch.Plan`).

A call takes the long way again whenever anything it skips has a say: an
argument that is local, on another worker or not made yet, a failed call
behind an argument, a graph the worker forgot, a closed or dropped
connection, a training client that binds parameters, the blocking mode, an
active trace, or a read policy that now waits or sends an output back.
"""

from __future__ import annotations

import time

import torch

from .. import errors
from ..codec import messages as m
from . import origin, trace
from .launch import Plan, launchable, nbytes
from .launched import Launched
from .placeholders import stand_in
from .policy import PROMPT_CALLS
from .remote import RemoteTensor

# here: this call <- client.eager's _queued <- on_op <- client.remote's _eager <- __torch_function__ <- the caller
_CALLER = 6
_CPU = torch.device("cpu")
_RELEASES = 16  # handles released that ride on the next call (fewer wait for the next request)...
_RELEASE_BYTES = 1 << 20  # ...or bytes of them: the worker frees large values as soon as torch would
_HandleArg, _ViewArg, _Run, _compact = m.HandleArg, m.ViewArg, m.Run, m.compact


class _Call(Launched):
    """One prepared call's record on the stream (a :class:`Launched`): its reply settles its outputs."""

    coalesce, expect, queued = True, m.RunReply, True  # (it leaves together with the eager calls next to it)
    effect = quiet = step = False

    def __init__(self, run: PreparedRun, base: int, at: tuple, on_read) -> None:
        # (its reply's handler is the method itself, not an attribute bound to it: a record that held
        # its own bound method would be a reference cycle, freed only by the collector)
        self.what, self.on_read, self.origin = run.label, on_read, at
        self.run, self.base, self.made = run, base, []

    def on_error(self, exc) -> None:
        self.run.failed(exc)

    @property
    def makes(self) -> tuple:  # (made when asked: a failure's, rarely)
        return tuple(("h", self.base + j) for j in range(self.run.n))

    def on_quiet(self, ms: float) -> None:
        """The worker said nothing of this call but its milliseconds: each output is kept, as planned."""
        stats = self.run.stats
        stats.remote_calls += 1
        stats.remote_ms += ms
        self._kept()

    def on_reply(self, reply: m.RunReply, frames: list) -> None:
        run = self.run
        run.stats.ran(reply)
        if reply.at or reply.outputs:  # values came back (small outputs): the general check
            plan = Plan(run.conn, run.graph, run.layout, run.keep, echo=run.echo, base=self.base)
            plan.adopt(dict(zip(run.tensors, self.made)))
            plan.on_reply(reply, frames)
            return
        self._kept()

    def _kept(self) -> None:
        for root in self.made:  # each output is kept, as planned: nothing to wait for any more
            ph = root()
            if ph is not None:
                ref = ph.__dict__.get("_rt_ref")
                if ref is not None:
                    ref.launched = None


class PreparedRun:
    """An eager call's ``Run`` on one connection, prepared (see the module docstring).

    ``run(tensors)`` sends a call and returns its outputs' placeholders, or
    None when the call must take the long way this time; ``stale``: the read
    policy changed since, so the next call that takes the long way prepares
    the run again.
    """

    __slots__ = ("conn", "graph", "policy", "stats", "label", "gid", "layout", "keep", "echo", "fields", "n",
                 "outs", "tensors", "read", "trainers")

    def __init__(self, conn, graph, layout: list, keep: list[int], echo: list[int], trainers: dict) -> None:
        self.conn, self.graph, self.layout, self.keep, self.echo = conn, graph, layout, keep, echo
        self.policy = conn.policies.of(graph)
        self.read = frozenset(self.policy.read_outputs)
        self.stats, self.trainers, self.label = conn.stats, trainers, graph.label
        self.gid = graph.graph_id[:m.SHORT_GRAPH_ID]
        plan = Plan(conn, graph, layout, keep, echo=echo, base=1)
        fields = dict(engine=graph.engine, keep=plan.keep, keep_min_bytes=0, echo=plan.echo, brief=True)
        if any(plan.strides()):
            fields["strides"] = plan.strides()
        self.fields, self.n = fields, len(plan.keep)
        self.tensors = [i for i in range(len(layout)) if i in plan.ids]  # the outputs made placeholders
        # each output: (True, its handle's offset, sizes, strides, dtype, device), or (False, its value)
        self.outs = [(True, plan.ids[i] - 1, tuple(spec.shape), tuple(spec.strides), spec.dtype,
                      device if device is not None else _CPU) if i in plan.ids else (False, spec)
                     for i, (spec, device) in enumerate(zip(layout, graph.output_devices))]

    @property
    def stale(self) -> bool:
        return self.policy.read_outputs != self.read

    def __call__(self, tensors: list) -> list | None:
        conn, policy = self.conn, self.policy
        link = conn.link
        stream = link.stream
        if (stream.blocking or trace.ACTIVE or not policy.ran or policy.prompt >= PROMPT_CALLS
                or policy.read_outputs != self.read or not link.connected
                or self.graph.graph_id not in conn.uploads.graphs):
            return None
        trainer = self.trainers.get(id(conn)) if self.trainers else None
        if trainer is not None and trainer.bound:
            return None
        args = []
        for t in tensors:
            ref = t.__dict__.get("_rt_ref") if type(t) is RemoteTensor else None
            if ref is None or ref.conn is not conn or not ref.handle:
                return None  # local, on another worker, or a value a reply brings: the long way
            launched = ref.launched
            if launched is not None and launched.error is not None:
                return None  # the long way raises it, naming the call that failed
            view = t.__dict__.get("_rt_view")
            args.append(_HandleArg(ref.handle) if view is None else _ViewArg(ref.handle, *view))
        at = origin.here(_CALLER)
        with conn.lock:
            handles = conn.handles
            base = handles.reserve(self.n) if self.n else 0
            call = _Call(self, base, at, policy.launched())
            made, outs = call.made, []
            for i, out in enumerate(self.outs):
                if not out[0]:
                    outs.append(out[1])
                    continue
                hid = base + out[1]
                handles.seen(hid)
                ph = stand_in(conn, hid, out[2], out[3], out[4], out[5], policy, i, call)
                made.append(ph._rt_ref.root)
                outs.append(ph)
            # housekeeping rides on this call when enough is due: each handle released before it is one no
            # call from this one on names (a call queued earlier that does is before it, in order)
            pending = (conn.take_pending() if handles.releasing >= _RELEASES or conn.uploads.released
                       or handles.releasing_bytes >= _RELEASE_BYTES or conn.pending_hooks else None)
            stream.queue(_Run(self.gid, args=_compact(args) if len(args) > 2 else args, handle_base=base,
                              **self.fields), (), call, pending)
            link.last_request = time.monotonic()
        return outs

    def failed(self, exc) -> None:
        """The call failed on the worker (raised at its read); objects the worker forgot are uploaded
        again by the next call, which waits for its reply (the long way)."""
        if isinstance(exc, errors.MissingObjectsError):
            self.conn.uploads.forget(exc)
            self.policy.ran = False


def prepare(conn, graph, tensors: list) -> PreparedRun | bool:
    """The prepared run of an eager call's graph on ``conn`` (after a call of it took the long way),
    or False when its calls must always take the long way: a graph that is not one inference graph
    (aot_autograd's pair, a random one, one with custom operators or CUDA graphs), or a layout not
    known before the run.

    As the long way does for an eager call (``GraphRunner.run_graph``), every output stays on the
    worker; those Python read before, small ones (under ``keep_min_bytes``) and, with
    ``keep_outputs=False``, all of them also come back in the reply.
    """
    if (getattr(graph, "kind", None) != "inference" or not getattr(graph, "eager_op", False) or graph.random
            or graph.payload.custom_ops or graph.cuda_graphs or graph.fetch_first or graph.resident
            or graph.fallback != "raise"):
        return False
    runner = graph._runner()
    policy = conn.policies.of(graph)
    layout = launchable(graph, policy, tensors)
    if layout is None:
        return False
    keep = graph.eager_outputs
    echo = [i for i in keep if not runner.keep_outputs or nbytes(layout[i]) < runner.keep_min_bytes
            or i in policy.read_outputs]
    return PreparedRun(conn, graph, layout, keep, echo, runner._trainers)
