"""What a worker trains per session: parameter slots and optimizers.

Two kinds of objects, each named by an integer the client chose (saved
activations and every other kept value are handles: :mod:`remotorch.worker.handles`):

* **slots**: trainable parameters (``torch.nn.Parameter``), with their
  gradient accumulated here with PyTorch's semantics (set when there is none,
  added in place otherwise). Slots are private to the session: a slot is a
  copy, never the content-addressed tensor other sessions may share.
* **optimizers**: instances of a class of ``torch.optim`` looked up by name
  (never code from the wire), over slots, with hyperparameters as plain values.

Nothing here knows about sockets; :mod:`remotorch.worker.service` decodes the
messages and calls these methods.
"""

from __future__ import annotations

import inspect
import re
import threading
import traceback
from dataclasses import dataclass, field

import torch

from ..errors import InvalidRequestError, MissingObjectsError, WorkerError
from .handles import count_bytes

# Optimizers whose multi-tensor (``foreach``) step gives the same bits as their per-tensor loop, and is
# faster (tests/unit/test_worker_training.py checks the first on this torch): on a CPU, where
# torch's default is the loop, one whose ``foreach`` the user left unset takes the multi-tensor step,
# as it would on CUDA. It holds one more temporary per parameter during the step, as it does there.
SAME_BITS_FOREACH = frozenset({"Adam", "AdamW", "Adamax", "Adadelta", "RMSprop", "Rprop"})
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")
_KEY = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")


