"""Loading a module's weights on the worker: the client sends a name, the worker reads the files.

Two requests, two round trips, whatever the number of tensors:

1. ``OpenWeights``: the worker resolves the name under its roots and answers
   what the files hold (keys, dtypes, shapes, from the safetensors headers)
   and ``config.json``. No tensor data is read.
2. Here the module's tensors are matched to the files' keys, strictly: a key
   the module lacks, a tensor the files lack, a shape that differs is a
   :class:`~remotorch.errors.CheckpointError` naming them, before any data is
   read. Then ``LoadWeights`` has the worker read the tensors into handles of
   this session, and each parameter and persistent buffer of the module
   becomes a stand-in for its handle (a ``RemoteTensor``: shape, dtype,
   strides, ``requires_grad``, and a local buffer that is never written, so
   no memory is committed). Tied weights are one tensor, one handle.

The stand-ins stay on the worker: graphs take them by handle, a
``RemoteOptimizer`` trains them in place (a parameter slot shares the
handle's memory), and a read fetches one. Closing the session does not bring
them home (:func:`remotorch.client.remote.stays_remote`): ``session.pull(model)``
does, when asked.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from ..client.placeholders import placeholder
from ..client.remote import stays_remote
from ..client.session import Session, default_session
from ..codec import messages as m
from ..codec.tensors import contiguous_strides, dtype_name
from ..errors import CheckpointError
from .meta import Weight, install, meta_buffers, tensors_of


# which session each connection that loaded weights belongs to (a connection does not know its session)
_SESSIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def session_of(conn) -> Session | None:
    """The open session of a connection weights were loaded on, if any."""
    ref = _SESSIONS.get(conn)
    session = ref() if ref is not None else None
    return session if session is not None and not session.closed else None


@dataclass
class Plan:
    """Which file key fills each weight, and what did not match (``strict=False`` keeps going)."""

    chosen: list[tuple[Weight, str]]
    missing: list[str]
    unexpected: list[str]


def open_weights(session: Session, source: str, revision: str | None = None) -> m.WeightsIndex:
    """What ``source`` holds on the session's first worker (one round trip; no tensor data)."""
    return open_weights_on(session.connection, source, revision)


def open_weights_on(conn, source: str, revision: str | None = None) -> m.WeightsIndex:
    """What ``source`` holds on this connection's worker."""
    with conn.lock:
        return conn.request(m.OpenWeights(source, revision or ""), expect=m.WeightsIndex)[0]


def plan(weights: Sequence[Weight], index: m.WeightsIndex, *, strict: bool = True,
         rename: Callable[[str], str] | None = None, ignore_missing: Callable[[str], bool] | None = None,
         ignore_unexpected: Callable[[str], bool] | None = None, source: str = "", subset: bool = False) -> Plan:
    """Match each weight to a key of the files; :class:`CheckpointError` naming the mismatches.

    ``rename`` maps a module key to the files' key (a prefix added or removed);
    ``ignore_missing``/``ignore_unexpected`` tell keys a library says may be absent or extra.
    Shapes must always agree; with ``strict`` keys must too. ``subset``: ``weights`` are part of a model
    (a pipeline stage's), so the files' other keys are not unexpected.
    """
    specs = dict(zip(index.keys, index.specs))
    to_file = rename or (lambda k: k)
    chosen, missing, shapes, used = [], [], [], set()
    for w in weights:
        keys = [to_file(k) for k in w.keys]
        key = next((k for k in keys if k in specs), None)
        if key is None:
            if not (ignore_missing and all(ignore_missing(k) for k in w.keys)):
                missing.append(w.keys[0])
            continue
        used.update(k for k in keys if k in specs)
        want = list(w.tensor.shape)
        if list(specs[key].shape) != want:
            shapes.append(f"{key}: {list(specs[key].shape)} in the files, {want} in the model")
        chosen.append((w, key))
    unexpected = [] if subset else [k for k in index.keys
                                    if k not in used and not (ignore_unexpected and ignore_unexpected(k))]
    where = f"{source}: " if source else ""
    if shapes:
        raise CheckpointError(f"{where}{len(shapes)} shape(s) differ: " + "; ".join(shapes[:10]))
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"the files lack {len(missing)} key(s) the model has: {', '.join(missing[:10])}")
        if unexpected:
            parts.append(f"the files have {len(unexpected)} key(s) the model lacks: {', '.join(unexpected[:10])}")
        raise CheckpointError(where + "; ".join(parts) + " (strict=False loads the keys that match)")
    return Plan(chosen, missing, unexpected)


