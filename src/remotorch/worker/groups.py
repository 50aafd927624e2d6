"""Process groups between workers: torch.distributed collectives over parameter slots, for data parallelism.

A client that trains replicas of a model on several workers forms a group
of them (``OpenStore`` on the first member, then ``JoinGroup`` on every
member at once) and then asks every member, at once, to broadcast the first
member's parameters into the others' slots (``BroadcastSlots``) or to
average the slots' gradients (``ReduceGrads``). The bytes go worker to
worker over the group's own backend (gloo on CPU, NCCL on CUDA; gloo on CUDA
too where two members share a GPU, which NCCL refuses); the client sends
only these small requests. Nothing here reduces anything by hand.

torch.distributed authenticates nothing, so every store and every group
binds to the one address the operator names (``remotorch serve
--group-host``, loopback by default): docs/security.md says what that
trusts. A group belongs to the session that formed it, is named by a
client-chosen id inside it, and goes with the session.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import math
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..codec.tensors import dtype_from_name, dtype_name
from ..errors import GroupError, InvalidRequestError, MissingObjectsError
from .training import Trainables

log = logging.getLogger(__name__)

MAX_WORLD = 1024
_JOINED = "remotorch/joined/"  # each member writes its key here before the backend's rendezvous


@dataclass
class _Group:
    backend: object  # a ProcessGroupGloo or ProcessGroupNCCL
    rank: int
    world: int
    timeout: datetime.timedelta
    buffers: dict = field(default_factory=dict)  # slot ids -> bucket index -> the buffer it is reduced in
    pending: list = field(default_factory=list)  # reductions started (wait=False), not yet waited for


class Groups:
    """Stores this worker hosts and groups it belongs to, per session."""

    def __init__(self, trainables: Trainables, device: torch.device, host: str = "127.0.0.1") -> None:
        self.trainables = trainables
        self.device = device
        self.host = host
        self._stores: dict[object, list] = {}  # session -> stores it asked this worker to host
        self._groups: dict[tuple[object, int], _Group] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ lifetime
    def open_store(self, session: object, timeout_s: float) -> str:
        """Host a rendezvous store on ``--group-host`` (a free port); its ``host:port``."""
        store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                              timeout=_seconds(timeout_s), use_libuv=True)
        with self._lock:
            self._stores.setdefault(session, []).append(store)
        return f"{self.host}:{store.port}"

    def join(self, session: object, group: int, store: str, prefix: str, rank: int, world: int,
             timeout_s: float) -> None:
        """Become ``rank`` of ``world`` in a new group; returns when every member joined (or raises
        ``GroupError`` naming those that did not within ``timeout_s``)."""
        if not 1 <= world <= MAX_WORLD or not 0 <= rank < world:
            raise InvalidRequestError(f"rank {rank} of a group of {world} is not a member")
        if (session, group) in self._groups:
            raise InvalidRequestError(f"group {group} exists in this session already")
        if not prefix or len(prefix) > 200:
            raise InvalidRequestError("a group's prefix is 1 to 200 characters")
        host, _, port = store.rpartition(":")
        if host != self.host:  # the store must be on this worker's group network
            raise InvalidRequestError(f"the group's store {store!r} is not on this worker's group host {self.host}")
        timeout = _seconds(timeout_s)
        try:
            base = self._hosted(session, int(port)) or dist.TCPStore(host, int(port), is_master=False,
                                                                     timeout=timeout, use_libuv=True)
        except (RuntimeError, ValueError) as exc:
            raise GroupError(f"cannot reach the group's store at {store}: {exc}") from None
        prefixed = dist.PrefixStore(prefix, base)
        prefixed.set(f"{_JOINED}{rank}", self._device_key())
        try:
            if self.device.type == "cuda" and self._shares_a_gpu(prefixed, world, timeout):
                # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): gloo, which takes CUDA
                # tensors through host memory, for every member (each sees the same keys)
                log.warning("group %d: members share a GPU, which NCCL refuses: gloo instead", group)
                opts = dist.ProcessGroupGloo._Options()
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
                opts._timeout = timeout
                backend = dist.ProcessGroupGloo(prefixed, rank, world, opts)
            elif self.device.type == "cuda":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                backend = dist.ProcessGroupNCCL(prefixed, rank, world, opts)
            else:
                opts = dist.ProcessGroupGloo._Options()
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
                opts._timeout = timeout
                backend = dist.ProcessGroupGloo(prefixed, rank, world, opts)
        except RuntimeError as exc:
            missing = [r for r in range(world) if not prefixed.check([f"{_JOINED}{r}"])]
            raise GroupError(f"group {group}: members of rank {missing or '?'} did not join within "
                             f"{timeout_s:g}s ({str(exc).splitlines()[0][:200]})", ranks=missing) from None
        with self._lock:
            self._groups[(session, group)] = _Group(backend, rank, world, timeout)

    def _device_key(self) -> bytes:
        """What tells this worker's device from another's: a GPU's UUID (two workers may share one)."""
        if self.device.type != "cuda":
            return b"1"
        return str(torch.cuda.get_device_properties(self.device).uuid).encode()

    @staticmethod
    def _shares_a_gpu(store, world: int, timeout: datetime.timedelta) -> bool:
        """Whether two members of the group run on one GPU (it waits until every member joined)."""
        keys = [f"{_JOINED}{r}" for r in range(world)]
        store.wait(keys, timeout)
        return len({store.get(k) for k in keys}) < world

    def leave(self, session: object, group: int) -> None:
        with self._lock:
            self._groups.pop((session, group), None)

    def drop_session(self, session: object) -> None:
        with self._lock:
            for key in [k for k in self._groups if k[0] == session]:
                del self._groups[key]
            self._stores.pop(session, None)

    def _hosted(self, session: object, port: int):
        for store in self._stores.get(session, ()):
            if store.port == port:
                return store
        return None

    def _group(self, session: object, group: int) -> _Group:
        g = self._groups.get((session, group))
        if g is None:
            raise InvalidRequestError(f"group {group} is not a group of this session (form it first)")
        return g

    # ---------------------------------------------------------------- collectives
    def broadcast_slots(self, session: object, group: int, slots: list[int], shapes: list[list[int]],
                        dtypes: list[str], root: int) -> None:
        """Every member's slots take the root's values; a member creates those it lacks (same layout).

        First, every member checks that all hold the same layout (one small
        all-gather): replicas of different models are an error on all of them.
        """
        g = self._group(session, group)
        if len(slots) != len(shapes) or len(slots) != len(dtypes):
            raise InvalidRequestError("slots, shapes and dtypes disagree")
        if not 0 <= root < g.world:
            raise InvalidRequestError(f"root {root} is not a rank of group {group}")
        layout = [(list(map(int, s)), str(d)) for s, d in zip(shapes, dtypes)]
        tensors = []
        for sid, (shape, dtype) in zip(slots, layout):
            if g.rank == root:
                p = self.trainables.slot(session, sid)
                if list(p.shape) != shape or dtype_name(p.dtype) != dtype:
                    raise InvalidRequestError(f"slot {sid} is {dtype_name(p.dtype)}{list(p.shape)}, "
                                              f"not {dtype}{shape}")
            else:
                p = self._slot_of_layout(session, sid, shape, dtype)
            tensors.append(p.data)
        self._same_layout(g, group, layout)
        for bucket in _buckets(tensors, 25 << 20, ALONE_BYTES):  # a large parameter in place, small ones packed
            alone = len(bucket) == 1 and bucket[0].is_contiguous()
            flat = bucket[0].view(-1) if alone else _flatten(bucket)
            _wait(g, group, "broadcast", g.backend.broadcast([flat], _broadcast_options(root)))
            if g.rank != root and not alone:
                _unflatten(flat, bucket)

    def reduce_grads(self, session: object, group: int, slots: list[int], weight: float,
                     bucket_bytes: int, wait: bool = True) -> None:
        """Each slot's gradient becomes the sum over members of ``weight`` x their gradient (missing: zeros),
        reduced in buckets of about ``bucket_bytes``, all in flight at once. ``wait=False`` returns once
        they are started; a later call with ``wait=True`` waits for every one started in the group."""
        g = self._group(session, group)
        params = [self.trainables.slot(session, sid) for sid in slots]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()
        buckets = list(_buckets([p.grad for p in params], max(1, int(bucket_bytes)), ALONE_BYTES))
        # A bucket of one gradient (a large one, ALONE_BYTES or more) is reduced in place. Several are
        # gathered into a buffer kept for this group and these slots (warm memory: no allocation, no
        # page faults each step), reduced there, and then the gradients are views of it (no copy back,
        # as DDP's gradient-as-bucket-view); a gradient still such a view from the last step
        # (accumulated in place) is not even copied.
        kept = g.buffers.setdefault(tuple(slots), {})
        flats = []
        for k, bucket in enumerate(buckets):
            if len(bucket) == 1:
                flats.append(bucket[0].view(-1))
                continue
            n = sum(t.numel() for t in bucket)
            flat = kept.get(k)
            if flat is None or flat.numel() != n or flat.dtype != bucket[0].dtype:
                flat = kept[k] = torch.empty(n, dtype=bucket[0].dtype, device=bucket[0].device)
            offset = 0
            for t in bucket:
                part = flat[offset:offset + t.numel()]
                if t.data_ptr() != part.data_ptr():
                    part.copy_(t.view(-1))
                offset += t.numel()
            flats.append(flat)
        if weight != 1.0:
            for f in flats:
                f.mul_(weight)
        g.pending.append(([g.backend.allreduce([f]) for f in flats], flats, buckets, params))
        if wait:
            self._finish(g, group)

    def _finish(self, g: _Group, group: int) -> None:
        """Wait for every reduction started in the group; the reduced gradients become views of their buffers."""
        pending, g.pending = g.pending, []
        for works, _, _, _ in pending:
            for work in works:
                _wait(g, group, "all-reduce", work)
        for _, flats, buckets, params in pending:
            by_grad = {id(p.grad): p for p in params}
            for flat, bucket in zip(flats, buckets):
                if len(bucket) > 1:
                    offset = 0
                    for t in bucket:
                        n = t.numel()
                        by_grad[id(t)].grad = flat[offset:offset + n].view_as(t)
                        offset += n

    def _slot_of_layout(self, session: object, sid: int, shape: list[int], dtype: str) -> torch.Tensor:
        try:
            p = self.trainables.slot(session, sid)
        except MissingObjectsError:
            p = None
        if p is None or list(p.shape) != shape or dtype_name(p.dtype) != dtype:
            if any(d < 0 for d in shape) or len(shape) > 32 or math.prod(shape) > 1 << 40:
                raise InvalidRequestError(f"slot {sid}: {shape} is not a shape a slot can have")
            try:
                kind = dtype_from_name(dtype)
            except ValueError as exc:
                raise InvalidRequestError(str(exc)) from None
            self.trainables.bind(session, sid, torch.empty(shape, dtype=kind, device=self.device), private=True)
            p = self.trainables.slot(session, sid)
        return p

    def _same_layout(self, g: _Group, group: int, layout: list) -> None:
        digest = hashlib.sha256(repr(layout).encode()).digest()[:8]
        mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(g.world)]
        _wait(g, group, "layout check", g.backend.allgather([every], [mine]))
        differ = [r for r, t in enumerate(every) if int(t) != int(mine)]
        if differ:
            raise InvalidRequestError(f"group {group}: the replicas hold different models (parameters of "
                                      f"ranks {differ} differ from rank {g.rank}'s in number, shape or dtype)")


