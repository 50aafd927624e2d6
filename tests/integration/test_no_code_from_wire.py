"""Rule 1: no bytes from the wire ever become code on the worker.

Every payload here would create a marker file if it were unpickled,
``torch.load``-ed without ``weights_only`` or evaluated. Each one goes into a
field of a real, authenticated request (so it passes the transport's auth and
reaches the decoders) and into :func:`decode_graph` directly. The worker must
answer with an ``ErrorReply`` (or treat the bytes as plain data), the marker
must never appear, and the worker must keep serving.
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import textwrap

import msgspec
import pytest
import torch

from remotorch.codec import messages as m
from remotorch.codec.graph import decode_graph, graph_id
from remotorch.codec.tensors import content_id, tensor_to_wire
from remotorch.transport import TcpTransport

from conftest import TOKEN, clean_env
from helpers import assert_still_serves


class _OpenOnUnpickle:
    """Unpickling this calls ``open(path, "w")``: creates the marker file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class _SystemOnUnpickle:
    """Unpickling this runs ``touch path`` in a shell."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def evil_blobs(path: str) -> dict[str, bytes]:
    """Byte strings that create ``path`` when unpickled, torch.load-ed or evaluated."""
    saved = io.BytesIO()
    torch.save({"weights": torch.zeros(2), "payload": _OpenOnUnpickle(path)}, saved)
    return {
        "pickle-open": pickle.dumps(_OpenOnUnpickle(path)),
        "pickle-system": pickle.dumps(_SystemOnUnpickle(path), protocol=2),
        "torch-save": saved.getvalue(),
        "eval-import": f"__import__('os').system('touch {path}')".encode(),
        "eval-open": f"open({path!r}, 'w')".encode(),
    }


def evil_strings(path: str) -> list[str]:
    return [f"__import__('os').system('touch {path}')",
            f"open({path!r}, 'w').close()",
            f"eval(\"__import__('os').system('touch {path}')\")",
            "builtins::eval.default", "os::system.default", "builtins.exec", "posix.system",
            f"exec(compile('open({path!r},\"w\")','x','exec'))"]


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "pwned"
    yield str(path)
    assert not path.exists(), "a payload from the wire was executed"


def test_the_payloads_are_live(tmp_path):
    """Sanity check: each payload really creates its file when loaded the unsafe way."""
    script = textwrap.dedent("""
        import io, pickle, sys, torch
        for blob_path in sys.argv[1:]:
            kind, data = blob_path.rsplit("/", 1)[1][:-4], open(blob_path, "rb").read()
            if kind.startswith("pickle"):
                pickle.loads(data)
            elif kind == "torch-save":
                torch.load(io.BytesIO(data), weights_only=False)
            else:
                eval(data.decode())
    """)
    kinds = list(evil_blobs("unused"))
    blob_paths = []
    for kind in kinds:
        blob_path = tmp_path / f"{kind}.bin"
        blob_path.write_bytes(evil_blobs(str(tmp_path / f"live-{kind}"))[kind])
        blob_paths.append(str(blob_path))
    proc = subprocess.run([sys.executable, "-c", script, *blob_paths], capture_output=True, text=True,
                          env=clean_env(), cwd=str(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for kind in kinds:
        assert (tmp_path / f"live-{kind}").exists(), kind


# ---------------------------------------------------------------- graph documents
def _doc(nodes: list) -> bytes:
    return msgspec.msgpack.encode({"format": 1, "nodes": nodes})


_PH = {"op": "placeholder", "kind": "tensor", "dtype": "float32", "shape": [4]}


def _call(target="aten::add.Tensor", args=None, kwargs=None) -> dict:
    return {"op": "call", "target": target,
            "args": [{"$n": "v0"}, {"$n": "v0"}] if args is None else args, "kwargs": kwargs or {}}


def _graph(*calls: dict) -> bytes:
    return _doc([_PH, *calls, {"op": "output", "args": [{"$n": f"v{len(calls)}"}]}])


def evil_documents(path: str) -> dict[str, bytes]:
    """Graph documents with the payloads in every slot the schema has."""
    docs = {f"doc-is-{k}": v for k, v in evil_blobs(path).items()}
    docs["doc-is-msgpack-of-pickle"] = msgspec.msgpack.encode(pickle.dumps(_OpenOnUnpickle(path)))
    docs["doc-with-ext-type"] = msgspec.msgpack.encode(
        {"format": 1, "nodes": [msgspec.msgpack.Ext(1, pickle.dumps(_OpenOnUnpickle(path)))]})
    docs["format-is-pickle"] = msgspec.msgpack.encode({"format": pickle.dumps(_OpenOnUnpickle(path)),
                                                       "nodes": [_PH]})
    blob = pickle.dumps(_OpenOnUnpickle(path))
    for i, s in enumerate(evil_strings(path)):
        docs[f"target-{i}"] = _graph(_call(target=s))
        docs[f"target-with-overload-{i}"] = _graph(_call(target=f"aten::{s}.default"))
        docs[f"kwarg-key-{i}"] = _graph(_call(kwargs={s: 1}))
        docs[f"kwarg-value-{i}"] = _graph(_call("aten::gelu.default", args=[{"$n": "v0"}],
                                                kwargs={"approximate": s}))
        docs[f"arg-{i}"] = _graph(_call(args=[{"$n": "v0"}, s]))
        docs[f"dtype-{i}"] = _graph(_call("aten::to.dtype", args=[{"$n": "v0"}, {"$dt": s}]))
        docs[f"dtype-kwarg-{i}"] = _graph(_call("aten::sum.default", args=[{"$n": "v0"}],
                                                kwargs={"dtype": {"$dt": s}}))
        docs[f"node-ref-{i}"] = _graph(_call(args=[{"$n": s}, {"$n": "v0"}]))
        docs[f"placeholder-dtype-{i}"] = _doc([{**_PH, "dtype": s}, {"op": "output", "args": [{"$n": "v0"}]}])
        docs[f"placeholder-kind-{i}"] = _doc([{**_PH, "kind": s, "shape": s},
                                              {"op": "output", "args": [{"$n": "v0"}]}])
        docs[f"op-kind-{i}"] = _doc([_PH, {"op": s, "target": s}, {"op": "output", "args": []}])
        for tag in ("$ly", "$mf", "$dev", "$t", "$c", "$obj", "__reduce__"):
            docs[f"tag{tag}-{i}"] = _graph(_call(args=[{"$n": "v0"}, {"$n": "v0"}], kwargs={"alpha": {tag: s}}))
    for tag in ("$ly", "$mf", "$dt", "$n", "$c"):  # unhashable or binary payloads in tagged values
        docs[f"tag{tag}-bytes"] = _graph(_call(kwargs={"alpha": {tag: blob}}))
        docs[f"tag{tag}-list"] = _graph(_call(kwargs={"alpha": {tag: [blob]}}))
        docs[f"tag{tag}-map"] = _graph(_call(kwargs={"alpha": {tag: {"x": blob}}}))
    docs["arg-bytes"] = _graph(_call(args=[{"$n": "v0"}, blob]))
    docs["const-index-bytes"] = _doc([_PH, {"op": "const", "index": blob}, {"op": "output", "args": []}])
    docs["denied-from-file"] = _graph(_call("aten::from_file.default", args=[path, True, 4]))
    docs["denied-save"] = _graph(_call("aten::save.default", args=[{"$n": "v0"}, path]))
    return docs


def test_decode_graph_never_runs_payloads(marker):
    for name, doc in evil_documents(marker).items():
        try:
            decoded = decode_graph(doc, [], torch.device("cpu"))
        except Exception:  # noqa: BLE001 - refusing is the expected outcome; what matters is the file
            pass
        else:  # some documents are well-formed (a string argument is just a string): run them too
            try:
                decoded.module(torch.randn(4))
            except Exception:  # noqa: BLE001
                pass
        assert not os.path.exists(marker), name


# --------------------------------------------------------------- over the wire
@pytest.fixture
def transport(server):
    t = TcpTransport(server.url, TOKEN, protocol=m.PROTOCOL_VERSION, connect_timeout=5, timeout=60)
    yield t
    t.close()


def ask(transport: TcpTransport, body_or_header, frames=()):
    header = body_or_header if isinstance(body_or_header, bytes) else m.encode(body_or_header)
    reply_header, reply_frames = transport.request(header, frames)
    return m.decode(reply_header), reply_frames


def _put_graph(transport, doc: bytes):
    return ask(transport, m.PutGraph(graph_id(doc, [], []), doc, []))


def test_evil_graph_documents_are_refused(transport, marker, session):
    accepted = []
    for name, doc in evil_documents(marker).items():
        reply, _ = _put_graph(transport, doc)
        if isinstance(reply, m.Ok):  # well-formed: strings are data; running must still fail
            accepted.append(name)
            x = torch.randn(4)
            x_meta, x_buf = tensor_to_wire(x, 0)
            reply, frames = ask(transport, m.Run(graph_id(doc, [], []), "eager", [m.TensorArg(x_meta)]),
                                [x_buf])
        assert isinstance(reply, m.ErrorReply), (name, reply)
        assert not os.path.exists(marker), name
    # only documents whose payload sits in a string argument of an allowed op may decode
    # ($dev decodes to the worker's own device whatever it says)
    assert all(n.startswith(("kwarg-value-", "arg-", "tag$dev-")) for n in accepted), accepted
    assert_still_serves(session)


def test_evil_message_headers_are_refused(transport, marker, session):
    blobs = evil_blobs(marker)
    headers = list(blobs.values())
    headers += [msgspec.msgpack.encode([m.PROTOCOL_VERSION, {"type": s}]) for s in evil_strings(marker)]
    headers += [msgspec.msgpack.encode([b, {"type": "health"}]) for b in blobs.values()]
    headers += [msgspec.msgpack.encode([m.PROTOCOL_VERSION, msgspec.msgpack.Ext(7, b)]) for b in blobs.values()]
    headers += [msgspec.msgpack.encode([m.PROTOCOL_VERSION, {"type": "put_graph", "graph_id": b, "doc": b}])
                for b in blobs.values()]
    for header in headers:
        reply, _ = ask(transport, header)
        assert isinstance(reply, m.ErrorReply), header[:60]
        assert reply.kind == "protocol"
        assert not os.path.exists(marker)
    # unknown keys (payload as key or value) are ignored data: the request itself is served
    for s in evil_strings(marker):
        for extra in ({s: 1}, {"x": s}, {"x": pickle.dumps(_OpenOnUnpickle(marker))}):
            reply, _ = ask(transport, msgspec.msgpack.encode([m.PROTOCOL_VERSION, {"type": "health", **extra}]))
            assert isinstance(reply, m.HealthReply)
    assert not os.path.exists(marker)
    assert_still_serves(session)


def test_evil_ids_and_engine_names_are_refused(transport, marker, session):
    doc = msgspec.msgpack.encode({"format": 1, "nodes": [_PH, {"op": "output", "args": [{"$n": "v0"}]}]})
    gid = graph_id(doc, [], [])
    reply, _ = _put_graph(transport, doc)
    assert isinstance(reply, m.Ok)  # a harmless identity graph
    x_meta, x_buf = tensor_to_wire(torch.randn(4), 0)
    for s in evil_strings(marker):
        for body in (m.Run(s, "eager", [m.TensorArg(x_meta)]),
                     m.Run(gid, s, [m.TensorArg(x_meta)]),
                     m.Run(gid, "eager", [m.RefArg(s)]),
                     m.PutGraph(s, doc, [])):
            reply, _ = ask(transport, body, [x_buf])
            assert isinstance(reply, m.ErrorReply), (s, body)
            assert not os.path.exists(marker)
    assert_still_serves(session)


def test_evil_dtype_names_in_tensor_metas_are_refused(transport, marker, session):
    doc = msgspec.msgpack.encode({"format": 1, "nodes": [_PH, {"op": "output", "args": [{"$n": "v0"}]}]})
    gid = graph_id(doc, [], [])
    assert isinstance(_put_graph(transport, doc)[0], m.Ok)
    frame = bytes(16)
    for s in evil_strings(marker):
        meta = m.TensorMeta(s, [4], [1], 0)
        # as an uploaded resident tensor (with its true content id, so it reaches the decoder)
        reply, _ = ask(transport, m.PutTensors([content_id(meta, memoryview(frame))], [meta]), [frame])
        assert isinstance(reply, m.ErrorReply) and reply.kind == "invalid", reply
        # as an inline argument of a run
        reply, _ = ask(transport, m.Run(gid, "eager", [m.TensorArg(meta)]), [frame])
        assert isinstance(reply, m.ErrorReply) and reply.kind == "invalid", reply
        # as a graph constant
        cdoc = _doc([{"op": "const", "index": 0}, {"op": "output", "args": [{"$n": "v0"}]}])
        reply, _ = ask(transport, m.PutGraph(graph_id(cdoc, [meta], [frame]), cdoc, [meta]), [frame])
        assert isinstance(reply, m.ErrorReply), reply
        assert not os.path.exists(marker)
    assert_still_serves(session)


def test_evil_tensor_frames_are_only_data(transport, marker, session):
    """Pickle bytes in tensor frames are stored and returned as bytes, never loaded."""
    doc = msgspec.msgpack.encode({"format": 1, "nodes": [
        {"op": "placeholder", "kind": "tensor", "dtype": "uint8", "shape": ["s0"]},
        {"op": "call", "target": "aten::clone.default", "args": [{"$n": "v0"}], "kwargs": {}},
        {"op": "output", "args": [{"$n": "v1"}]}]})
    gid = graph_id(doc, [], [])
    assert isinstance(_put_graph(transport, doc)[0], m.Ok)
    for name, blob in evil_blobs(marker).items():
        meta = m.TensorMeta("uint8", [len(blob)], [1], 0)
        tid = content_id(meta, memoryview(blob))
        assert isinstance(ask(transport, m.PutTensors([tid], [meta]), [blob])[0], m.Ok), name
        for arg in (m.RefArg(tid), m.TensorArg(meta)):
            reply, frames = ask(transport, m.Run(gid, "eager", [arg]), [blob])
            assert isinstance(reply, m.RunReply), (name, reply)
            assert bytes(frames[0]) == blob  # the bytes came back untouched
        # float32 view of the same bytes, with a length that does not fit: refused as a layout error
        bad = m.TensorMeta("float32", [len(blob)], [1], 0)
        reply, _ = ask(transport, m.PutTensors([content_id(bad, memoryview(blob))], [bad]), [blob])
        assert isinstance(reply, m.ErrorReply) and reply.kind == "invalid"
        reply, frames = ask(transport, m.Echo(), [blob])
        assert isinstance(reply, m.EchoReply) and bytes(frames[0]) == blob
        assert not os.path.exists(marker), name
    assert_still_serves(session)


def test_evil_graph_constants_are_only_data(transport, marker, session):
    blob = evil_blobs(marker)["torch-save"]
    meta = m.TensorMeta("uint8", [len(blob)], [1], 0)
    doc = _doc([{"op": "const", "index": 0}, {"op": "output", "args": [{"$n": "v0"}]}])
    reply, _ = ask(transport, m.PutGraph(graph_id(doc, [meta], [blob]), doc, [meta]), [blob])
    assert isinstance(reply, m.Ok)
    reply, frames = ask(transport, m.Run(graph_id(doc, [meta], [blob]), "eager", []))
    assert isinstance(reply, m.RunReply)
    assert bytes(frames[0]) == blob
    assert not os.path.exists(marker)
    assert_still_serves(session)


def test_evil_session_ids_are_refused(transport, marker, session):
    for s in evil_strings(marker):
        reply, _ = ask(transport, m.Attach(s))
        assert isinstance(reply, m.ErrorReply) and reply.kind == "invalid", s
    for b in evil_blobs(marker).values():
        header = msgspec.msgpack.encode([m.PROTOCOL_VERSION, {"type": "attach", "session_id": b}])
        reply, _ = ask(transport, header)
        assert isinstance(reply, m.ErrorReply) and reply.kind == "protocol"
    assert not os.path.exists(marker)
    assert_still_serves(session)