def load_planned(session: Session, p: Plan, source: str, revision: str = "", conn=None) -> int:
    """Have the worker (of ``conn``, default the session's first) read the planned tensors into handles,
    and make each weight a stand-in for its handle (one round trip). Returns how many were loaded."""
    conn = conn if conn is not None else session.connection
    n = len(p.chosen)
    if not n:
        return 0
    specs = [m.TensorSpec(dtype_name(w.tensor.dtype), list(w.tensor.shape)) for w, _ in p.chosen]
    with conn.lock:
        base = conn.handles.reserve(n)
        conn.request(m.LoadWeights(source, [k for _, k in p.chosen], list(range(base, base + n)), specs,
                                   revision), expect=m.Ok)
    _SESSIONS[conn] = weakref.ref(session)  # (weak both ways: the session owns the connection)
    trainer = session.trainer(conn) if any(w.requires_grad for w, _ in p.chosen) else None
    for i, ((w, _), spec) in enumerate(zip(p.chosen, specs)):
        conn.handles.seen(base + i)
        t = placeholder(conn, m.KeptArg(base + i, spec.dtype, spec.shape, contiguous_strides(spec.shape)), None)
        stays_remote(t)
        if w.parameter:
            t.requires_grad_(w.requires_grad)
            t._is_param = True  # an nn.Parameter to isinstance, optimizers and module code
        install(w, t)
        w.tensor = t
        if trainer is not None and w.requires_grad:
            trainer.claim(t)  # its optimizer and training runs find this session (its slot binds to the handle)
    return n


class IncompatibleKeys(tuple):
    """``(missing_keys, unexpected_keys)``, as ``nn.Module.load_state_dict`` returns them."""

    def __new__(cls, missing: list[str], unexpected: list[str]):
        return super().__new__(cls, (missing, unexpected))

    @property
    def missing_keys(self) -> list[str]:
        return self[0]

    @property
    def unexpected_keys(self) -> list[str]:
        return self[1]


def load_state_dict(module: nn.Module, source: str, *, session: Session | None = None, strict: bool = True,
                    revision: str | None = None) -> IncompatibleKeys:
    """Fill ``module``'s parameters and persistent buffers from ``source``, read by the worker.

    ``module`` is typically built with :func:`remotorch.init_empty_weights` (or
    under ``torch.device("meta")``, when it has no non-persistent buffers):
    nothing of its weights exists here, and nothing is sent. ``source`` is
    ``ROOT/relative/path`` under a root the worker's operator named (a
    ``.safetensors`` file or a ``save_pretrained`` folder); ``revision`` picks
    a branch, tag or commit of a hub-cache repository. The module's tensors
    become stand-ins for values on the session's first worker; see the module
    docstring. Returns ``(missing_keys, unexpected_keys)`` like
    ``nn.Module.load_state_dict``; with ``strict`` (the default) any mismatch
    raises :class:`~remotorch.errors.CheckpointError` before data is read.
    """
    session = session or default_session()
    lost = meta_buffers(module)
    if lost:
        raise ValueError(f"non-persistent buffers on meta cannot be loaded (no checkpoint holds them): "
                         f"{', '.join(lost[:5])}; build the module under remotorch.init_empty_weights(), "
                         "which computes them here")
    index = open_weights(session, source, revision)
    p = plan(tensors_of(module), index, strict=strict, source=source)
    load_planned(session, p, source, index.revision)
    return IncompatibleKeys(p.missing, p.unexpected)


__all__ = ["IncompatibleKeys", "Plan", "load_planned", "load_state_dict", "open_weights", "open_weights_on", "plan"]
