"""Tensors whose data stays on a worker until Python reads them.

A graph output the client does not need is kept on the worker as a handle
and stands here as a :class:`RemoteTensor`: an ordinary ``torch.Tensor``
subclass with the right shape, dtype, device, strides and ``requires_grad``,
whose local buffer is allocated but never written (on the CPU that is
virtual memory only). It overrides only ``__torch_function__``, so TorchDynamo
treats it as a plain tensor (it guards on its metadata and passes it to the
next compiled graph as is) and the graph's callable receives the object
itself, reads its handle and sends a reference instead of bytes.

Outside a compiled graph every torch API call on it goes through
``__torch_function__``: metadata queries (``shape``, ``size()``, ``dtype``…)
answer from the local metadata; pure views (``x[:, -1]``, ``x.t()``) stay
remote as views of the same handle; anything that reads data (an eager op,
``item()``, ``print``, ``numpy()``, ``tolist()``, ``torch.save``, a
comparison in an ``if``) fetches the tensor (a view only its own elements)
once into the local buffer, and from then on it is an ordinary tensor that
keeps this class (so dynamo's type guards stay stable). A read that cannot
fetch (the worker died, the session expired) raises a ``RemoteError``; it
never returns the unwritten buffer.

With ``fallback="local"``, a read that cannot fetch because the worker is
gone (it died, or forgot the session) runs the graph that produced the value
here instead, from its inputs, if they are all still alive and unchanged
(their version counters say so); otherwise it raises. Never the unwritten
buffer, never a value computed from changed inputs.

The handle is released on the worker when the last placeholder using it
dies (the release rides on the next request of its connection). What happens
to the values of a session that ends, and how placeholders travel in
requests, is in :mod:`remotorch.client.values`.
"""

from __future__ import annotations

import logging
import types
import weakref
from typing import Protocol

import torch
from torch.utils._pytree import tree_leaves, tree_map

from .. import errors
from ..codec import messages as m
from .writes import write as _write

Tensor = torch.Tensor
_dynamo_callback = torch._C._dynamo.eval_frame.get_eval_frame_callback  # None: no compiled frame is running
log = logging.getLogger(__name__)


class Connection(Protocol):
    """What a placeholder needs of the connection to its worker (``client.connection.Connection``)."""

    handles: object  # a HandleTable: released handles are queued there, live values tracked

    def fetch(self, arg: m.HandleArg | m.ViewArg) -> torch.Tensor: ...

    def fetch_many(self, args: list) -> list[torch.Tensor]: ...

    def settle(self, until=None) -> None: ...


_NONE = types.MappingProxyType({})  # (no copies: a mapping nothing writes into)


class RemoteRef:
    """One worker handle, owned by the placeholders (and views) that stand for it.

    ``handle`` 0: no handle; the value comes back in the reply of the call
    that makes it (``launched``), which fills the placeholder when it is read.
    """

    __slots__ = ("handle", "conn", "policy", "index", "copies", "launched", "recompute", "root", "views",
                 "written", "stays", "nbytes", "__weakref__")

    def __init__(self, handle: int, conn: Connection, policy=None, index: int = -1, launched=None) -> None:
        self.handle = handle
        self.conn = conn
        self.launched = launched  # the asynchronous call that makes it, until its reply was read
        self.policy = policy  # the client.policy.GraphPolicy of the graph that made it (learns what is read)
        self.index = index
        # id(connection) -> (connection, handle of a copy moved there); the shared empty one until then
        # (each object a placeholder holds costs Python's collector while thousands of eager calls fly)
        self.copies: dict[int, tuple] = _NONE
        self.recompute = None  # a values.Recompute: how to make the value here if its worker is gone
        self.root: weakref.ref | None = None  # the placeholder of the whole value (its views hold it)
        self.views: list[weakref.ref] | tuple = ()  # lazy views of it (they share its local buffer)
        self.written = False  # an eager call wrote into the worker's value (a reply's copy of it is stale)
        self.stays = False  # its home is the worker (weights it loaded): not fetched when the session ends
        self.nbytes = 0  # the value's size, when known (its release rides on the next call sooner when large)

    def __del__(self) -> None:
        # runs in garbage collection, on any thread: only queue appends
        try:
            if self.handle:
                self.conn.handles.release(self.handle, self.nbytes)
            for other, handle in self.copies.values():
                other.handles.release(handle)
        except Exception:  # interpreter shutdown
            pass

    def check(self) -> None:
        """Wait for the call that makes this value (a read: one round trip at most); raise its error
        if it failed, naming the call and the line that issued it."""
        launched = self.launched
        if launched is not None:
            if not launched.done:
                self.conn.settle(launched)
            launched.raise_error()
            if self.launched is launched and launched.error is None:
                self.launched = None

    def note_read(self) -> None:
        if self.policy is not None:
            self.policy.read_outputs.add(self.index)


