"""The worker's side of weights, in process: names under roots, the opened file checked again, safetensors
headers refused before any data is read, files written as safetensors writes them, hub-cache revisions."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from remotorch import errors
from remotorch.codec import messages as m
from remotorch.worker import Worker
from remotorch.worker import roots as roots_mod
from remotorch.worker import stfiles
from remotorch.worker.roots import Roots, check_name, open_read, parse_root
from remotorch.worker.sources import resolve


@pytest.mark.parametrize("name", ["", "/etc/passwd", "w/../x", "w/./x", "w//x", "w/x/", "w/%2e%2e/x", "w/a%00",
                                  "w\\x", "w/a\0b", "w/a\nb", "w/" + "a" * 2000])
def test_refused_names_never_reach_the_disk(name):
    with pytest.raises(errors.PathRefusedError):
        check_name(name)


def test_roots_know_their_names_and_refuse_the_rest(tmp_path):
    (tmp_path / "w").mkdir()
    (tmp_path / "c").mkdir()
    r = Roots([parse_root(f"w={tmp_path / 'w'}", False), parse_root(f"c={tmp_path / 'c'}", True)])
    assert r.describe() == {"c": "write", "w": "read"}
    assert r.split("w/a/b.safetensors")[1] == ["a", "b.safetensors"]
    with pytest.raises(errors.PathRefusedError, match="not a root"):
        r.split("x/a")
    with pytest.raises(errors.PathRefusedError, match="read-only"):
        r.split("w/a", write=True)
    with pytest.raises(errors.PathRefusedError, match="named no folders"):
        Roots().split("w/a")
    for bad in ("w", "1=", f"a b={tmp_path}", f"w={tmp_path / 'missing'}"):
        with pytest.raises(ValueError):
            parse_root(bad, False)
    with pytest.raises(ValueError, match="twice"):
        Roots([parse_root(f"w={tmp_path}", False), parse_root(f"w={tmp_path}", False)])


def test_the_opened_descriptor_is_checked_again(tmp_path, monkeypatch):
    """A link that the path check would miss (swapped in after it) is refused on what was opened."""
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "secret.json"
    outside.write_text("{}")
    (root / "link.json").symlink_to(outside)
    with pytest.raises(errors.PathRefusedError, match="outside its root"):
        open_read(str(root / "link.json"), str(root))
    monkeypatch.setattr(roots_mod, "contained", lambda path, container: os.path.realpath(path))  # the race
    with pytest.raises(errors.PathRefusedError, match="link out of its root"):
        open_read(str(root / "link.json"), str(root))


def test_only_regular_safetensors_and_json_files_are_opened(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"\x80\x04pickle")
    os.mkfifo(tmp_path / "fifo.json")
    with pytest.raises(errors.PathRefusedError, match="only .safetensors and .json"):
        open_read(str(tmp_path / "model.bin"), str(tmp_path))
    with pytest.raises(errors.PathRefusedError, match="not a regular file"):
        open_read(str(tmp_path / "fifo.json"), str(tmp_path))
    with pytest.raises(errors.CheckpointError, match="not there"):
        open_read(str(tmp_path / "gone.json"), str(tmp_path))


def _raw(header, data: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


@pytest.mark.parametrize("content,words", [
    (b"\x01\x02", "not a safetensors file"),
    (struct.pack("<Q", 1 << 40) + b"{}", "a header of"),
    (struct.pack("<Q", 4) + b"nope", "not JSON"),
    (_raw([1, 2]), "not a JSON object"),
    (_raw({"t": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, bytes(4)), "unknown dtype"),
    (_raw({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(4)), "outside the file"),
    (_raw({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(4)), "4 bytes for a F32"),
    (_raw({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4)), "bad shape"),
    (_raw({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
           "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12)), "overlap"),
    (_raw({"__metadata__": {"a": 1}}), "map strings to strings"),
    (_raw({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "code": "x"}}, bytes(4)), "is not {dtype"),
])
def test_a_bad_header_is_refused_before_any_data_is_read(tmp_path, content, words):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(errors.CheckpointError, match=words):
            stfiles.read_header(fd, "bad")
    finally:
        os.close(fd)


def test_files_round_trip_with_safetensors_for_every_dtype(tmp_path):
    tensors = {name: (torch.rand(3, 5) * 100).to(dt) for name, dt in stfiles.DTYPES.items()
               if dt not in (torch.uint16, torch.uint32, torch.uint64)}
    tensors["empty"] = torch.zeros(0, 4)
    tensors["scalar"] = torch.tensor(7.5)
    tensors["strided"] = torch.arange(12.0).reshape(3, 4).t()
    path = tmp_path / "all.safetensors"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        stfiles.write_file(fd, list(tensors.items()), {"format": "pt"})
    finally:
        os.close(fd)
    back = load_file(str(path))  # safetensors itself reads what the worker wrote
    assert sorted(back) == sorted(tensors)
    for key, t in tensors.items():
        assert torch.equal(back[key], t) and back[key].dtype == t.dtype, key
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "theirs.safetensors"))
    fd = os.open(tmp_path / "theirs.safetensors", os.O_RDONLY)  # and reads what safetensors wrote
    try:
        entries, meta = stfiles.read_header(fd, "theirs")
        for key, t in tensors.items():
            assert torch.equal(stfiles.read_tensor(fd, entries[key], "theirs"), t), key
    finally:
        os.close(fd)


def _hub(root, repo: str, commits: dict[str, dict], refs: dict[str, str]):
    """A hub-cache repository: files as blobs, snapshots as relative links to them, refs naming commits."""
    folder = root / ("models--" + repo.replace("/", "--"))
    (folder / "blobs").mkdir(parents=True)
    for commit, files in commits.items():
        snap = folder / "snapshots" / commit
        snap.mkdir(parents=True)
        for name, data in files.items():
            blob = folder / "blobs" / f"{abs(hash((commit, name))):x}"
            blob.write_bytes(data)
            (snap / name).symlink_to(os.path.relpath(blob, snap))
    (folder / "refs").mkdir()
    for ref, commit in refs.items():
        (folder / "refs" / ref).write_text(commit)
    return folder


def _st(value: float) -> bytes:
    t = torch.full((2,), value)
    return _raw({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, t.numpy().tobytes())


def test_hub_cache_revisions_resolve_offline_and_an_incomplete_snapshot_names_what_it_lacks(tmp_path):
    c1, c2, c3 = "1" * 40, "2" * 40, "3" * 40
    index = json.dumps({"weight_map": {"w": "model-00001-of-00002.safetensors",
                                       "v": "model-00002-of-00002.safetensors"}}).encode()
    _hub(tmp_path, "org/tiny", {c1: {"model.safetensors": _st(1.0), "config.json": b'{"a": 1}'},
                                c2: {"model.safetensors": _st(2.0)},
                                c3: {"model.safetensors.index.json": index,
                                     "model-00001-of-00002.safetensors": _st(3.0)}},
         {"main": c2, "v1": c1, "broken": c3})
    worker = Worker("cpu", roots=Roots([parse_root(f"hub={tmp_path}", False)]))

    def value(revision: str = "") -> float:
        index = worker.weights.open("s", "hub/org/tiny", revision)
        hid = len(worker.handles.held("s")) + 1
        worker.weights.load("s", m.LoadWeights("hub/org/tiny", ["w"], [hid], index.specs, index.revision))
        return worker.handles.get("s", hid)[0].item()

    assert value() == 2.0 and value("v1") == 1.0 and value(c1) == 1.0
    assert worker.weights.open("s", "hub/org/tiny", "v1").config == '{"a": 1}'
    assert worker.weights.open("s", "hub/org/tiny", "v1").revision == c1
    with pytest.raises(errors.CheckpointError, match="no revision 'nope'"):
        worker.weights.open("s", "hub/org/tiny", "nope")
    with pytest.raises(errors.CheckpointError, match="is not in this cache"):
        worker.weights.open("s", "hub/org/tiny", "4" * 40)
    with pytest.raises(errors.CheckpointError, match="incomplete.*model-00002-of-00002.safetensors"):
        worker.weights.open("s", "hub/org/tiny", "broken")
    with pytest.raises(errors.PathRefusedError):
        worker.weights.open("s", "hub/org/tiny", "../../x")


def test_a_checkpoint_is_sharded_above_its_size_and_an_earlier_save_is_not_left_behind(tmp_path):
    (tmp_path / "w").mkdir()
    worker = Worker("cpu", roots=Roots([parse_root(f"ck={tmp_path}", True)]))
    tensors = {f"t{i}": torch.full((256,), float(i)) for i in range(5)}  # 1 KiB each
    worker.handles.put("s", list(range(1, 6)), list(tensors.values()))
    args = [m.HandleArg(i) for i in range(1, 6)]
    reply = worker.weights.save("s", m.SaveWeights("ck/run", list(tensors), args, max_shard_bytes=2048), [])
    assert reply.files == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                           "model-00003-of-00003.safetensors", "model.safetensors.index.json"]
    index = json.loads((tmp_path / "run" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 5 * 1024 and len(index["weight_map"]) == 5
    reply = worker.weights.save("s", m.SaveWeights("ck/run", list(tensors), args), [])
    assert sorted(os.listdir(tmp_path / "run")) == ["model.safetensors"]  # no stale shards, no temporaries
    back = load_file(str(tmp_path / "run" / "model.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    for bad in (m.SaveWeights("ck/run", ["a", "a"], args[:2]), m.SaveWeights("ck/run", [""], args[:1]),
                m.SaveWeights("ck/run", ["a"], args[:1], config="[1]"), m.SaveWeights("ck/run", ["a"], args[:2])):
        with pytest.raises(errors.InvalidRequestError):
            worker.weights.save("s", bad, [])
