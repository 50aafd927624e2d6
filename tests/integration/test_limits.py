"""Quotas and limits on a real worker: typed errors, cached objects evicted first, the worker keeps serving."""

from __future__ import annotations

import functools
import socket
import struct
import time
import warnings

import pytest
import torch

import remotorch
from remotorch import errors
from remotorch.codec import messages as m
from remotorch.codec.tensors import content_id, tensor_to_wire
from remotorch.transport import TcpTransport, framing, handshake

from conftest import TOKEN, spawn_server, wait_until

MiB = 1 << 20
REQUEST_TIMEOUT = 1.0  # far above what any other graph here needs, even on a loaded host
MESSAGE_TIMEOUT = 2.0
HOLD = 60.0  # the hold engine's graph: in flight far longer than the request timeout, on any machine
HOLDING = "hold engine: holding a graph run"  # what the worker logs as each hold begins
LIMIT_ARGS = ("--memory-quota", "1M", "--memory-limit", "3M", "--cache-bytes", "2M",
              "--max-message-bytes", "4M", "--max-graph-bytes", "256K", "--max-tensor-bytes", "2M",
              "--request-timeout", str(REQUEST_TIMEOUT), "--message-timeout", str(MESSAGE_TIMEOUT),
              "--engines", f"eager,hold:{HOLD:g}")


@pytest.fixture(scope="module")
def limited(start_module_server):
    return start_module_server(name="limited", extra_args=LIMIT_ARGS)


@pytest.fixture
def sessions(session_for, limited):
    """Factory for sessions to the limited worker (closed after the test, which fails if the worker died)."""
    return functools.partial(session_for, limited)


def put(session: remotorch.Session, *tensors: torch.Tensor) -> list[str]:
    """Upload tensors as residents of this session; returns their ids."""
    metas, frames, ids = [], [], []
    for t in tensors:
        meta, buf = tensor_to_wire(t, len(frames))
        metas.append(meta)
        frames.append(buf)
        ids.append(content_id(meta, buf))
    session.connection.request(m.PutTensors(ids, metas), frames)
    return ids


