"""Weights the worker reads from its operator's folders, and checkpoints it writes there.

* :meth:`Weights.open`: what a source holds (keys, dtypes, shapes from the
  headers; ``config.json``), reading no tensor data;
* :meth:`Weights.load`: its tensors into handles of the session (the client's
  stand-ins name them), checked against the shapes the client expects and
  charged to the session's and tenant's memory quota before anything is
  allocated; a file at a time, each tensor read into its own memory, so the
  host holds no more than the tensors plus one tensor in flight;
* :meth:`Weights.save`: handles, slots and small inline tensors as a
  ``save_pretrained`` folder (sharded above a size), each file written beside
  its final name and renamed over it;
* :meth:`Weights.save_optimizer` / :meth:`Weights.load_optimizer`: a worker-side
  optimizer's state and hyperparameters, as a safetensors file.

Which names are allowed and how files are opened: :mod:`remotorch.worker.roots`
and :mod:`remotorch.worker.sources`.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict

import msgspec
import torch

from ..codec import messages as m
from ..codec.tensors import dtype_from_name, dtype_name
from ..errors import CheckpointError, InvalidRequestError, LimitExceededError, PathRefusedError
from . import stfiles
from .roots import Roots, make_folder, open_read, replacing, write_all
from .sources import INDEX, SINGLE, Source, resolve
from .training import plain_hyper

MAX_KEY = 1024
MAX_KEYS = 1 << 20
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_OPTIM_META = "remotorch_optimizer"


class Weights:
    """Loading and saving for one :class:`~remotorch.worker.worker.Worker`, under its roots."""

    def __init__(self, worker, roots: Roots) -> None:
        self.worker = worker
        self.roots = roots
        self.bytes_read = 0  # tensor bytes read from weight files since the worker started (HealthReply)

    # ------------------------------------------------------------------ reading
    def _headers(self, src: Source) -> tuple[dict[str, tuple[str, stfiles.Entry]], dict[str, str]]:
        """key -> (file, entry) over the source's files, checked against its index's weight map; and
        the first file's ``__metadata__``."""
        found: dict[str, tuple[str, stfiles.Entry]] = {}
        metadata: dict[str, str] | None = None
        for file in src.files:
            fd = open_read(src.path(file), src.container)
            try:
                entries, meta = stfiles.read_header(fd, f"{src.label}: {file}")
            finally:
                os.close(fd)
            metadata = meta if metadata is None else metadata
            for key, entry in entries.items():
                if key in found:
                    raise CheckpointError(f"{src.label}: {key!r} is in both {found[key][0]} and {file}")
                found[key] = (file, entry)
        if src.weight_map is not None:
            wrong = [k for k, f in src.weight_map.items() if found.get(k, (None,))[0] != f]
            if wrong:
                raise CheckpointError(f"{src.label}: {INDEX} places {len(wrong)} key(s) in files that do not "
                                      f"hold them: {', '.join(wrong[:5])}")
        return found, metadata or {}

    def open(self, session: object, source: str, revision: str = "") -> m.WeightsIndex:
        """What ``source`` holds: keys, wire dtypes and shapes, and the JSON files beside it."""
        src = resolve(self.roots, source, revision)
        found, metadata = self._headers(src)
        specs = [m.TensorSpec(dtype_name(e.dtype), list(e.shape)) for _, e in found.values()]
        return m.WeightsIndex(list(found), specs, sum(e.nbytes for _, e in found.values()), list(src.files),
                              src.revision, src.json_text("config.json"), src.json_text("generation_config.json"),
                              metadata)

    def load(self, session: object, req: m.LoadWeights) -> None:
        """Read ``req.keys`` into new handles, cast to the dtypes asked (everything checked first)."""
        n = len(req.keys)
        if not (len(req.handles) == n == len(req.specs)) or n > MAX_KEYS:
            raise InvalidRequestError("one handle and one spec per key (at most 2**20 keys)")
        if len(set(req.handles)) != n or not all(type(h) is int and h > 0 for h in req.handles):
            raise InvalidRequestError("handles must be distinct positive integers")
        src = resolve(self.roots, req.source, req.revision)
        found, _ = self._headers(src)
        targets = [_target(key, spec, found, src.label) for key, spec in zip(req.keys, req.specs)]
        limit = self.worker.limits.max_tensor_bytes
        big = [k for k, (_, e, dt) in zip(req.keys, targets) if _size(e.shape, dt) > limit]
        if big:
            raise LimitExceededError(f"{big[0]!r} is over the worker's limit of {limit} bytes a tensor")
        self.worker._reserve(session, sum(_size(e.shape, dt) for _, e, dt in targets))
        by_file: dict[str, list[int]] = defaultdict(list)
        for i, (file, _, _) in enumerate(targets):
            by_file[file].append(i)
        tensors: list[torch.Tensor | None] = [None] * n
        device = self.worker.device
        for file, todo in by_file.items():
            fd = open_read(src.path(file), src.container)
            try:
                for i in sorted(todo, key=lambda i: targets[i][1].begin):  # in the file's order
                    _, entry, dtype = targets[i]
                    t = stfiles.read_tensor(fd, entry, f"{src.label}: {file}")
                    self.bytes_read += entry.nbytes
                    tensors[i] = t.to(device=device, dtype=dtype)
            finally:
                os.close(fd)
        self.worker.handles.put(session, list(req.handles), tensors)

    # ------------------------------------------------------------------ writing
    def save(self, session: object, req: m.SaveWeights, frames) -> m.SaveReply:
        """Write a checkpoint folder under a ``--checkpoints`` root (see the module docstring)."""
        root, parts = self.roots.split(req.target, write=True)
        if len(req.keys) != len(req.values) or len(set(req.keys)) != len(req.keys):
            raise InvalidRequestError("one value per key, and distinct keys")
        for key in req.keys:
            _check_key(key)
        if req.max_shard_bytes <= 0:
            raise InvalidRequestError("max_shard_bytes must be positive")
        config = _json_object("config", req.config)
        generation = _json_object("generation_config", req.generation_config)
        metadata = {**_strings(req.metadata), "format": "pt"}
        tensors = self._values(session, req.values, frames)
        bad = [(k, t.dtype) for k, t in zip(req.keys, tensors) if not stfiles.can_write(t.dtype)]
        if bad:
            raise InvalidRequestError(f"{bad[0][0]!r} is a {bad[0][1]} tensor, which safetensors cannot hold")
        folder = make_folder(root, parts)
        shards = _shards(list(zip(req.keys, tensors)), req.max_shard_bytes)
        names = [SINGLE] if len(shards) == 1 else \
            [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        total = 0
        for name, shard in zip(names, shards):
            with replacing(folder, name, root.path) as fd:
                total += stfiles.write_file(fd, shard, metadata)
        written = list(names)
        if len(shards) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {key: name for name, shard in zip(names, shards) for key, _ in shard}}
            _write_text(folder, INDEX, json.dumps(index, indent=2, sort_keys=True) + "\n", root.path)
            written.append(INDEX)
        _remove_stale(folder, set(written))
        for name, text in (("config.json", config), ("generation_config.json", generation)):
            if text:
                _write_text(folder, name, text, root.path)
                written.append(name)
        return m.SaveReply(written, total)

    def _values(self, session: object, values: list, frames) -> list[torch.Tensor]:
        reader, out = self.worker.reader(frames), []
        for v in values:
            if isinstance(v, m.HandleArg):
                out.append(self.worker.handles.get(session, v.id))
            elif isinstance(v, m.ViewArg):
                out.append(self.worker.handles.view(session, v.id, v.shape, v.strides, v.offset))
            elif isinstance(v, m.SlotArg):
                out.append(self.worker.trainables.value(session, v.id))
            elif isinstance(v, m.RefArg):
                out.append(self.worker.resident_tensor(session, v.id))
            else:
                out.append(reader.tensor(v.meta))
        return out

    # --------------------------------------------------------------- optimizers
    def save_optimizer(self, session: object, req: m.SaveOptimizer) -> m.SaveReply:
        """An optimizer's per-parameter state as tensors ``state.<index>.<key>``; its scalars, class and
        hyperparameters as JSON in the file's metadata."""
        root, parts = self.roots.split(req.target, write=True)
        if not parts or not parts[-1].endswith(".safetensors"):
            raise PathRefusedError(f"{req.target!r}: an optimizer is saved as a .safetensors file")
        opt = self.worker.trainables.optimizer(session, req.optim)
        tensors, scalars = [], []
        for idx, key, value in self.worker.trainables.optim_state(session, req.optim):
            if isinstance(value, torch.Tensor):
                tensors.append((f"state.{idx}.{key}", value))
            elif isinstance(value, (bool, int, float)) or value is None:
                scalars.append([idx, key, value])
            else:
                raise InvalidRequestError(f"optimizer state {key!r} is a {type(value).__name__}, which "
                                          "cannot be saved")
        groups = [{k: v for k, v in g.items() if k != "params" and _plain(v)} for g in opt.param_groups]
        meta = {"format": "pt", _OPTIM_META: type(opt).__name__, "remotorch_scalars": json.dumps(scalars),
                "remotorch_param_groups": json.dumps(groups),
                "remotorch_group_sizes": json.dumps([len(g["params"]) for g in opt.param_groups])}
        folder = make_folder(root, parts[:-1])
        with replacing(folder, parts[-1], root.path) as fd:
            total = stfiles.write_file(fd, tensors, meta)
        return m.SaveReply([parts[-1]], total)

    def load_optimizer(self, session: object, req: m.LoadOptimizer) -> m.OptimLoaded:
        """Replace an optimizer's state and hyperparameters with a file :meth:`save_optimizer` wrote."""
        src = resolve(self.roots, req.source, req.revision)
        if len(src.files) != 1:
            raise CheckpointError(f"{req.source!r}: name the optimizer's .safetensors file")
        opt = self.worker.trainables.optimizer(session, req.optim)
        what = f"{src.label}"
        fd = open_read(src.path(src.files[0]), src.container)
        try:
            entries, meta = stfiles.read_header(fd, what)
            if meta.get(_OPTIM_META) != type(opt).__name__:
                raise CheckpointError(f"{what}: holds the state of {meta.get(_OPTIM_META) or 'no optimizer'}, "
                                      f"not of {type(opt).__name__}")
            try:
                sizes = json.loads(meta.get("remotorch_group_sizes", "[]"))
                groups = json.loads(meta.get("remotorch_param_groups", "[]"))
                scalars = json.loads(meta.get("remotorch_scalars", "[]"))
            except ValueError as exc:
                raise CheckpointError(f"{what}: its optimizer metadata is not JSON: {exc}") from None
            if sizes != [len(g["params"]) for g in opt.param_groups] or not isinstance(groups, list) \
                    or len(groups) != len(opt.param_groups) or not all(isinstance(g, dict) for g in groups):
                raise CheckpointError(f"{what}: its parameter groups ({sizes}) are not this optimizer's")
            state = []
            for key, entry in entries.items():
                head, idx, name = (key.split(".", 2) + ["", ""])[:3]
                if head != "state" or not idx.isdigit():
                    raise CheckpointError(f"{what}: {key[:80]!r} is not state.<index>.<key>")
                state.append((int(idx), name, stfiles.read_tensor(fd, entry, what)))
        finally:
            os.close(fd)
        if not all(isinstance(s, list) and len(s) == 3 and type(s[0]) is int and isinstance(s[1], str)
                   and (s[2] is None or isinstance(s[2], (bool, int, float))) for s in scalars):
            raise CheckpointError(f"{what}: its scalar state is not [index, key, number] entries")
        hyper = [plain_hyper(g) for g in groups]
        self.worker.trainables.optim_set_state(session, req.optim, state + [tuple(s) for s in scalars])
        for group, h in zip(opt.param_groups, hyper):
            group.update(h)
        return m.OptimLoaded([{k: list(v) if isinstance(v, tuple) else v for k, v in h.items()} for h in hyper])