# what a fetch that failed this way may be recomputed after: the worker or its session is gone
_LOST = (errors.WorkerUnavailableError, errors.TransportError, errors.MissingObjectsError)


def _getter(name: str):
    d = getattr(Tensor, name, None)
    return d.__get__ if d is not None else None


# Metadata only: never fetch. Dynamo's guard code asks size() and stride()
# through __torch_function__; compile-time fakeification asks the rest.
NO_FETCH = {
    Tensor.size, Tensor.stride, Tensor.dim, Tensor.ndimension, Tensor.numel, Tensor.nelement,
    Tensor.element_size, Tensor.is_contiguous, Tensor.storage_offset, Tensor.__len__,
    Tensor.is_floating_point, Tensor.is_complex, Tensor.get_device, Tensor.__hash__,
    Tensor.requires_grad_, Tensor.is_signed, Tensor._is_view, Tensor.backward, Tensor.data_ptr,
} | {_getter(n) for n in (
    "shape", "dtype", "device", "ndim", "requires_grad", "is_leaf", "grad_fn", "layout",
    "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_nested", "is_mkldnn",
    "names", "grad", "_base", "is_xpu", "is_mps", "output_nr", "_version", "itemsize", "nbytes",
)}
NO_FETCH.discard(None)
_METADATA = frozenset(NO_FETCH - {Tensor.backward, Tensor.requires_grad_})  # (no Python frame of torch's)
_AS_PLAIN = {Tensor.__reduce_ex__, Tensor.__repr__, Tensor.__deepcopy__}
_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                    "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                    "__irshift__", "__imatmul__", "__set__"}


