"""The worker's disk cache on its own: entries checked on write and read, LRU, atomic writes, proofs."""

from __future__ import annotations

import os
import time

import pytest
import torch

from remotorch.codec import possession
from remotorch.codec.frames import FrameWriter
from remotorch.codec.graph import graph_id
from remotorch.codec.tensors import content_id, tensor_to_wire
from remotorch.worker.disk import CacheUnavailable, DiskCache
from remotorch.worker.worker import Worker


def put(disk: DiskCache, t: torch.Tensor) -> str:
    meta, buf = tensor_to_wire(t, 0)
    tid = content_id(meta, buf)
    assert disk.put_tensor(tid, meta, buf)
    return tid


def entry_path(disk: DiskCache, kind: str, key: str):
    return disk.root / kind / key[:2] / key


def test_a_tensor_comes_back_equal_and_checked(tmp_path):
    disk = DiskCache(tmp_path)
    t = torch.randn(33, 7, dtype=torch.float64)
    tid = put(disk, t)
    meta, body = disk.read_tensor(tid)
    back = torch.frombuffer(body, dtype=torch.float64).view(33, 7)
    assert torch.equal(back, t) and meta.shape == [33, 7]
    assert disk.stats()["hits"] == 1 and disk.stats()["writes"] == 1
    assert not list((tmp_path / "tmp").iterdir())  # written by rename: nothing half-written is left


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_a_damaged_entry_is_deleted_not_used(tmp_path, damage):
    disk = DiskCache(tmp_path)
    tid = put(disk, torch.arange(1000, dtype=torch.float32))
    path = entry_path(disk, "tensors", tid)
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-5] ^= 0xFF
    elif damage == "truncate":
        raw = raw[:-100]
    else:
        raw = bytearray(b"not a cache entry at all")
    path.write_bytes(bytes(raw))
    assert disk.read_tensor(tid) is None
    assert not path.exists() and disk.stats()["corrupt"] == 1


def test_a_graph_is_checked_against_its_id(tmp_path):
    disk = DiskCache(tmp_path)
    w = FrameWriter()
    const = torch.randn(8)
    metas = [w.meta(const)]
    frames = [memoryview(f).cast("B") for f in w.frames]
    doc = b'{"a graph document": 1}'
    gid = graph_id(doc, metas, frames)
    assert disk.put_graph(gid, doc, metas, frames)
    got_doc, got_metas, got_frames = disk.read_graph(gid)
    assert got_doc == doc and got_metas == metas and bytes(got_frames[0]) == bytes(frames[0])
    # an entry whose content no longer gives its id is refused (same length, other bytes)
    path = entry_path(disk, "graphs", gid)
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b"graph document", b"graph_document"))
    assert disk.read_graph(gid) is None and disk.stats()["corrupt"] == 1


def test_an_id_from_the_wire_never_becomes_a_path_outside(tmp_path):
    disk = DiskCache(tmp_path / "c")
    for bad in ("../../etc/passwd", "..", "ABCDEF0123456789", "/tmp/x", "0" * 15, "g" * 64):
        assert disk.read_tensor(bad) is None and disk.read_window("tensors", bad) is None
        with pytest.raises(ValueError):
            disk.put_tensor(bad, *tensor_to_wire(torch.ones(2), 0))


def test_least_recently_used_entries_go_first(tmp_path):
    one = 4096 * 4  # bytes of each tensor below
    disk = DiskCache(tmp_path, max_bytes=int(3.5 * (one + 200)))
    ids = [put(disk, torch.full((4096,), float(i))) for i in range(3)]
    past = time.time() - 100
    for i, tid in enumerate(ids):  # written in order, long ago
        os.utime(entry_path(disk, "tensors", tid), (past + i, past + i))
    assert disk.read_tensor(ids[0]) is not None  # the oldest is read: now the most recent
    newest = put(disk, torch.full((4096,), 9.0))  # over the limit: the least recently used goes
    left = {e.key for e in disk.entries()}
    assert ids[0] in left and newest in left and ids[1] not in left
    assert disk.stats()["evicted"] >= 1 and disk.stats()["bytes"] <= disk.max_bytes


def test_a_folder_that_cannot_be_made_is_a_typed_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the folder should be")
    with pytest.raises(CacheUnavailable, match="cannot be written"):
        DiskCache(blocker / "cache")
    assert DiskCache.open(blocker / "cache") is None


def test_proofs_need_the_bytes(tmp_path):
    nonce, other = os.urandom(16), os.urandom(16)
    big = bytes(range(256)) * 64  # more than the windows cover
    tid = "ab" * 32
    right = possession.proof(nonce, tid, len(big), lambda o, n: big[o:o + n])
    assert right == possession.proof(nonce, tid, len(big), possession.Bytes([big[:1000], big[1000:]]).read)
    flipped = bytearray(big)
    for off, n in possession.windows(nonce, tid, len(big)):
        flipped[off] ^= 1
    assert possession.proof(nonce, tid, len(big), lambda o, n: bytes(flipped[o:o + n])) != right
    assert possession.proof(other, tid, len(big), lambda o, n: big[o:o + n]) != right  # bound to the session
    windows = possession.windows(nonce, tid, len(big))
    assert len(windows) == possession.WINDOWS and all(0 <= o <= len(big) - n for o, n in windows)
    assert possession.windows(nonce, tid, 100) == [(0, 100)]  # small objects: every byte


def test_the_worker_holds_a_cached_tensor_only_against_a_proof(tmp_path):
    disk = DiskCache(tmp_path)
    t = torch.randn(64, 64)
    meta, buf = tensor_to_wire(t, 0)
    tid = content_id(meta, buf)
    first = Worker("cpu", disk=disk)
    first.put_tensors("a", [tid], [meta], [buf])
    restarted = Worker("cpu", disk=DiskCache(tmp_path))
    nonce = os.urandom(16)
    wrong = (tid, buf.nbytes, b"\0" * 16)
    assert restarted.have("b", nonce, [], [wrong]) == ([], [])
    claim = (tid, buf.nbytes, possession.proof(nonce, tid, buf.nbytes, lambda o, n: bytes(buf[o:o + n])))
    assert restarted.have("b", nonce, [], [claim]) == ([], [tid])
    assert torch.equal(restarted.resident_tensor("b", tid).cpu(), t)
    with pytest.raises(Exception, match="does not hold"):
        restarted.resident_tensor("c", tid)  # another session gets nothing for it


def test_temporary_files_of_a_killed_writer_are_swept_only_when_old(tmp_path):
    DiskCache(tmp_path)
    old, fresh = tmp_path / "tmp" / "abandoned", tmp_path / "tmp" / "in-progress"
    old.write_bytes(b"x" * 100)
    fresh.write_bytes(b"y" * 100)
    long_ago = time.time() - 2 * 3600
    os.utime(old, (long_ago, long_ago))
    DiskCache(tmp_path)  # a worker starting on the folder
    assert not old.exists() and fresh.exists()
