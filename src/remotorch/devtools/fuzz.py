"""Malformed messages for hardening tests and ``benchmarks/fuzz.py`` (a debug helper that ships).

:func:`malformed` yields requests that a hostile or broken client could send
after authenticating: random bytes, mutated valid envelopes, well-typed
messages with hostile values (sizes, strides, frame indices, ids, graph
documents, subgraphs of higher-order operators among them: see
:mod:`~remotorch.devtools.subgraph_docs`; loads and saves of weights under
hostile names) and random frames.
:func:`framing_garbage` yields byte strings that
break the framing itself. Everything is drawn from a seeded ``random.Random``,
so a failure replays from its seed. Nothing here knows about sockets.
"""

from __future__ import annotations

import hashlib
import random
import string
from collections.abc import Iterator

import msgspec

from ..codec import messages as m
from . import subgraph_docs

_TYPES = ["health", "put_graph", "put_tensors", "run", "echo", "attach", "heartbeat", "detach",
          "ok", "error", "run_reply", "health_reply", "nope", ""]
_DTYPES = ["float32", "int64", "bool", "complex128", "float8_e5m2", "float", "", "object", "__class__"]
_TARGETS = ["aten::add.Tensor", "aten::from_file.default", "aten::save.default", "builtins:eval", "os:system",
            "op:getitem", "aten::nope.default", "aten::add", "aten::add.Tensor.extra", "math:ceil", "", 7,
            "hop:cond", "hop:while_loop", "hop:invoke_subgraph", "hop:flex_attention"]