class RemoteTensor(torch.Tensor):
    """A tensor whose data is on a worker until read (see the module docstring).

    Per object: ``_rt_ref`` (the :class:`RemoteRef`) while remote; a view of
    another placeholder also has ``_rt_base`` (the placeholder it views) and
    ``_rt_view`` (sizes, strides, offset from the worker tensor's origin).
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_dynamo_compiling() or (torch.compiler.is_compiling()
                                                    and torch._guards.TracingContext.try_get() is not None):
            # dynamo is inlining this while it traces user code (or this thread is tracing): behave as a
            # plain tensor. torch.compiler.is_compiling() alone is one flag for the whole process: true
            # while another thread compiles, when this one must read the value
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _METADATA:  # answered from the local metadata, as _eager would (its wrapper costs)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if not _EAGER:
            _dynamo_hooks()  # (first: dynamo must not trace _pending_among inside a compiled frame either)
        pending = None if func in _AS_PLAIN else _pending_among(args, kwargs)
        if pending == [] and not torch._C._len_torch_dispatch_stack():
            # nothing here is on a worker any more (a placeholder that was read): a plain call
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if _dynamo_callback() is None:  # outside any compiled frame: no dynamo to keep out (its wrapper costs)
            return _eager(func, args, kwargs, pending)
        return _dynamo_hooks()(func, args, kwargs, pending)

    @property
    def is_remote(self) -> bool:
        """True while the data is only on the worker (no torch function involved)."""
        return "_rt_ref" in self.__dict__

    def materialize_(self, full: bool = False) -> RemoteTensor:
        """Fetch the data into the local buffer now (once); then this is an ordinary tensor.

        A view fetches only its own elements, unless ``full`` (a write through
        it is coming) or its base is already here.
        """
        ref = self.__dict__.get("_rt_ref")
        if ref is None:
            return self
        base = self.__dict__.get("_rt_base")
        if base is not None and (full or "_rt_ref" not in base.__dict__ or _overlapping(self)):
            RemoteTensor.materialize_(base)  # fills the shared local buffer
        else:
            try:
                ref.check()  # waits for the call that makes it; raises its failure
                if "_rt_ref" not in self.__dict__:
                    return self  # its call's reply brought the value: filled
                if not ref.handle:
                    raise errors.ProtocolError("the worker's reply did not carry a value it was to send")
                real = ref.conn.fetch(arg_of(self))  # raises a RemoteError: then nothing changes here
            except _LOST as exc:
                if ref.recompute is None:
                    raise
                real = None if base is not None else ref.recompute.value(ref.index, exc)
            if real is None:  # a view of a value remade here: remake the whole value, which it shares
                RemoteTensor.materialize_(base)
            else:
                ref.note_read()
                _write(self, real)
        for key in ("_rt_ref", "_rt_base", "_rt_view"):
            self.__dict__.pop(key, None)
        return self

    def __coerce_same_metadata_as_tangent__(self, expected_meta, expected_type=None):
        return self  # to the graphs it is a plain tensor (aot_autograd checks tangents' types)




def _overlapping(t: Tensor) -> bool:
    """Whether a view repeats elements (a stride 0): it cannot be fetched as a block of its own."""
    with torch._C.DisableTorchFunctionSubclass():
        return any(st == 0 and sz > 1 for sz, st in zip(t.shape, t.stride()))


def _pending_among(args, kwargs) -> list:
    """The still-remote placeholders among the arguments (a flat scan; anything nested: pytree's)."""
    pending = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        kind = type(a)
        if kind in REMOTE:
            if "_rt_ref" in a.__dict__:
                pending.append(a)
        elif kind is list or kind is tuple:
            for b in a:
                kb = type(b)
                if kb in REMOTE:
                    if "_rt_ref" in b.__dict__:
                        pending.append(b)
                elif kb is list or kb is tuple or kb is dict:
                    return [x for x in tree_leaves((args, kwargs)) if type(x) in REMOTE and "_rt_ref" in x.__dict__]
        elif kind is dict:
            return [x for x in tree_leaves((args, kwargs)) if type(x) in REMOTE and "_rt_ref" in x.__dict__]
    return pending


class RemoteGrad(RemoteTensor):
    """A gradient a backward graph left on its worker (or whose reply is on its way).

    The autograd engine works on gradients in C++, below ``__torch_function__``
    (it sums the gradients of a tensor used twice, casts, reduces a broadcast):
    every such operation comes here first and reads the value (one round
    trip), so the engine never sees an unwritten buffer. Passed to the next
    backward graph, as the engine does along a chain of graphs, it travels as
    a reference and nothing waits. Dynamo never sees one: the engine hands
    gradients only to autograd functions and to ``.grad``, which gets a plain
    tensor (the engine detaches what it stores, and that reads it).
    """

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C._DisableTorchDispatch():
            for a in tree_leaves((args, kwargs)):
                if type(a) is RemoteGrad and "_rt_ref" in a.__dict__:
                    a.materialize_()
            args, kwargs = tree_map(lambda a: a.as_subclass(Tensor) if type(a) is RemoteGrad else a,
                                    (args, kwargs))
            return func(*args, **kwargs)


REMOTE = frozenset((RemoteTensor, RemoteGrad))  # the placeholder classes (type(x) in REMOTE: one hash lookup)


def _eager(func, args, kwargs, pending=None):
    if func in NO_FETCH or torch._guards.TracingContext.try_get() is not None:
        # metadata, or compile-time machinery (fakeification asks untyped_storage(), is_inference()…)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if pending is None:  # (the caller's scan, when it made one)
        pending = _pending_among(args, kwargs)
    if OP_HOOK and pending and func not in _AS_PLAIN:  # the call runs on the worker (client.eager)
        out = OP_HOOK[0](func, args, kwargs, pending)
        if out is not NotImplemented:
            return out
    # (never for _AS_PLAIN: trying __deepcopy__ on the meta twin would leave the twin's copy in the
    # memo under an id() that the plain tensor below may reuse, and deepcopy would return it)
    # (a gradient's placeholder reads itself in any operation, views included: no lazy view of it)
    # (nor of one whose call's reply brings the whole value anyway: handle 0)
    if len(pending) == 1 and args and args[0] is pending[0] and func not in _AS_PLAIN \
            and type(pending[0]) is RemoteTensor and pending[0].__dict__["_rt_ref"].handle:
        out = _lazy_view(func, pending[0], args, kwargs)
        if out is not NotImplemented:
            return out
    full = _mutating(func, kwargs)
    for a in pending:
        a.materialize_(full=full)
    # torch.save, pickle, repr, deepcopy of the user's own tensor, in the user's process: exactly as
    # an ordinary tensor (client side only; nothing here unpickles, and no worker ever does)
    if func in _AS_PLAIN:
        with torch._C.DisableTorchFunctionSubclass():
            plain = args[0].as_subclass(Tensor)
        return func(plain, *args[1:], **kwargs)
    return _call_plain(func, args, kwargs)


def _call_plain(func, args, kwargs):
    """``func(*args, **kwargs)`` as a plain torch call (this subclass's torch function off).

    Under a dispatch mode the placeholders go in as plain aliases of
    themselves (same storage, same version counter): aot_autograd analyses
    the first call of a compiled function under a mode that refuses tensor
    subclasses it does not know, and its runtime works on graph outputs
    (``_unsafe_view``, alias regeneration) inside that mode. An alias that
    comes back (an in-place op returns its input) is the original object again.
    """
    with torch._C.DisableTorchFunctionSubclass():
        if not torch._C._len_torch_dispatch_stack():
            return func(*args, **kwargs)
        originals: dict[int, Tensor] = {}

        def unwrap(a):
            if type(a) not in REMOTE:
                return a
            p = a.as_subclass(Tensor)
            originals[id(p)] = a
            return p

        args, kwargs = tree_map(unwrap, (args, kwargs))
        out = func(*args, **kwargs)
        return tree_map(lambda o: originals.get(id(o), o), out)


_EAGER: list = []
OP_HOOK: list = []  # client.eager.on_op once a session installed it: eager calls queued to the worker


def _dynamo_hooks():
    """``_eager`` wrapped so dynamo never traces it, set up on first use (the worker never needs it).

    Dynamo must also run ``__torch_function__`` eagerly when it starts at top
    level (a read from eager code inside a compiled frame, after a graph
    break) and still inline it while it traces user code: ``skip_code`` is
    what ``torch.compiler.disable(recursive=False)`` uses (torch 2.11 to 2.13).
    """
    if not _EAGER:
        from torch._dynamo.eval_frame import skip_code

        skip_code(RemoteTensor.__torch_function__.__func__.__code__)
        skip_code(_pending_among.__code__)
        _EAGER.append(torch._dynamo.disable(_eager, recursive=True))
    return _EAGER[0]


def _mutating(func, kwargs) -> bool:
    name = getattr(func, "__name__", "")
    return "out" in kwargs or name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))