def _target(key: str, spec: m.TensorSpec, found: dict, label: str) -> tuple[str, stfiles.Entry, torch.dtype]:
    got = found.get(key)
    if got is None:
        raise CheckpointError(f"{label}: has no tensor {key[:200]!r}")
    file, entry = got
    if list(entry.shape) != list(spec.shape):
        raise CheckpointError(f"{label}: {key!r} has shape {list(entry.shape)} in {file}, not {list(spec.shape)}")
    try:
        dtype = dtype_from_name(spec.dtype)
    except ValueError:
        raise InvalidRequestError(f"{spec.dtype[:40]!r} is not a dtype") from None
    return file, entry, dtype


def _size(shape, dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not key or len(key) > MAX_KEY or "\0" in key or key == "__metadata__":
        raise InvalidRequestError(f"{str(key)[:80]!r} is not a tensor key (1 to {MAX_KEY} characters, no NUL)")


def _json_object(name: str, text: str) -> str:
    if not text:
        return ""
    try:
        doc = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(f"{name} is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidRequestError(f"{name} is not a JSON object")
    return text


def _strings(meta: dict) -> dict[str, str]:
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise InvalidRequestError("metadata maps strings to strings")
    return dict(meta)


def _plain(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str)) or (
        isinstance(v, (list, tuple)) and all(isinstance(x, (bool, int, float)) for x in v))


def _shards(items: list[tuple[str, torch.Tensor]], limit: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of at most ``limit`` bytes (a tensor larger than that is a group of its own)."""
    shards: list[list] = [[]]
    size = 0
    for key, t in items:
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append((key, t))
        size += n
    return shards


def _write_text(folder: str, name: str, text: str, container: str) -> None:
    with replacing(folder, name, container) as fd:
        write_all(fd, text.encode("utf-8"))


def _remove_stale(folder: str, written: set[str]) -> None:
    """Weight files an earlier save left that this one did not write (another number of shards)."""
    for name in os.listdir(folder):
        if name in written or not (name == SINGLE or name == INDEX or _SHARD.match(name)):
            continue
        path = os.path.join(folder, name)
        if os.path.isfile(path) and not os.path.islink(path):
            os.unlink(path)