@dataclass
class _SessionState:
    slots: dict[int, torch.nn.Parameter] = field(default_factory=dict)
    # slot id -> its parameter detached (made once: the same object passes a graph's argument check
    # again without one); dropped when the slot gets a new parameter or goes
    detached: dict[int, torch.Tensor] = field(default_factory=dict)
    optims: dict[int, torch.optim.Optimizer] = field(default_factory=dict)


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` class called ``name``; InvalidRequestError for anything else."""
    cls = getattr(torch.optim, name, None) if _NAME.match(name) else None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
            and cls is not torch.optim.Optimizer):
        raise InvalidRequestError(f"{name[:80]!r} is not an optimizer class of torch.optim")
    return cls


def plain_hyper(hyper: dict) -> dict:
    """Hyperparameters as the optimizer wants them: identifier keys, lists become tuples."""
    out = {}
    for key, value in hyper.items():
        if not _KEY.match(key) or key == "params":
            raise InvalidRequestError(f"hyperparameter name {key[:80]!r} is not allowed")
        out[key] = tuple(value) if isinstance(value, list) else value
    return out


class Trainables:
    """Parameter slots and optimizers of every session on one worker."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._sessions: dict[object, _SessionState] = {}
        self._lock = threading.Lock()

    def _state(self, session: object) -> _SessionState:
        state = self._sessions.get(session)
        if state is None:
            with self._lock:
                state = self._sessions.setdefault(session, _SessionState())
        return state

    def drop_session(self, session: object) -> None:
        """Free everything a session kept (called when its connection closes)."""
        with self._lock:
            self._sessions.pop(session, None)

    def tensors(self, session: object | None = None):
        """Parameters, their gradients and optimizer state of one session (None: of every session)."""
        with self._lock:
            states = list(self._sessions.values()) if session is None else [self._sessions.get(session)]
        for st in states:
            if st is None:
                continue
            for p in list(st.slots.values()):
                yield p
                yield p.grad
            for opt in list(st.optims.values()):
                for per_param in list(opt.state.values()):
                    yield from per_param.values()

    def bytes(self, session: object | None = None) -> int:
        """Bytes held for one session (None: all): parameters, gradients, optimizer state."""
        return count_bytes(self.tensors(session))

    def apply_pending(self, session: object, zero_grad=(), slots=(), optims=()) -> None:
        """Deferred housekeeping: clear optimizers' gradients (set to None), then forget slots
        and optimizers. Ids this session does not hold are ignored."""
        st = self._sessions.get(session)
        if st is None:
            return
        for o in zero_grad:
            opt = st.optims.get(o)
            if opt is not None:
                opt.zero_grad(set_to_none=True)
        for sid in slots:
            st.slots.pop(sid, None)
            st.detached.pop(sid, None)
        for o in optims:
            st.optims.pop(o, None)

    # ------------------------------------------------------------------- slots
    def slot(self, session: object, sid: int) -> torch.nn.Parameter:
        try:
            return self._state(session).slots[sid]
        except KeyError:
            raise MissingObjectsError(f"parameter slot {sid} is not held by this session (the "
                                      "connection was lost, or it was never bound)",
                                      slots=[sid]) from None

    def values_made(self, session: object) -> dict[int, torch.Tensor]:
        """Slot id -> the detached parameter :meth:`value` made already (read only; on a miss, ask it)."""
        st = self._sessions.get(session)
        return st.detached if st is not None else {}

    def value(self, session: object, sid: int) -> torch.Tensor:
        """A slot's parameter as a graph argument: detached (the same object each call, sharing its
        storage and version counter)."""
        st = self._state(session)
        t = st.detached.get(sid)
        if t is None:
            t = st.detached[sid] = self.slot(session, sid).detach()
        return t

    def bind(self, session: object, sid: int, value: torch.Tensor, *, private: bool) -> None:
        """Set a slot's value; a new slot gets its own copy unless ``value`` is already private."""
        st = self._state(session)
        value = value.to(self.device)
        p = st.slots.get(sid)
        if p is not None and p.shape == value.shape and p.dtype == value.dtype:
            with torch.no_grad():
                p.copy_(value)
            return
        if p is not None and any(p is q for o in st.optims.values()
                                 for g in o.param_groups for q in g["params"]):
            raise InvalidRequestError(f"slot {sid} changed shape or dtype while an optimizer uses it")
        data = value if private and value.is_contiguous() else value.clone(memory_format=torch.contiguous_format)
        st.slots[sid] = torch.nn.Parameter(data, requires_grad=True)
        st.detached.pop(sid, None)

    def accumulate(self, session: object, sid: int, grad: torch.Tensor, *, owned: bool) -> None:
        """PyTorch's AccumulateGrad: set the gradient when there is none, else add in place."""
        p = self.slot(session, sid)
        grad = grad.to(self.device)
        if grad.shape != p.shape:
            raise InvalidRequestError(f"gradient of shape {list(grad.shape)} for slot {sid} of shape "
                                      f"{list(p.shape)}")
        if grad.dtype != p.dtype:
            grad = grad.to(p.dtype)
            owned = True
        if p.grad is None:
            p.grad = grad if owned else grad.clone()
        else:
            p.grad.add_(grad)

    def pull(self, session: object, slots: list[int], grads: bool) -> tuple[list, list]:
        ps = [self.slot(session, s) for s in slots]
        return [p.detach() for p in ps], [p.grad if grads else None for p in ps]

    # -------------------------------------------------------------- optimizers
    def optim_create(self, session: object, oid: int, name: str, groups: list[list[int]],
                     hyper: list[dict]) -> None:
        """Build ``torch.optim.<name>`` over slots, one group per list."""
        cls = optimizer_class(name)
        if len(hyper) != len(groups):
            raise InvalidRequestError("one hyperparameter map per parameter group is needed")
        st = self._state(session)
        if oid in st.optims:
            raise InvalidRequestError(f"optimizer id {oid} is already in use")
        param_groups = [{**plain_hyper(h), "params": [self.slot(session, s) for s in g]}
                        for g, h in zip(groups, hyper)]
        if name in SAME_BITS_FOREACH and self.device.type == "cpu":
            for group in param_groups:
                if "foreach" in group and group["foreach"] is None and not any(
                        group.get(k) for k in ("differentiable", "capturable", "fused")):
                    group["foreach"] = True
        # the first group's values that the constructor takes become its arguments, so the
        # class checks them (a group may hold more keys, e.g. a scheduler's initial_lr)
        takes = inspect.signature(cls.__init__).parameters
        first = plain_hyper(hyper[0]) if hyper else {}
        try:
            st.optims[oid] = cls(param_groups, **{k: v for k, v in first.items() if k in takes})
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"torch.optim.{name} refused its arguments: {exc}") from None

    def optimizer(self, session: object, oid: int) -> torch.optim.Optimizer:
        """The session's optimizer ``oid``; MissingObjectsError when it holds none by that id."""
        return self._optim(session, oid)

    def _optim(self, session: object, oid: int) -> torch.optim.Optimizer:
        try:
            return self._state(session).optims[oid]
        except KeyError:
            raise MissingObjectsError(f"optimizer {oid} is not held by this session",
                                      optims=[oid]) from None

    def optim_step(self, session: object, oid: int, hyper: list[dict]) -> None:
        """Apply changed hyperparameters (``hyper[i]`` to group i), then step."""
        opt = self._optim(session, oid)
        if len(hyper) > len(opt.param_groups):
            raise InvalidRequestError("more hyperparameter maps than parameter groups")
        for group, h in zip(opt.param_groups, hyper):
            group.update(plain_hyper(h))
        try:
            opt.step()
        except Exception as exc:
            raise WorkerError(f"{type(opt).__name__}.step failed: {type(exc).__name__}: {exc}",
                              remote_traceback=traceback.format_exc()) from None

    def optim_zero_grad(self, session: object, oid: int, set_to_none: bool) -> None:
        self._optim(session, oid).zero_grad(set_to_none=set_to_none)

    def optim_state(self, session: object, oid: int) -> list[tuple[int, str, object]]:
        """The optimizer's per-parameter state as ``(parameter index, key, value)`` entries."""
        state = self._optim(session, oid).state_dict()["state"]
        return [(idx, key, value) for idx, per_param in sorted(state.items())
                for key, value in per_param.items()]

    def optim_set_state(self, session: object, oid: int, entries: list) -> None:
        """Replace the per-parameter state (PyTorch's load_state_dict casts it to the parameters)."""
        opt = self._optim(session, oid)
        current = opt.state_dict()
        n = sum(len(g["params"]) for g in current["param_groups"])
        state: dict[int, dict] = {}
        for idx, key, value in entries:
            if not 0 <= idx < n or not _KEY.match(key):
                raise InvalidRequestError(f"optimizer state entry ({idx}, {key[:80]!r}) does not fit")
            state.setdefault(idx, {})[key] = value
        try:
            opt.load_state_dict({"state": state, "param_groups": current["param_groups"]})
        except (TypeError, ValueError, KeyError, RuntimeError) as exc:
            raise InvalidRequestError(f"{type(opt).__name__} refused the state: {exc}") from None

    def clip_grad_norm(self, session: object, oid: int, max_norm: float, norm_type: float,
                       error_if_nonfinite: bool) -> float:
        """``clip_grad_norm_`` over every parameter of the optimizer; the total norm before clipping."""
        opt = self._optim(session, oid)
        params = [p for g in opt.param_groups for p in g["params"]]
        try:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type,
                                                  error_if_nonfinite=error_if_nonfinite)
        except RuntimeError as exc:
            raise WorkerError(f"clip_grad_norm_ failed: {exc}",
                              remote_traceback=traceback.format_exc()) from None
        return float(norm)
