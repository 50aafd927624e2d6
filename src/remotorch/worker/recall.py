"""A worker's disk cache taken back for a session that proves it holds the bytes (protocol.md §20).

The client names objects with a possession proof (:mod:`remotorch.codec.possession`) over a
nonce of its session; what the disk keeps and the proof matches is held for the session again,
from memory when another session still holds it, else read from disk and checked against its id.
"""

from __future__ import annotations

import hmac

from ..codec import possession
from ..errors import InvalidRequestError
from .disk import valid_id


def have(worker, session: object, nonce: bytes, graphs: list, tensors: list) -> tuple[list[str], list[str]]:
    """Hold for the session what it proves it has (``[id, bytes, proof]``) and the disk cache
    keeps, checked against its id (tensors read and checked in parallel); the ids now held."""
    bad = [c[0] for c in (*graphs, *tensors) if not valid_id(c[0])]
    if bad:
        raise InvalidRequestError(f"{bad[0][:40]!r} is not a content id (lowercase hex)")
    got_graphs = []
    for key, total, claim in graphs:
        held = _claim(worker, session, nonce, "graphs", key, total, claim)
        read = worker.disk.read_graph(key) if held is None else None
        if read is not None:
            worker._store_graph(session, key, *read, total)
        if held or read is not None:
            got_graphs.append(key)
    held = {t[0]: _claim(worker, session, nonce, "tensors", *t) for t in tensors}
    todo = [(key, total) for key, total, _ in tensors if held[key] is None]
    for (key, total), read in zip(todo, worker.disk.read_tensors([k for k, _ in todo]) if todo else ()):
        if read is not None:
            tensor = worker.reader([memoryview(read[1])]).tensor(read[0]).to(worker.device)
            worker._tensors.put(session, key, tensor, total)
            held[key] = True
    return got_graphs, [key for key, ok in held.items() if ok]


def _claim(worker, session: object, nonce: bytes, kind: str, key: str, total: int, claim: bytes) -> bool | None:
    """True: the session holds the object now (it did, or it was in memory); False: not kept or not
    proven (the client uploads it, as without a cache); None: proven, to be read from disk."""
    store = worker._graphs if kind == "graphs" else worker._tensors
    if not store.missing(session, [key]):
        return True
    found = worker.disk.read_window(kind, key) if worker.disk is not None else None
    if found is None or found[0] != total or not hmac.compare_digest(
            possession.proof(nonce, key, total, found[1]), bytes(claim)):
        return False
    if total > (worker.limits.max_graph_bytes if kind == "graphs" else worker.limits.max_tensor_bytes):
        return False
    worker._reserve(session, total)
    adopted = worker._adopt_graph(session, key) if kind == "graphs" else store.adopt(session, key)
    return True if adopted else None  # still in memory: a graph's engines too