def _lazy_view(func, src: RemoteTensor, args, kwargs):
    """``func(src, …)`` as a remote view when it is a pure view (tried on a meta twin); else NotImplemented."""
    twin = torch.empty_strided(src.shape, src.stride(), dtype=src.dtype, device="meta")
    if src.storage_offset():
        twin = twin.as_strided(src.shape, src.stride(), src.storage_offset())
    before = twin._version
    try:
        with torch._C.DisableTorchFunctionSubclass():
            mout = func(twin, *args[1:], **kwargs)
    except Exception:
        return NotImplemented  # e.g. mixes meta with real tensors: not a view op
    if twin._version != before:
        return NotImplemented  # in place
    if mout is twin:  # returns its input unchanged (contiguous() of a contiguous tensor, to() its own dtype)
        return src
    mouts = mout if isinstance(mout, (tuple, list)) else (mout,)
    if not mouts or not all(isinstance(o, Tensor) and o is not twin and torch._C._is_alias_of(o, twin)
                            and not o.is_conj() and not o.is_neg() and o.dtype == twin.dtype for o in mouts):
        return NotImplemented  # (a ViewArg has neither a conjugate or negative flag nor another dtype)
    out = _call_plain(func, args, kwargs)  # metadata only: a view of the unwritten local buffer
    ref = src.__dict__["_rt_ref"]
    root = src.__dict__.get("_rt_base", src)
    base_off = (src.__dict__.get("_rt_view") or (None, None, 0))[2]
    origin = src.storage_offset() - base_off  # local storage offset of the worker tensor's origin

    def wrap(v):
        if not isinstance(v, Tensor):
            return v
        with torch._C.DisableTorchFunctionSubclass():
            # as_subclass makes an autograd view; an op whose result is no view (detach,
            # _unsafe_view: aot_autograd uses it so that autograd may let an output be
            # written in place) keeps it that way, unless that would cut a gradient's path
            r = v.as_subclass(type(src)) if v._is_view() or v.grad_fn is not None else \
                torch.Tensor._make_subclass(type(src), v, v.requires_grad)
        r._rt_ref = ref
        r._rt_base = root
        r._rt_view = (list(v.shape), list(v.stride()), v.storage_offset() - origin)
        if type(ref.views) is tuple:
            ref.views = []
        ref.views.append(weakref.ref(r))
        return r

    if isinstance(out, Tensor):  # (most views; torch's tree_map leaves a reference cycle per call)
        return wrap(out)
    if type(out) in (tuple, list):  # (split, unbind, chunk)
        return type(out)(wrap(v) for v in out)
    return tree_map(wrap, out)


