"""Pipeline stages and data-parallel replicas that load their own part of the weights.

A :class:`~remotorch.pipeline.Pipeline` (or ``DataParallel``) given a model
built on meta and ``weights="ROOT/path"`` traces the model with stand-ins
that hold no data (:func:`traceable`), splits it, and then each worker reads
from the files on its own disk only the keys of the stages placed on it
(:func:`load_stages`): one ``OpenWeights`` and one ``LoadWeights`` per worker,
sent to all workers at once. Replica 0's stages become the model's
stand-ins; every other replica reads the same keys into its own handles and
its mirror slots take them there, so nothing goes through the controller and
no replica waits for another's broadcast.

A parameter two stages share (tied embeddings across a cut) is refused by
the splitter before anything is read, naming it.
"""

from __future__ import annotations

import torch
from torch import nn

from ..client.ids import stamp
from ..client.pool import run_all
from ..codec import messages as m
from ..codec.tensors import dtype_name
from .load import load_planned, open_weights_on, plan
from .meta import Weight, install, meta_buffers, tensors_of


def traceable(model: nn.Module) -> None:
    """Give every parameter and persistent buffer still on ``meta`` a local tensor to trace with: its
    memory is allocated, never written (so never committed), and replaced by a stand-in before any run."""
    lost = meta_buffers(model)
    if lost:
        raise ValueError(f"non-persistent buffers on meta cannot be loaded: {', '.join(lost[:5])}; build the "
                         "model under remotorch.init_empty_weights()")
    for w in tensors_of(model):
        if w.tensor.device.type != "meta":
            continue
        empty = torch.empty(w.tensor.shape, dtype=w.tensor.dtype)
        install(w, nn.Parameter(empty, requires_grad=w.tensor.requires_grad) if w.parameter else empty)


def load_stages(session, source: str, revision: str | None, model: nn.Module, split, layouts) -> dict[str, int]:
    """Each worker of each replica reads its stages' keys of ``source``; the model's tensors become
    replica 0's stand-ins and the stages take them. Returns bytes read per worker URL (or name)."""
    weights = {id(w.tensor): w for w in tensors_of(model)}
    jobs = []  # (replica, client, weights of the stages on that worker)
    for r, layout in enumerate(layouts):
        by_client: dict[int, tuple] = {}
        for runner in layout.runners:
            mine = by_client.setdefault(id(runner.client), (runner.client, {}))[1]
            for src, t in zip(runner.graphs.inputs, runner.graphs.tensors):
                if src.kind in ("param", "buffer") and id(t) in weights:
                    mine[id(t)] = weights[id(t)]
        jobs += [(r, client, list(mine.values())) for client, mine in by_client.values()]
    indexes = run_all([lambda c=client: open_weights_on(c.connection, source, revision) for _, client, _ in jobs])
    plans = [plan(ws, index, source=source, subset=True) for (_, _, ws), index in zip(jobs, indexes)]
    made: dict[int, torch.Tensor] = {}  # id(tensor traced with) -> its stand-in on replica 0's worker

    def load(job, p, index):
        r, client, _ = job
        if r == 0:
            traced = [(w, id(w.tensor)) for w, _ in p.chosen]
            load_planned(session, p, source, index.revision, conn=client.connection)  # (sets w.tensor)
            for w, old in traced:
                made[old] = w.tensor
        else:
            made_later.append((client, p, _mirror_handles(client, p, source, index.revision)))
        return sum(_nbytes(w) for w, _ in p.chosen)

    made_later: list = []
    read = run_all([lambda j=j, p=p, i=i: load(j, p, i) for j, p, i in zip(jobs, plans, indexes)])
    for stage in split.stages:
        stage.tensors = [made.get(id(t), t) if t is not None else None for t in stage.tensors]
    for layout in layouts:
        for runner in layout.runners:
            runner.params = [t for s, t in zip(runner.graphs.inputs, runner.graphs.tensors) if s.kind == "param"]
    for client, p, base in made_later:
        _bind_mirror(client, p, base)
    out: dict[str, int] = {}
    for (_, client, _), n in zip(jobs, read):
        key = client.connection.url or client.connection.name or "embedded"
        out[key] = out.get(key, 0) + n
    return out


def _nbytes(w: Weight) -> int:
    return w.tensor.numel() * w.tensor.element_size()


def _mirror_handles(client, p, source: str, revision: str) -> int:
    """Replica r > 0 reads the same parameters into handles of its own worker; the first handle id (its
    buffers stay replica 0's stand-ins, which move to it worker to worker if a graph needs them)."""
    conn = client.connection
    params = [(w, k) for w, k in p.chosen if w.parameter]
    specs = [m.TensorSpec(dtype_name(w.tensor.dtype), list(w.tensor.shape)) for w, _ in params]
    with conn.lock:
        base = conn.handles.reserve(len(params))
        if params:
            conn.request(m.LoadWeights(source, [k for _, k in params], list(range(base, base + len(params))),
                                       specs, revision), expect=m.Ok)
    return base


def _bind_mirror(client, p, base: int) -> None:
    """A replica's mirror slots take the handles its worker read (its copies of replica 0's parameters)."""
    conn = client.connection
    params = [w for w, _ in p.chosen if w.parameter]
    if not params:
        return
    for i in range(len(params)):
        conn.handles.seen(base + i)
    # mirror slots (own=False): the parameters belong to replica 0's session, as Column makes them
    slots = [client.slots.get_or_new(w.tensor, own=False) for w in params]
    with conn.lock:
        client.post(m.BindSlots([s.sid for s in slots], [m.HandleArg(base + i) for i in range(len(params))]),
                    what=f"binding {len(slots)} parameter(s) to the weights this worker read")
        for i in range(len(params)):
            conn.handles.release(base + i)  # the slots hold the tensors now (the release rides on a later request)
    for slot, w in zip(slots, params):
        slot.stamp, slot.stepped = stamp(w.tensor), False
    client.slots.bound = True
