"""The worker's cache on disk: uploads and engine artifacts by content, kept across restarts.

``remotorch serve --cache-dir DIR`` keeps, under DIR:

* ``tensors/``: uploaded tensors by content id (dtype, sizes, strides and raw bytes);
* ``graphs/``: graph documents and their constants by graph id;
* ``artifacts/ENGINE/``: what an engine made of a graph, by a key of the graph id and the
  engine's options (ONNX models for ``onnxrt``);
* ``inductor/``: TorchInductor's own FX graph and AOT autograd caches (``TORCHINDUCTOR_CACHE_DIR``).

The cache is the worker's own, never a client's (DESIGN.md): an entry is written only after
the worker checked its content against its id, and checked again when read, so a corrupted or
truncated entry is deleted and counted, never used. A file is a magic string, a msgpack header
decoded into a typed struct (nothing is unpickled) and the raw bytes. Writes go to a temporary
file in the same folder and are renamed into place, so workers sharing DIR never see half an
entry. Reading an entry bumps its modification time; past ``max_bytes`` the least recently
used entries are deleted first. The folder's layout, which ``remotorch cache`` reads
too, is :mod:`remotorch.codec.cachedir`.

A cache that cannot be written (a read-only or missing folder, a full disk, a file size
limit) never stops the worker: the failure is logged once, counted in :meth:`DiskCache.stats`
with its reason, and the worker serves from memory as it would without a cache.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import secrets
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

from ..codec import cachedir
from ..codec.cachedir import Entry, valid_id
from ..codec.graph import graph_id
from ..codec.messages import TensorMeta
from ..codec.tensors import content_id

log = logging.getLogger(__name__)

MAGIC = b"RTCACHE1"
_LEN = struct.Struct("<I")
_ENGINE = re.compile(r"[a-z][a-z0-9_]{0,31}")
DEFAULT_MAX_BYTES = 20 << 30


class CacheUnavailable(OSError):
    """The cache folder cannot be created or written (the worker then serves without it)."""


class _Header(msgspec.Struct, frozen=True, array_like=True):
    kind: str  # "tensor", "graph" or "blob"
    metas: list[TensorMeta]  # the tensor's meta; a graph's constants
    sizes: list[int]  # byte sizes of the body's parts, in order
    digest: str = ""  # a blob's sha256 (tensors and graphs are checked against their ids)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Header)


class DiskCache:
    """Content-addressed entries under ``root``, checked on write and on read, bounded by ``max_bytes``."""

    def __init__(self, root: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.root = Path(root).expanduser().resolve()
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self.counts = {"hits": 0, "misses": 0, "writes": 0, "write_errors": 0, "corrupt": 0, "evicted": 0}
        self.problem: str | None = None  # why writing stopped working (None: it works)
        try:
            for sub in cachedir.FOLDERS:
                (self.root / sub).mkdir(parents=True, exist_ok=True, mode=0o700)
            probe = self.root / "tmp" / f"probe-{secrets.token_hex(8)}"
            probe.write_bytes(b"remotorch")
            probe.unlink()
        except OSError as exc:
            raise CacheUnavailable(exc.errno or errno.EIO,
                                   f"cache folder {self.root} cannot be written: {exc.strerror or exc}") from None
        self._sweep_tmp()
        self._used = self._scan_bytes()

    @classmethod
    def open(cls, root: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES) -> DiskCache | None:
        """The cache at ``root``, or None (with a warning saying why) when it cannot be used."""
        try:
            return cls(root, max_bytes)
        except CacheUnavailable as exc:
            log.warning("%s; serving without a disk cache", exc.strerror)
            return None

    # ------------------------------------------------------------------ tensors
    def put_tensor(self, tid: str, meta: TensorMeta, data) -> bool:
        """Store a tensor the worker verified (``data``: its raw bytes); False when not written."""
        meta = TensorMeta(meta.dtype, meta.shape, meta.strides, 0)
        return self._write("tensors", tid, _Header("tensor", [meta], [memoryview(data).nbytes]), [data])

    def read_window(self, kind: str, key: str):
        """``(total, read(offset, n))`` over an entry's body, reading only what is asked (None: absent)."""
        found = self._open_header(kind, key)
        if found is None:
            return None
        path, header, start = found
        total = sum(header.sizes)

        def read(offset: int, n: int) -> bytes:
            with open(path, "rb") as f:
                f.seek(start + offset)
                return f.read(n)
        return total, read

    def read_tensor(self, tid: str) -> tuple[TensorMeta, bytearray] | None:
        """A cached tensor checked against its id; a mismatch is deleted and counted (None)."""
        got = self._read("tensors", tid, "tensor")
        if got is None:
            return None
        header, body = got
        if len(header.metas) != 1 or content_id(header.metas[0], memoryview(body)) != tid:
            return self._corrupt("tensors", tid)
        return header.metas[0], body

    def read_tensors(self, tids: list[str]) -> list:
        """:meth:`read_tensor` of each, on up to 8 threads (reading and hashing release the GIL: a
        large model's check runs at the disk's and the cores' pace, not one core's)."""
        if len(tids) < 2:
            return [self.read_tensor(t) for t in tids]
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1, len(tids))) as pool:
            return list(pool.map(self.read_tensor, tids))

    # ------------------------------------------------------------------- graphs
    def put_graph(self, gid: str, doc: bytes, consts: list[TensorMeta], frames) -> bool:
        sizes = [len(doc), *(memoryview(f).nbytes for f in frames)]
        return self._write("graphs", gid, _Header("graph", list(consts), sizes), [doc, *frames])

    def read_graph(self, gid: str) -> tuple[bytes, list[TensorMeta], list[memoryview]] | None:
        """A cached graph (document, constants' metas, their frames), checked against its id."""
        got = self._read("graphs", gid, "graph")
        if got is None:
            return None
        header, body = got
        view, parts, at = memoryview(body), [], 0
        for n in header.sizes:
            parts.append(view[at:at + n])
            at += n
        if len(parts) != len(header.metas) + 1:
            return self._corrupt("graphs", gid)
        doc, frames = bytes(parts[0]), parts[1:]
        if graph_id(doc, header.metas, frames) != gid:
            return self._corrupt("graphs", gid)
        return doc, header.metas, frames

    # ---------------------------------------------------------------- artifacts
    def put_artifact(self, engine: str, key: str, body: bytes) -> bool:
        """Store what ``engine`` made (e.g. an ONNX model) under ``key`` with its sha256."""
        if not _ENGINE.fullmatch(engine):
            raise ValueError(f"bad engine name {engine!r}")
        header = _Header("blob", [], [len(body)], hashlib.sha256(body).hexdigest())
        return self._write(f"artifacts/{engine}", key, header, [body])

    def read_artifact(self, engine: str, key: str) -> bytes | None:
        got = self._read(f"artifacts/{engine}", key, "blob") if _ENGINE.fullmatch(engine) else None
        if got is None:
            return None
        header, body = got
        if hashlib.sha256(body).hexdigest() != header.digest:
            return self._corrupt(f"artifacts/{engine}", key)
        return bytes(body)

    # ----------------------------------------------------------------- folders
    @property
    def inductor_dir(self) -> Path:
        """Where TorchInductor keeps its caches for this worker (``TORCHINDUCTOR_CACHE_DIR``)."""
        return self.root / "inductor"

    def trusted_for_engines(self) -> str | None:
        """Why engine caches that unpickle (inductor's) must not use this folder, or None if they may.

        Inductor loads its cache entries with pickle, so its folder must be writable by
        this worker's user alone: owned by it, not writable by group or others.
        """
        if not hasattr(os, "getuid"):
            return None
        for path in (self.root, self.inductor_dir):
            st = path.stat()
            if st.st_uid != os.getuid():
                return f"{path} belongs to another user"
            if st.st_mode & 0o022:
                return f"{path} is writable by group or others"
        return None

    # ----------------------------------------------------------------- listing
    def entries(self) -> Iterator[Entry]:
        """Every entry, in no order (:func:`remotorch.codec.cachedir.entries`)."""
        return cachedir.entries(self.root)

    def usage(self) -> dict[str, int]:
        """Bytes on disk per part: tensors, graphs, artifacts, inductor."""
        return cachedir.usage(self.root)

    def clear(self) -> int:
        """Delete every entry and inductor's caches; returns the bytes freed."""
        freed = cachedir.clear(self.root)
        with self._lock:
            self._used = 0
        return freed

    def stats(self) -> dict:
        """Counters, bytes held and the folder, for the worker's health reply."""
        with self._lock:
            return {"dir": str(self.root), "bytes": self._used, "max_bytes": self.max_bytes,
                    "problem": self.problem or "", **self.counts}

    # ---------------------------------------------------------------- internals
    def _path(self, kind: str, key: str) -> Path:
        return cachedir.entry_path(self.root, kind, key)

    def _write(self, kind: str, key: str, header: _Header, parts) -> bool:
        path = self._path(kind, key)
        if path.exists():
            return True
        head = _encoder.encode(header)
        size = len(MAGIC) + _LEN.size + len(head) + sum(header.sizes)
        if size > self.max_bytes:
            return False
        tmp = self.root / "tmp" / f"{key[:16]}-{secrets.token_hex(6)}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with open(tmp, "wb") as f:
                f.write(MAGIC + _LEN.pack(len(head)) + head)
                for p in parts:
                    f.write(p)
            os.replace(tmp, path)  # atomic: a reader sees no entry or the whole of it
        except OSError as exc:
            _unlink(tmp)
            self._failed(exc)
            return False
        with self._lock:
            self.counts["writes"] += 1
            self._used += size
            over = self._used > self.max_bytes
        if over:
            self.evict(int(self.max_bytes * 0.9))
        return True

    def _failed(self, exc: OSError) -> None:
        reason = {errno.ENOSPC: "the disk is full", errno.EFBIG: "a file size limit was reached",
                  errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
                  errno.EDQUOT: "the disk quota is exceeded"}.get(exc.errno, exc.strerror or str(exc))
        with self._lock:
            self.counts["write_errors"] += 1
            first = self.problem is None
            self.problem = f"writing to {self.root} failed: {reason}"
        if first:
            log.warning("%s; the worker serves on, without storing what it cannot write", self.problem)

    def _open_header(self, kind: str, key: str) -> tuple[Path, _Header, int] | None:
        if not valid_id(key):
            return None
        path = self._path(kind, key)
        try:
            with open(path, "rb") as f:
                lead = f.read(len(MAGIC) + _LEN.size)
                if len(lead) < len(MAGIC) + _LEN.size or not lead.startswith(MAGIC):
                    raise ValueError("not a cache entry")
                (n,) = _LEN.unpack(lead[len(MAGIC):])
                if n > 1 << 24:
                    raise ValueError("header too long")
                header = _decoder.decode(f.read(n))
                if any(s < 0 for s in header.sizes) or os.fstat(f.fileno()).st_size != f.tell() + sum(header.sizes):
                    raise ValueError("truncated")
                return path, header, f.tell()
        except FileNotFoundError:
            return None
        except (OSError, ValueError, msgspec.DecodeError, msgspec.ValidationError):
            self._corrupt(kind, key)
            return None

    def _read(self, kind: str, key: str, expect: str) -> tuple[_Header, bytearray] | None:
        found = self._open_header(kind, key)
        if found is None:
            with self._lock:
                self.counts["misses"] += 1
            return None
        path, header, start = found
        if header.kind != expect:
            return self._corrupt(kind, key)
        body = bytearray(sum(header.sizes))
        try:
            with open(path, "rb") as f:
                f.seek(start)
                if f.readinto(body) != len(body):
                    return self._corrupt(kind, key)
            os.utime(path)  # least recently used goes first
        except FileNotFoundError:
            return None
        except OSError:
            pass  # read fine; the time stamp could not be bumped (a read-only folder)
        with self._lock:
            self.counts["hits"] += 1
        return header, body

    def _corrupt(self, kind: str, key: str) -> None:
        log.warning("cache entry %s/%s… is corrupt or truncated: deleted", kind, key[:16])
        with self._lock:
            self.counts["corrupt"] += 1
        _unlink(self._path(kind, key))
        return None

    def evict(self, target: int) -> int:
        """Delete least recently used entries until at most ``target`` bytes remain; returns bytes freed."""
        found = sorted(self.entries(), key=lambda e: e.used)
        used = sum(e.nbytes for e in found)
        freed = evicted = 0
        for e in found:
            if used - freed <= target:
                break
            if _unlink(self._path(e.kind, e.key)):
                freed += e.nbytes
                evicted += 1
        with self._lock:
            self._used = used - freed
            self.counts["evicted"] += evicted
        return freed

    def _sweep_tmp(self, older_than_s: float = 3600.0) -> None:
        """Delete temporary files a killed worker left behind (not the fresh ones of a worker
        writing beside this one)."""
        now = time.time()
        for p in (self.root / "tmp").iterdir():
            try:
                if now - p.stat().st_mtime > older_than_s:
                    p.unlink()
            except OSError:
                pass

    def _scan_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries())


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except OSError:
        return False


def open_for_worker(folder: str | os.PathLike, max_bytes: int) -> DiskCache | None:
    """The cache of ``remotorch serve``: opened (None, with a warning, when the folder cannot be
    written), and TorchInductor's caches pointed into it (this process's ``TORCHINDUCTOR_CACHE_DIR``)
    when only this user can write there, since inductor unpickles its entries."""
    disk = DiskCache.open(folder, max_bytes)
    if disk is not None:
        why_not = disk.trusted_for_engines()
        if why_not is None:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(disk.inductor_dir)
        else:
            log.warning("inductor keeps its own cache: %s", why_not)
    return disk