# ----------------------------------------------------------------------- API
def remote_ref(t) -> RemoteRef | None:
    """The handle a still-remote placeholder stands for, else None (also for every other value)."""
    return t.__dict__.get("_rt_ref") if type(t) in REMOTE else None


def stays_remote(t: RemoteTensor) -> None:
    """Let a placeholder's value live on its worker: closing the session does not fetch it (weights the
    worker loaded itself; ``Session.pull`` brings them here when asked)."""
    t.__dict__["_rt_ref"].stays = True


def arg_of(t: RemoteTensor) -> m.HandleArg | m.ViewArg:
    """How a still-remote placeholder is named on its own worker."""
    ref = t.__dict__["_rt_ref"]
    view = t.__dict__.get("_rt_view")
    if view is None:
        return m.HandleArg(ref.handle)
    return m.ViewArg(ref.handle, view[0], view[1], view[2])


def plain(t: Tensor) -> Tensor:
    """A tensor as an ordinary ``torch.Tensor`` (a fetched placeholder keeps its class otherwise)."""
    if type(t) is Tensor:
        return t
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(Tensor)


def fetch_all(values) -> None:
    """Fetch every still-remote placeholder among ``values`` (before local code reads their buffers)."""
    for v in values:
        if type(v) in REMOTE and "_rt_ref" in v.__dict__:
            v.materialize_()