def weights(mib: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(int(mib * MiB) // 4, generator=g)


def check_serving(session: remotorch.Session) -> None:
    compiled = remotorch.compile(lambda a: a * 2 + 1, session=session, fallback="raise")
    x = torch.randn(7)
    assert torch.equal(compiled(x), x * 2 + 1)


# ----------------------------------------------------------------------- quota
def test_session_over_its_quota_gets_quota_exceeded(sessions):
    s = sessions()
    torch.manual_seed(0)
    big = torch.nn.Linear(600, 600).eval()  # 1.44 MB of weights, quota is 1 MiB
    compiled = remotorch.compile(big, session=s, fallback="raise")
    with pytest.raises(errors.QuotaExceededError, match="quota") as info, torch.no_grad():
        compiled(torch.randn(2, 600))
    assert isinstance(info.value, errors.LimitExceededError)
    assert s.health()["resident_bytes"] == 0  # refused whole: nothing of it was stored
    check_serving(s)  # the same session still works under its quota


def test_quota_with_local_fallback_runs_locally(sessions):
    s = sessions()
    torch.manual_seed(1)
    big = torch.nn.Linear(600, 600).eval()
    compiled = remotorch.compile(big, session=s, fallback="local")
    x = torch.randn(2, 600)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        assert torch.equal(compiled(x), big(x))
    assert any(issubclass(w.category, errors.RemoteFallbackWarning) and "QuotaExceeded" in str(w.message)
               for w in caught)


def test_quota_counts_shared_content_in_full_for_each_session(sessions):
    a, b = sessions(), sessions()
    shared = weights(0.6, seed=2)
    put(a, shared)
    put(b, shared)  # b holds the same bytes: within its own quota, whatever a holds
    put(b, weights(0.3, seed=3))
    with pytest.raises(errors.QuotaExceededError):
        put(a, weights(0.6, seed=4))  # a would hold 1.2 MiB
    put(a, weights(0.3, seed=5))  # but this fits


# -------------------------------------------------- worker memory limit and eviction
def test_cached_objects_no_session_uses_are_evicted_first(sessions):
    observer = sessions()
    base = observer.health()
    assert base["resident_bytes"] == 0, "another test left residents behind"
    leaver = sessions()
    put(leaver, weights(0.9, seed=10))
    leaver.close()  # Detach: freed now, kept in the cache for whoever uploads the same bytes
    assert wait_until(lambda: observer.health()["cached_bytes"] >= weights(0.9, 0).nbytes)

    holders = [sessions() for _ in range(3)]
    for i, s in enumerate(holders):  # 2.7 MiB held + 0.9 MiB cached > 3 MiB: the cache goes first
        put(s, weights(0.9, seed=20 + i))
    health = observer.health()
    assert health["resident_bytes"] == 3 * weights(0.9, 0).nbytes
    assert health["cached_bytes"] < weights(0.9, 0).nbytes  # the cached tensor is gone

    with pytest.raises(errors.QuotaExceededError, match="memory limit"):
        put(sessions(), weights(0.9, seed=30))  # nothing cached is left to evict
    for s in holders:
        check_serving(s)


def test_reuploaded_bytes_are_adopted_from_the_cache(sessions):
    observer = sessions()
    first = sessions()
    w = weights(0.5, seed=40)
    put(first, w)
    first.close()
    assert wait_until(lambda: observer.health()["cached_bytes"] >= w.nbytes)
    cached = observer.health()["cached_bytes"]
    again = sessions()
    put(again, w)  # the same bytes, sent again (ids are verified), now held by this session
    health = observer.health()
    assert health["cached_bytes"] == cached - w.nbytes
    assert health["resident_bytes"] == w.nbytes


# ------------------------------------------------------------------ size limits
def test_message_size_limits(limited):
    transport = TcpTransport(limited.url, TOKEN, protocol=m.PROTOCOL_VERSION, timeout=30)
    try:
        header, _ = transport.request(m.encode(m.Echo()), [bytes(3 * MiB), bytes(3 * MiB)])
        reply = m.decode(header)  # each frame fits, the message (6 MiB) does not
        assert isinstance(reply, m.ErrorReply) and reply.kind == "limit"
        header, out = transport.request(m.encode(m.Echo()), [b"still here"])
        assert bytes(out[0]) == b"still here"  # same connection, still serving

        try:  # one frame over the limit: a protocol error, then the worker closes the connection
            header, _ = transport.request(m.encode(m.Echo()), [bytes(5 * MiB)])
        except (errors.ProtocolError, errors.WorkerUnavailableError):
            pass  # the worker closed before the client read its answer
        else:
            reply = m.decode(header)
            assert isinstance(reply, m.ErrorReply) and reply.kind == "protocol", reply
            with pytest.raises(errors.WorkerUnavailableError):
                transport.request(m.encode(m.Health()))  # and the connection is gone
    finally:
        transport.close()


def _peak_rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_a_message_over_the_total_limit_is_refused_without_holding_it(limited):
    """16 frames of 4 MiB each pass the per-frame bound (4 MiB) but total 64 MiB against 4 MiB:
    the worker reads them through its read buffer and drops them (its peak memory does not grow
    by the message), answers LimitExceeded, and the connection goes on."""
    transport = TcpTransport(limited.url, TOKEN, protocol=m.PROTOCOL_VERSION, timeout=60)
    try:
        transport.request(m.encode(m.Echo()), [b"warm"])
        peak = _peak_rss(limited.proc.pid)
        frame = bytes(4 * MiB)
        header, out = transport.request(m.encode(m.Echo()), [frame] * 16)
        reply = m.decode(header)
        assert isinstance(reply, m.ErrorReply) and reply.kind == "limit", reply
        assert "67108" in reply.message and "4194304" in reply.message
        assert out == []
        assert _peak_rss(limited.proc.pid) - peak < 16 * MiB
        header, out = transport.request(m.encode(m.Echo()), [b"still here"])
        assert bytes(out[0]) == b"still here"
    finally:
        transport.close()


def test_tensor_and_graph_size_limits(limited, sessions):
    s = sessions()
    with pytest.raises(errors.LimitExceededError, match="tensor of"):
        put(s, weights(3, seed=50))  # 3 MiB tensor, limit 2 MiB (message limit 4 MiB)
    big_doc = b"\x00" * (300 << 10)
    gid = remotorch.codec.graph.graph_id(big_doc, [], [])
    with pytest.raises(errors.LimitExceededError, match="graph of"):
        s.connection.request(m.PutGraph(gid, big_doc, []))
    compiled = remotorch.compile(lambda a: a.sum(0), session=s, fallback="raise")
    with pytest.raises(errors.LimitExceededError):
        compiled(torch.randn(3 * MiB // 4 // 8, 8))  # an inline argument over the tensor limit
    check_serving(s)


# ------------------------------------------------------------------ time limit
def test_graph_over_the_request_timeout_is_stopped(limited, sessions):
    s = sessions(timeout=HOLD * 2)
    compiled = remotorch.compile(lambda a: a * 2, session=s, engine=f"hold:{HOLD:g}", fallback="raise")
    held = limited.stderr_text().count(HOLDING)
    start = time.monotonic()
    with pytest.raises(errors.RequestTimeoutError, match="request timeout"):
        compiled(torch.randn(8))
    took = time.monotonic() - start
    assert limited.stderr_text().count(HOLDING) == held + 1  # the graph ran, and was being held
    assert REQUEST_TIMEOUT <= took < HOLD / 2  # stopped at the timeout, long before the hold's end
    check_serving(s)


# ---------------------------------------------------------------- out of memory
def test_out_of_memory_in_a_graph_is_an_error_reply(make_session):
    # on the shared worker, which has no request timeout: the refused
    # allocation is fast, but a loaded host can stall any process for longer
    # than a request timeout, which would make this a timeout instead
    s = make_session()

    def hungry(x):
        return torch.ones(1 << 42) .sum() + x  # 16 TiB: the allocator refuses

    compiled = remotorch.compile(hungry, session=s, fallback="raise")
    with pytest.raises(errors.RemoteOutOfMemoryError, match="out of memory"):
        compiled(torch.randn(3))
    check_serving(s)


def test_memory_error_receiving_a_huge_frame_drops_only_that_connection(server, session):
    """A frame of 200 GiB passes the default frame limit; allocating it fails with MemoryError."""
    import socket

    sock = socket.create_connection((server.host, server.port), timeout=30)
    with sock:
        key = handshake.client_handshake(sock, TOKEN.encode(), m.PROTOCOL_VERSION)
        header = m.encode(m.Echo())
        fixed = struct.pack("<4sQI", framing.MAGIC, 0, 2) + struct.pack("<2Q", len(header), 200 << 30)
        sock.sendall(fixed + header + b"x" * 1000)  # the MAC would come after the frames
        sock.settimeout(30)
        try:
            assert sock.recv(1) == b""  # closed, no answer
        except ConnectionResetError:
            pass
    assert server.alive()
    assert session.health()["name"] == "test"


def still_open(sock: socket.socket) -> bool:
    """Whether the peer has not closed this connection (it has sent us nothing): a non-blocking peek."""
    timeout = sock.gettimeout()
    sock.setblocking(False)  # with a timeout set, recv would first wait for data
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except ConnectionResetError:
        return False
    finally:
        sock.settimeout(timeout)


@pytest.mark.parametrize("stall", ["prefix", "large frame"])
def test_a_stalled_message_holds_up_nobody_and_is_dropped_after_the_message_timeout(limited, sessions, stall):
    """Reads never block the serving loop: others are served while a peer sits mid-message.

    Had the loop waited on the stalled read, the other session's requests would
    be answered only once the stalled connection was dropped; they are
    answered while it is still open, however slow the host.
    """
    s = sessions()
    assert s.health()["name"] == "limited"
    sock = socket.create_connection((limited.host, limited.port), timeout=30)
    with sock:
        key = handshake.client_handshake(sock, TOKEN.encode(), m.PROTOCOL_VERSION)
        if stall == "prefix":
            sock.sendall(framing.MAGIC + b"\x00" * 6)  # the start of a prefix, and then nothing
        else:  # a whole header and half of a 64 KiB frame, and then nothing
            send_key, _ = framing.direction_keys(key, "client")
            message = b"".join(bytes(p) for p in framing.encode_message(
                send_key, 0, m.encode(m.Echo()), [b"\x07" * (64 << 10)]))
            sock.sendall(message[:len(message) // 2])
        stalled_at = time.monotonic()
        time.sleep(0.1)  # the worker has read what there is
        for _ in range(5):
            assert s.health()["name"] == "limited"
        assert still_open(sock)  # all served before the stalled connection's timeout
        sock.settimeout(MESSAGE_TIMEOUT * 10)
        try:
            assert sock.recv(1) == b""  # then the stalled connection is closed
        except ConnectionResetError:
            pass
        assert time.monotonic() - stalled_at >= MESSAGE_TIMEOUT * 0.9
    assert s.health()["name"] == "limited"


def test_a_reply_nobody_reads_holds_up_nobody_and_is_dropped_after_the_message_timeout():
    """Writes never block the serving loop either: a 32 MiB reply its client does not read waits on
    its own connection while others are served, and the connection is dropped once it took nothing
    for the message timeout."""
    dropped = "a reply waited to be read"  # what the worker logs when it drops the connection
    srv = spawn_server(name="writer", extra_args=("--message-timeout", str(MESSAGE_TIMEOUT)))
    try:
        with remotorch.Session(srv.url, token=TOKEN) as s:
            assert s.health()["name"] == "writer"
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, never read
            sock.settimeout(30)
            sock.connect((srv.host, srv.port))
            with sock:
                key = handshake.client_handshake(sock, TOKEN.encode(), m.PROTOCOL_VERSION)
                send_key, _ = framing.direction_keys(key, "client")
                size = 32 << 20
                for part in framing.encode_message(send_key, 0, m.encode(m.Echo()), [bytes(size)]):
                    sock.sendall(part)
                asked_at = time.monotonic()
                time.sleep(0.2)  # the worker has the request and is stuck writing the reply
                for _ in range(5):
                    assert s.health()["name"] == "writer"
                    assert s.echo([b"ok"])[0].tobytes() == b"ok"
                assert dropped not in srv.stderr_text()  # all served before the stuck reply's timeout
                # nothing read for longer than the message timeout: dropped
                assert wait_until(lambda: dropped in srv.stderr_text(), timeout=MESSAGE_TIMEOUT * 10)
                assert time.monotonic() - asked_at >= MESSAGE_TIMEOUT * 0.9
                got = 0
                try:
                    while chunk := sock.recv(1 << 20):
                        got += len(chunk)
                except ConnectionResetError:
                    pass
                assert got < size  # the connection ended before the reply was all sent
            assert s.health()["name"] == "writer"
    finally:
        srv.stop()
    assert srv.proc.returncode is not None
