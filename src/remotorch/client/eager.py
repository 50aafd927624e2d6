"""Eager torch calls on values kept on a worker: queued to that worker, as a CUDA kernel is launched.

A graph output that stays on a worker stands here as a
:class:`~remotorch.client.remote.RemoteTensor`. Outside a compiled region,
a torch call whose arguments include one (``y * 0.5 + 1``, ``y.softmax(-1)``,
``F.cross_entropy(logits, labels)``, ``ema.mul_(0.99).add_(p, alpha=0.01)``,
``y[:, 0] = 0``) is sent to that worker on its ordered stream
(:mod:`remotorch.client.stream`) without waiting, and returns placeholders
at once, whose sizes, dtype, strides and aliasing come from running the call
on fake tensors here. Only a read waits: ``item()``, ``tolist()``,
``numpy()``, ``print``, ``bool()`` (an ``if``), ``.cpu()`` / ``.to("cpu")``,
``torch.save``, ``torch.equal``. The worker runs the requests in order, so a
read costs one round trip whatever was queued before it.

Each call becomes a graph once per operator and argument layout
(:mod:`remotorch.capture.eager`, :class:`OpGraph`, kept with the connection)
and runs as any captured graph does (``RemoteGraph`` → the session's
``run_graph`` → ``Connection.run``): one path for the queue, errors (raised at
the read, naming the line that issued the call), seeded randomness, values
moved between workers, and autograd (a result that needs gradients comes from
an aot_autograd forward graph, and its backward runs on the worker).

* A pure view (``y[:, -1]``, ``y.t()``) sends nothing: it stays a view of the
  same handle (:mod:`remotorch.client.remote`).
* A call that writes into a kept value runs on the worker's value itself;
  here the value's version counter moves, as torch's does.
* A call whose result's size depends on the data (``nonzero``, ``x[mask]``,
  ``unique``) runs on the worker too, and waits for the sizes only (a few
  bytes, where the other choice, fetching the argument, moves it whole).
* A call that reads values into Python, or that fake tensors cannot run,
  fetches its arguments and runs here, as before. One refused by fake tensors
  as torch refuses it (a shape mismatch) raises torch's error at once.

``Session(eager_remote=False)`` restores fetch-on-call for every such call
(for debugging); ``stats()["eager_ops"]`` counts the calls sent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch.utils._pytree import tree_unflatten

from .prepared import prepare
from .remote import _NONE, REMOTE, RemoteTensor, Tensor, _call_plain, _lazy_view

LOCAL = "local"  # read the remote arguments and run the call here
PLAIN = "plain"  # the call touches no data (a hook, a data pointer): run it on the stand-ins as they are
VIEW = "view"  # a pure view of its one remote argument: a view of the same handle, nothing sent

# set by the package root: capture.eager.compile_op(func, leaves, shape, session, conn) (client never
# imports capture)
compile_op: Callable | None = None

# reads: fetched, then run here (a view fetches its own elements); others fake tensors refuse are found by tracing
READS = frozenset({
    Tensor.item, Tensor.tolist, Tensor.numpy, Tensor.__bool__, Tensor.__float__, Tensor.__int__,
    Tensor.__index__, Tensor.__complex__, Tensor.__array__, Tensor.__format__, Tensor.__contains__,
    Tensor.equal, torch.equal, Tensor.allclose, torch.allclose, Tensor.is_nonzero, torch.is_nonzero,
    Tensor.untyped_storage, Tensor.storage, Tensor._typed_storage, Tensor.__dlpack__, Tensor.__str__,
})
MAX_CACHED = 8192  # one-op graphs kept per connection (then the cache starts again)


class OpGraph:
    """One call's graph, for one operator and argument layout (made by ``capture.eager``).

    ``run(tensors)`` runs it (its outputs: placeholders); ``inputs`` are the
    leaves (of the call's flattened arguments) it takes; ``template``/``spec``
    rebuild the call's result from its outputs and its arguments; ``mutated``:
    the leaves it writes into.
    """

    __slots__ = ("run", "inputs", "template", "spec", "mutated", "name", "single", "prepared")

    def __init__(self, run: Callable[[list], list], inputs: list[int], template: list, spec, mutated: list[int],
                 name: str) -> None:
        self.run, self.inputs, self.template, self.spec, self.mutated, self.name = (
            run, inputs, template, spec, mutated, name)
        self.single = template[0] if spec.is_leaf() and len(template) == 1 else None
        self.prepared = None  # its run prepared on its connection (client.prepared; False: it cannot be)

    def result(self, outs: list, leaves: list):
        """The call's result: its outputs, arguments and constants where the call's result has them."""
        single = self.single
        if single is not None:
            kind, v = single
            return outs[v] if kind == "out" else leaves[self.inputs[v]] if kind == "arg" else v
        values = [outs[v] if kind == "out" else leaves[self.inputs[v]] if kind == "arg" else v
                  for kind, v in self.template]
        return tree_unflatten(values, self.spec)


# ------------------------------------------------------------------ arguments
def flatten(args: tuple, kwargs: dict) -> tuple[list, tuple]:
    """The call's arguments as leaves and a shape (hashable) that :func:`unflatten` rebuilds them from;
    only lists, tuples and dicts are containers."""
    if not kwargs and len(args) < len(_FLAT):
        for a in args:
            kind = type(a)
            if kind is list or kind is tuple or kind is dict:
                break
        else:  # (most calls: no containers, no keywords)
            return list(args), _FLAT[len(args)]
    leaves: list = []
    shape = tuple(_flat(a, leaves) for a in args)
    if kwargs:
        return leaves, (shape, tuple(kwargs), tuple(_flat(v, leaves) for v in kwargs.values()))
    return leaves, (shape, (), ())


_FLAT = [((None,) * n, (), ()) for n in range(8)]  # the shape of n arguments, none a container


def _flat(v, leaves: list):
    kind = type(v)
    if kind is list or kind is tuple:
        return (kind is list, tuple(_flat(x, leaves) for x in v))
    if kind is dict:
        return ("d", tuple(v), tuple(_flat(x, leaves) for x in v.values()))
    leaves.append(v)
    return None


def unflatten(leaves: list, shape: tuple) -> tuple[tuple, dict]:
    """``(args, kwargs)`` from :func:`flatten`'s leaves and shape."""
    it = iter(leaves)
    args = tuple(_unflat(s, it) for s in shape[0])
    return args, {k: _unflat(s, it) for k, s in zip(shape[1], shape[2])}


def _unflat(shape, it):
    if shape is None:
        return next(it)
    if shape[0] == "d":
        return {k: _unflat(s, it) for k, s in zip(shape[1], shape[2])}
    items = [_unflat(s, it) for s in shape[1]]
    return items if shape[0] else tuple(items)


def _signature(leaves: list) -> tuple[tuple | None, int]:
    """What of the leaves a graph depends on (None: a value that cannot be part of one), and how many
    of them are placeholders still remote."""
    out = []
    tensors: dict[int, int] = {}
    remote = 0
    with torch._C.DisableTorchFunctionSubclass():
        for i, a in enumerate(leaves):
            kind = type(a)
            if kind is float:
                out.append(a.hex())  # (-0.0 is not 0.0; nan is nan)
            elif kind is RemoteTensor or isinstance(a, Tensor):
                # (where it is does not matter: a local tensor travels as an input of the same graph)
                out.append((a.dtype, a.shape, a.stride(), a.requires_grad, a.device, tensors.setdefault(id(a), i)))
                remote += kind in REMOTE and "_rt_ref" in a.__dict__
            elif kind is int or kind is bool:
                out.append((kind, a))
            elif kind is slice:
                out.append((slice, a.start, a.stop, a.step))
            elif kind is complex:
                out.append((complex, repr(a)))
            elif kind in _SCALARS or a is None or a is Ellipsis:
                out.append((kind, a))
            else:
                return None, remote
    return tuple(out), remote


_SCALARS = frozenset({bool, int, str, torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size})


# ------------------------------------------------------------------ the hook
class _State(threading.local):
    busy = False  # running a call's graph: torch calls inside it (aot_autograd's runtime) run as before


_state = _State()


def on_op(func, args: tuple, kwargs: dict, pending: list):
    """``remote``'s hook for a torch call on placeholders (``pending``: those still remote): its
    result, or NotImplemented for the old path (read them, run it here)."""
    if _state.busy or torch._C._len_torch_dispatch_stack() or compile_op is None:
        return NotImplemented
    if type(pending[0]) is not RemoteTensor or (len(pending) > 1 and any(type(p) is not RemoteTensor
                                                                          for p in pending)):
        return NotImplemented  # a gradient's placeholder reads itself in any operation
    conn = pending[0].__dict__["_rt_ref"].conn
    if not getattr(conn, "eager_remote", False):
        return NotImplemented
    if func in READS or func is Tensor.cpu or (func is Tensor.to and _to_cpu(args, kwargs)):
        for p in pending:
            p.materialize_()
        return _call_plain(func, args, kwargs)
    if func is Tensor.__iter__:
        if args[0].dim() == 0:
            raise TypeError("iteration over a 0-d tensor")
        return iter(args[0].unbind(0))
    return _queued(func, args, kwargs, pending)


def _queued(func, args: tuple, kwargs: dict, pending: list):
    """The call as a view of a kept value, or sent to a worker (see the module docstring); or
    NotImplemented."""
    if not (pending[0].__dict__["_rt_ref"].handle if len(pending) == 1 else
            all(p.__dict__["_rt_ref"].handle for p in pending)):
        for p in pending:  # a value its call's reply brings (Python read it before): wait for it
            ref = p.__dict__.get("_rt_ref")
            if ref is not None and not ref.handle:
                ref.check()
        pending = [p for p in pending if "_rt_ref" in p.__dict__]
        if not pending:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
    leaves, shape = flatten(args, kwargs)
    signature, remote = _signature(leaves)
    if signature is None or remote != len(pending):  # (one inside a container other than a list, tuple, dict)
        return NotImplemented
    viewable = len(pending) == 1 and bool(args) and args[0] is pending[0]  # (a pure view: a view of its handle)
    key = (func, shape, signature, viewable, torch.is_grad_enabled(), torch.is_autocast_enabled())
    conn = _home(pending)
    cache = _cache(conn)
    entry = cache.get(key)
    if entry is VIEW or (entry is None and viewable):
        out = _lazy_view(func, pending[0], args, kwargs)  # (tried on a meta twin once per layout)
        if out is not NotImplemented:
            cache[key] = VIEW
            return out
        entry = None
    if entry is None:
        entry = _entry(conn, key, func, leaves, shape)
    if entry is not None and entry is not LOCAL and entry is not PLAIN and entry.mutated:
        owner = _owner(leaves, entry.mutated)  # a write runs where the value written into lives
        if owner is None:
            return NotImplemented
        if owner is not conn:
            conn, entry = owner, _entry(owner, key, func, leaves, shape)
    if entry is None or entry is LOCAL:
        return NotImplemented
    if entry is PLAIN:
        return _call_plain(func, args, kwargs)
    for i in entry.mutated:
        _written(leaves[i].__dict__["_rt_ref"])
    tensors = [leaves[i] for i in entry.inputs]
    prepared = entry.prepared
    outs = prepared(tensors) if prepared else None
    if outs is None:  # the long way (once prepared, only when something the prepared run skips has a say)
        _state.busy = True
        try:
            outs = entry.run(tensors)
        finally:
            _state.busy = False
        if prepared is None or (prepared and prepared.stale):
            entry.prepared = prepare(conn, entry.run, tensors)
    for i in entry.mutated:
        torch.autograd.graph.increment_version(leaves[i])
    conn.stats.eager_ops += 1
    return entry.result(outs, leaves)


def _cache(conn) -> dict:
    cache = conn.__dict__.get("eager_graphs")
    if cache is None:
        cache = conn.eager_graphs = {}
    return cache


def _entry(conn, key: tuple, func, leaves: list, shape: tuple):
    """The connection's graph for this call (made on first use), LOCAL, PLAIN, or None (no session)."""
    cache = _cache(conn)
    entry = cache.get(key)
    if entry is None:
        runner = getattr(conn, "runner", None)
        session = runner() if runner is not None else None
        if session is None:
            return None
        if len(cache) >= MAX_CACHED:
            cache.clear()
        entry = cache[key] = compile_op(func, leaves, shape, session, conn)
    return entry


def _home(pending: list):
    """The worker a call runs on: the one holding the most bytes of its remote arguments (the
    others move there worker to worker)."""
    conn = pending[0].__dict__["_rt_ref"].conn
    if len(pending) == 1:
        return conn
    held: dict[int, list] = {}
    with torch._C.DisableTorchFunctionSubclass():
        for p in pending:
            c = p.__dict__["_rt_ref"].conn
            held.setdefault(id(c), [c, 0])[1] += p.nbytes
    return max(held.values(), key=lambda e: e[1])[0]


def _owner(leaves: list, mutated: list[int]):
    """The one connection whose values a call writes into (None: a local value, or several workers')."""
    owners = set()
    for i in mutated:
        a = leaves[i]
        ref = a.__dict__.get("_rt_ref") if type(a) is RemoteTensor else None
        if ref is None:
            return None
        owners.add(ref.conn)
    return owners.pop() if len(owners) == 1 else None


def _written(ref) -> None:
    """The worker's value of ``ref`` is written into: copies of it elsewhere, a reply still bringing
    its old value, its views read before and remaking it from its graph's inputs are all stale."""
    ref.written = True
    ref.recompute = None
    for other, handle in ref.copies.values():
        other.handles.release(handle)
    ref.copies = _NONE
    root = ref.root() if ref.root is not None else None
    if root is None or "_rt_view" in root.__dict__:
        return
    with torch._C.DisableTorchFunctionSubclass():
        origin = root.storage_offset()
        for w in ref.views:
            v = w()
            if v is not None and "_rt_ref" not in v.__dict__:  # read before: it is remote again
                v._rt_ref, v._rt_base = ref, root
                v._rt_view = (list(v.shape), list(v.stride()), v.storage_offset() - origin)


def _to_cpu(args: tuple, kwargs: dict) -> bool:
    """Whether ``Tensor.to(...)`` names the CPU as its device (a read)."""
    try:
        device = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
    except (TypeError, RuntimeError):
        return False
    return device is not None and device.type == "cpu"


def install() -> None:
    """Make this module the hook of :mod:`remotorch.client.remote` (sessions call it)."""
    from . import remote

    if not remote.OP_HOOK:
        remote.OP_HOOK.append(on_op)