def _value(rng: random.Random, depth: int = 0):
    """A random msgpack-able value, hostile sizes and types included."""
    pick = rng.randrange(12 if depth < 3 else 8)
    if pick == 0:
        return None
    if pick == 1:
        return rng.choice([True, False])
    if pick == 2:
        return rng.choice([0, -1, 1, 2**31, -2**63, 2**64 - 1, rng.randrange(-1000, 1000)])
    if pick == 3:
        return rng.choice([0.0, -0.0, 1e308, float("nan"), float("inf"), rng.random()])
    if pick == 4:
        return "".join(rng.choice(string.printable) for _ in range(rng.randrange(0, 40)))
    if pick == 5:
        return rng.randbytes(rng.randrange(0, 64))
    if pick == 6:
        return rng.choice(["$n", "v0", "__import__('os')", "cos.system", "0" * 64])
    if pick == 7:
        return rng.choice(_DTYPES)
    if pick in (8, 9):
        return [_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    return {rng.choice(["$n", "$t", "$dt", "$dev", "$c", "$g", "$d", "type", "op", "x", "args"]):
            _value(rng, depth + 1)
            for _ in range(rng.randrange(0, 4))}


def _meta(rng: random.Random, frames: int) -> list:
    rank = rng.choice([0, 1, 2, 3, 65, 200])
    return [rng.choice(_DTYPES), [_size(rng) for _ in range(rank)], [_size(rng) for _ in range(rank)],
            rng.choice([0, 1, frames, frames + 1, -1, 2**40])]


def _size(rng: random.Random) -> int:
    return rng.choice([0, 1, 2, 3, 7, -1, 2**31, 2**62, 2**63 - 1])


def _id(rng: random.Random) -> str:
    return rng.choice(["0" * 64, "f" * 64, rng.randbytes(32).hex(), "", "../../x", "a" * 10_000,
                       "".join(rng.choice(string.printable) for _ in range(64))])


def _doc(rng: random.Random) -> bytes:
    """A graph document: valid-looking, broken in one or more places; one in four has subgraphs."""
    if rng.random() < 0.25:
        return msgspec.msgpack.encode(subgraph_docs.mutated(rng))
    nodes = [{"op": "placeholder", "kind": rng.choice(["tensor", "scalar", "any", "x"]),
              "dtype": rng.choice(_DTYPES), "shape": [rng.choice([2, "s0", -1, None])]}]
    for i in range(rng.randrange(0, 6)):
        nodes.append({"op": rng.choice(["call", "call", "const", "get_attr", "call_module"]),
                      "target": rng.choice(_TARGETS), "index": rng.choice([0, 5, -1]),
                      "args": [{"$n": f"v{rng.randrange(-1, i + 3)}"}, _value(rng)],
                      "kwargs": rng.choice([{}, {"alpha": 2}, {"__class__": 1}, {"a b": 1}, []])})
    if rng.random() < 0.8:
        nodes.append({"op": "output", "args": [{"$n": f"v{rng.randrange(0, len(nodes) + 1)}"}]})
    if rng.random() < 0.2:
        rng.shuffle(nodes)
    return msgspec.msgpack.encode({"format": rng.choice([1, 1, 1, 2, "1"]), "nodes": nodes})


_NAMES = ["w/tiny.safetensors", "w/tiny", "w/../x", "w/%2e%2e/x", "/etc/passwd", "w//x", "w/./x", "w\\x",
          "w/a\0b", "w/escape", "ck/out", "ck/../w", "ck/out/optimizer.safetensors", "nope/x", "", "w",
          "w/" + "a" * 3000, "ck/" + "/".join(["d"] * 40), "w/org/repo", "w/tiny/../../x"]


def _weights_body(rng: random.Random, frames: int) -> dict:
    """A load or save under hostile names, keys, handles and specs (protocol.md §22)."""
    kind = rng.choice(["open_weights", "load_weights", "save_weights", "save_optim", "load_optim"])
    body = {"type": kind, "revision": rng.choice(["", "main", "../../x", "0" * 40, "%00", 5])}
    name = rng.choice(_NAMES)
    if kind in ("open_weights", "load_weights", "load_optim"):
        body["source"] = name
    else:
        body["target"] = name
    n = rng.randrange(0, 4)
    keys = [rng.choice(["w", "", "__metadata__", "x" * 2000, "a\0", "w"]) for _ in range(n)]
    if kind == "load_weights":
        body.update(keys=keys, handles=[rng.choice([1, 1, 0, -1, 2**62, "1"]) for _ in range(rng.choice([n, n + 1]))],
                    specs=[[rng.choice(_DTYPES), [_size(rng) for _ in range(rng.choice([0, 1, 2, 70]))]]
                           for _ in range(rng.choice([n, n + 1]))])
    elif kind == "save_weights":
        body.update(keys=keys, values=[rng.choice([["h", rng.choice([1, 10**9, -1])], ["p", 3], ["r", _id(rng)],
                                                   ["t", _meta(rng, frames)], ["v", 1, [2], [1], 2**62]])
                                       for _ in range(rng.choice([n, n + 1]))],
                    config=rng.choice(["", "{}", "[1]", "{", "\x00"]),
                    max_shard_bytes=rng.choice([1, 0, -1, 2**40]), metadata=rng.choice([{}, {"a": "b"}, {"a": 1}]))
    elif kind in ("save_optim", "load_optim"):
        body["optim"] = rng.choice([1, 0, -1, 2**63])
    return body


def _fitting_meta(rng: random.Random, frame: bytes, index: int) -> list:
    """A meta that fits its frame (so checks past the layout are reached), or nearly."""
    n = len(frame)
    return rng.choice([["uint8", [n], [1], index], ["uint8", [1, n], [n, 1], index],
                       ["float32", [n // 4], [1], index], ["int64", [n // 8, 1], [1, 1], index],
                       ["bool", [n], [1], index], ["uint8", [n + 1], [1], index]])


def _graph_id(doc: bytes, consts: list, frames: list[bytes]) -> str:
    h = hashlib.sha256(doc)  # as remotorch.codec.graph.graph_id, on raw metas
    for meta, buf in zip(consts, frames):
        h.update(msgspec.msgpack.encode(meta))
        h.update(buf)
    return h.hexdigest()


def _tensor_id(meta: list, buf: bytes) -> str:
    return hashlib.sha256(f"{meta[0]}|{meta[1]}|{meta[2]}|".encode() + buf).hexdigest()


def _body(rng: random.Random, frame_list: list[bytes]) -> dict:
    frames = len(frame_list)
    kind = rng.choice(["put_graph", "put_graph", "put_tensors", "put_tensors", "run", "attach", "random",
                       "weights"])
    if kind == "weights":
        return _weights_body(rng, frames)
    if kind == "put_graph":
        doc = _doc(rng)
        if rng.random() < 0.7:  # the right id and constants: the document reaches the decoder
            consts = [_fitting_meta(rng, f, i) for i, f in enumerate(frame_list)]
            return {"type": "put_graph", "graph_id": _graph_id(doc, consts, frame_list), "doc": doc,
                    "consts": consts}
        return {"type": "put_graph", "graph_id": _id(rng), "doc": doc,
                "consts": [_meta(rng, frames) for _ in range(rng.randrange(0, 3))]}
    if kind == "put_tensors":
        if rng.random() < 0.6 and frame_list:  # right ids: the layout checks are reached
            metas = [_fitting_meta(rng, f, i) if rng.random() < 0.7 else _meta(rng, frames)
                     for i, f in enumerate(frame_list)]
            ids = [_tensor_id(mt, frame_list[mt[3]]) if isinstance(mt[3], int) and 0 <= mt[3] < frames
                   else _id(rng) for mt in metas]
            return {"type": "put_tensors", "ids": ids, "metas": metas}
        n = rng.randrange(0, 4)
        return {"type": "put_tensors", "ids": [_id(rng) for _ in range(n)],
                "metas": [_meta(rng, frames) for _ in range(rng.choice([n, n + 1]))]}
    if kind == "run":
        args = [rng.choice([["t", _meta(rng, frames)], ["r", _id(rng)], ["s", _value(rng)], ["x", 1], []])
                for _ in range(rng.randrange(0, 5))]
        body = {"type": "run", "graph_id": _id(rng), "engine": rng.choice(["eager", "inductor", "", "os"]),
                "args": args}
        for field in ("bind", "bound"):  # argument bindings (protocol.md §8.1), in range and not
            if rng.random() < 0.3:
                body[field] = rng.choice([1, 2, 4096, 4097, 0, -1, 2**63, "1", None])
        return body
    if kind == "attach":
        return {"type": "attach", "session_id": rng.choice([_id(rng), 5, None])}
    return {rng.choice(["type", "graph_id", "doc"]): _value(rng) for _ in range(rng.randrange(0, 5))} | \
        {"type": rng.choice(_TYPES)}


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(4)
        if op == 0 and b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            del b[rng.randrange(len(b)):]
        elif op == 2:
            i = rng.randrange(len(b) + 1)
            b[i:i] = rng.randbytes(rng.randrange(1, 8))
        elif b:
            b[rng.randrange(len(b))] = rng.choice([0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xDC, 0xDE, 0xFF])
    return bytes(b)


def malformed(rng: random.Random) -> tuple[bytes, list[bytes]]:
    """One malformed request: (frame 0, buffer frames). It may, rarely, be valid by chance."""
    frames = [rng.randbytes(rng.choice([0, 1, 4, 8, 24, 100, 4096])) for _ in range(rng.randrange(0, 4))]
    style = rng.randrange(5)
    if style == 0:
        header = rng.randbytes(rng.randrange(0, 200))
    elif style == 1:
        header = _mutate(rng, msgspec.msgpack.encode([m.PROTOCOL_VERSION, _body(rng, frames)]))
    elif style == 2:
        header = msgspec.msgpack.encode([rng.choice([m.PROTOCOL_VERSION, 0, 2, -1, "1", None]),
                                         _body(rng, frames)])
    else:
        header = msgspec.msgpack.encode([m.PROTOCOL_VERSION, _body(rng, frames)])
    return header, frames


def framing_garbage(rng: random.Random, seq: int) -> bytes:
    """Bytes that break the framing after a successful handshake (the worker closes the connection)."""
    import struct

    from ..transport.framing import MAGIC

    style = rng.randrange(5)
    if style == 0:
        return rng.randbytes(rng.randrange(1, 300))
    if style == 1:  # bad magic, plausible rest
        return struct.pack("<4sQI", rng.randbytes(4), seq, 1) + rng.randbytes(40)
    if style == 2:  # frame count out of range
        return struct.pack("<4sQI", MAGIC, seq, rng.choice([0, 65_537, 2**32 - 1]))
    if style == 3:  # lengths over any limit
        return struct.pack("<4sQI", MAGIC, seq, 2) + struct.pack("<2Q", 2**63, 2**64 - 1)
    return struct.pack("<4sQI", MAGIC, seq, 1) + struct.pack("<Q", 8) + rng.randbytes(40)  # bad MAC


def stream(seed: int, n: int) -> Iterator[tuple[bytes, list[bytes]]]:
    """``n`` malformed requests from ``seed``."""
    rng = random.Random(seed)
    for _ in range(n):
        yield malformed(rng)