def _wait(g: _Group, group: int, what: str, work) -> None:
    try:
        work.wait(g.timeout)
    except RuntimeError as exc:
        raise GroupError(f"group {group}: {what} failed (a member died, or did not take part within "
                         f"{g.timeout.total_seconds():g}s): {str(exc).splitlines()[0][:300]}") from None


def _broadcast_options(root: int):
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    return opts


ALONE_BYTES = 1 << 20  # a gradient this large is reduced where it lies: copying it costs more than an op


def _buckets(tensors: list[torch.Tensor], limit: int, alone: int = 1 << 62):
    """Consecutive runs of one dtype and device, each at most ``limit`` bytes; a tensor over ``limit``
    or of at least ``alone`` bytes makes a bucket by itself (the runs around it go on)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if nbytes >= alone:
            yield [t]
            continue
        if bucket and (t.dtype != bucket[0].dtype or t.device != bucket[0].device or size + nbytes > limit):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def _flatten(bucket: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in bucket]) if len(bucket) > 1 else bucket[0].reshape(-1).clone()


def _unflatten(flat: torch.Tensor, bucket: list[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for t in bucket:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n


def _seconds(s: float) -> datetime.timedelta:
    if not s > 0:
        raise InvalidRequestError("a group's timeout must be positive")
    return datetime.timedelta(seconds=min(float(s), 3600.0))
