"""The disk cache's folder: where each entry lives, which names are entries, and how much it holds.

The worker writes and reads entries (:mod:`remotorch.worker.disk`);
``remotorch cache ls|du|clear`` lists, measures and empties a folder without
starting a worker, so this layout is shared, and needs neither torch nor the
worker. Under the folder:

* ``tensors/``, ``graphs/``: entries by content id, as ``KIND/ID[:2]/ID``;
* ``artifacts/ENGINE/``: what an engine made of a graph, by key, the same way;
* ``inductor/``: TorchInductor's own caches; ``tmp/``: entries being written.

Every name that becomes a path is lowercase hex (:func:`valid_id`): no traversal.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

KINDS = ("tensors", "graphs", "artifacts")
FOLDERS = (*KINDS, "inductor", "tmp")  # every folder under the cache's root
_ID = re.compile(r"[0-9a-f]{16,128}")


@dataclass(frozen=True)
class Entry:
    """One cached object as ``remotorch cache ls`` shows it."""

    kind: str  # "tensors", "graphs", "artifacts/ENGINE"
    key: str
    nbytes: int
    used: float  # time.time() of the last write or read


def valid_id(key: str) -> bool:
    """Whether ``key`` may name a cache entry (lowercase hex, 16 to 128 characters)."""
    return isinstance(key, str) and _ID.fullmatch(key) is not None


def entry_path(root: Path, kind: str, key: str) -> Path:
    """Where the entry ``key`` of ``kind`` lives under ``root`` (``ValueError`` for a key that is not hex)."""
    if not valid_id(key):
        raise ValueError(f"cache key {key[:20]!r}… is not a hex id")
    return root / kind / key[:2] / key


def entries(root: Path) -> Iterator[Entry]:
    """Every entry under ``root``, in no order (artifacts under ``artifacts/ENGINE``)."""
    for kind in ("tensors", "graphs"):
        yield from _entries(kind, root / kind)
    art = root / "artifacts"
    for engine in sorted(p.name for p in art.iterdir() if p.is_dir()) if art.is_dir() else ():
        yield from _entries(f"artifacts/{engine}", art / engine)


def _entries(kind: str, folder: Path) -> Iterator[Entry]:
    for dirpath, _, files in os.walk(folder):
        for name in files:
            if not valid_id(name):
                continue
            try:
                st = os.stat(os.path.join(dirpath, name))
            except OSError:
                continue  # evicted meanwhile
            yield Entry(kind, name, st.st_size, st.st_mtime)


def usage(root: Path) -> dict[str, int]:
    """Bytes on disk per part: tensors, graphs, artifacts, inductor."""
    out = {"tensors": 0, "graphs": 0, "artifacts": 0}
    for e in entries(root):
        out[e.kind.split("/")[0]] += e.nbytes
    out["inductor"] = folder_bytes(root / "inductor")
    return out


def clear(root: Path) -> int:
    """Delete every entry and inductor's caches (the folders stay, empty); returns the bytes freed."""
    freed = sum(usage(root).values())
    for sub in FOLDERS:
        shutil.rmtree(root / sub, ignore_errors=True)
        (root / sub).mkdir(parents=True, exist_ok=True, mode=0o700)
    return freed


def folder_bytes(folder: Path) -> int:
    """Bytes of every file under ``folder`` (0 when it is missing)."""
    total = 0
    for dirpath, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total
