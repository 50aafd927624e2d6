"""safetensors files, read and written by the worker: headers checked before any data is read, and
tensors read straight into their own memory.

The format (huggingface/safetensors): an 8-byte little-endian header length
N, N bytes of JSON (``{key: {dtype, shape, data_offsets: [begin, end)}}`` and an
optional ``__metadata__`` of strings), then the tensors' bytes, row-major. A
header is refused (:class:`~remotorch.errors.CheckpointError`) when it is over
100 MB (safetensors' own cap), is not that JSON, names an unknown dtype, or
gives a tensor a span that leaves the file, overlaps another or does not
match its dtype and shape. Nothing in a file is ever executed or unpickled.

A tensor is read with ``preadv`` into a tensor allocated for it, so reading
a file costs the tensors themselves and nothing more: no mapping of the
whole file, no second copy.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import msgspec
import torch

from ..errors import CheckpointError
from .roots import write_all

MAX_HEADER = 100_000_000
MAX_DIMS = 64
_CHUNK = 1 << 30  # bytes one preadv asks for (Linux returns at most about 2 GiB a call)

DTYPES: dict[str, torch.dtype] = {name: dt for name, dt in {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
    "U16": getattr(torch, "uint16", None), "U32": getattr(torch, "uint32", None),
    "U64": getattr(torch, "uint64", None),
    "F8_E4M3": getattr(torch, "float8_e4m3fn", None), "F8_E5M2": getattr(torch, "float8_e5m2", None),
}.items() if dt is not None}
NAMES = {dt: name for name, dt in DTYPES.items()}


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: its key, dtype, shape and byte span in the file (absolute offsets)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def _pread(fd: int, n: int, offset: int, what: str) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise CheckpointError(f"{what}: the file ends early")
    return data


def read_header(fd: int, what: str) -> tuple[dict[str, Entry], dict[str, str]]:
    """The tensors a file holds (by key) and its ``__metadata__``; every span checked."""
    size = os.fstat(fd).st_size
    if size < 8:
        raise CheckpointError(f"{what}: not a safetensors file ({size} bytes)")
    n = int.from_bytes(_pread(fd, 8, 0, what), "little")
    if n > MAX_HEADER or 8 + n > size:
        raise CheckpointError(f"{what}: a header of {n} bytes (the file has {size}; at most {MAX_HEADER})")
    try:
        doc = msgspec.json.decode(_pread(fd, n, 8, what))
    except msgspec.DecodeError as exc:
        raise CheckpointError(f"{what}: its header is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{what}: its header is not a JSON object")
    meta = doc.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CheckpointError(f"{what}: __metadata__ must map strings to strings")
    start, room = 8 + n, size - 8 - n
    entries = {key: _entry(key, spec, start, room, what) for key, spec in doc.items()}
    spans = sorted((e.begin, e.end, e.key) for e in entries.values() if e.end > e.begin)
    for (_, end, key), (begin, _, other) in zip(spans, spans[1:]):
        if begin < end:
            raise CheckpointError(f"{what}: the bytes of {key!r} and {other!r} overlap")
    return entries, meta


def _entry(key: str, spec, start: int, room: int, what: str) -> Entry:
    if not isinstance(spec, dict) or set(spec) - {"dtype", "shape", "data_offsets"}:
        raise CheckpointError(f"{what}: entry {key[:80]!r} is not {{dtype, shape, data_offsets}}")
    dtype = DTYPES.get(spec.get("dtype")) if isinstance(spec.get("dtype"), str) else None
    if dtype is None:
        raise CheckpointError(f"{what}: {key[:80]!r} has an unknown dtype {spec.get('dtype')!r}")
    shape, offsets = spec.get("shape"), spec.get("data_offsets")
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and
            all(type(d) is int and 0 <= d < 1 << 62 for d in shape)):
        raise CheckpointError(f"{what}: {key[:80]!r} has a bad shape")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= room):
        raise CheckpointError(f"{what}: {key[:80]!r} has data_offsets outside the file")
    if offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:
        raise CheckpointError(f"{what}: {key[:80]!r}: {offsets[1] - offsets[0]} bytes for a "
                              f"{spec['dtype']} tensor of shape {shape}")
    return Entry(key, dtype, tuple(shape), start + offsets[0], start + offsets[1])


def _bytes_of(t: torch.Tensor):
    """A writable (or readable) byte view of a contiguous CPU tensor's memory."""
    return t.reshape(-1).view(torch.uint8).numpy()


def read_tensor(fd: int, entry: Entry, what: str) -> torch.Tensor:
    """One tensor of the file, read into a CPU tensor made for it."""
    t = torch.empty(entry.shape, dtype=entry.dtype)
    if entry.nbytes:
        view, offset = memoryview(_bytes_of(t)), entry.begin
        while view.nbytes:
            n = os.preadv(fd, [view[:_CHUNK]], offset)
            if n <= 0:
                raise CheckpointError(f"{what}: the file ends inside {entry.key!r}")
            view, offset = view[n:], offset + n
    return t


def write_file(fd: int, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> int:
    """Write ``tensors`` as a safetensors file (the widest dtypes first, then by key, as safetensors
    orders them, so every tensor starts aligned); returns the tensors' bytes."""
    order = sorted(tensors, key=lambda kt: (-kt[1].element_size(), kt[0]))
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for key, t in order:
        n = t.numel() * t.element_size()
        header[key] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = msgspec.json.encode(header)
    raw += b" " * (-(8 + len(raw)) % 8)
    write_all(fd, len(raw).to_bytes(8, "little") + raw)
    for _, t in order:
        if t.numel():
            write_all(fd, _bytes_of(t.detach().to("cpu").contiguous()))
    return offset


def can_write(dtype: torch.dtype) -> bool:
    return dtype in NAMES
