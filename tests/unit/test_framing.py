"""The framing's MAC over every layout of buffer frames, on a real socket pair.

Large buffer frames are tagged per 256 KiB chunk (AES-GMAC, nonce = seq and
the chunk's index in the message) and the tags go into the message's HMAC
(docs/protocol.md §4.2). These tests send messages whose frames straddle
every chunk boundary, deliver them whole or a few bytes at a time (the
worker's non-blocking assembly), and check that any changed byte, any
swapped chunk and any replay is refused, and that an over-limit message is
still authenticated before it is refused as too large.
"""

from __future__ import annotations

import select
import socket
import threading

import numpy as np
import pytest

from remotorch.transport import framing
from remotorch.transport.framing import AuthFailed, FramedChannel, MessageTooLarge

KEY = b"s" * 32
C = framing._CHUNK
BUILT = framing._C is not None
# Every test runs on both framings: the pure-Python one and the compiled hot path (_cframing.c).
IMPLS = [pytest.param(False, id="python"),
         pytest.param(True, id="compiled", marks=pytest.mark.skipif(not BUILT, reason="_cframing not built"))]
COMPILED = [False]  # the framing the current test's channels use


@pytest.fixture(autouse=True, params=IMPLS)
def impl(request):
    COMPILED[0] = request.param
    yield request.param
    COMPILED[0] = False


def channel(sock, role, **kw):
    kw.setdefault("max_frame", 1 << 30)
    kw.setdefault("max_header", 1 << 20)
    return FramedChannel(sock, KEY, role=role, compiled=COMPILED[0], **kw)

LAYOUTS = {
    "none": [],
    "small": [100, 0, 7],
    "inline limit": [framing.INLINE_MAC],
    "just over": [framing.INLINE_MAC + 1],
    "one chunk": [C],
    "chunk - 1": [C - 1],
    "chunk + 1": [C + 1],
    "three chunks and a bit": [3 * C + 5],
    "several": [C + 3, 0, 17, 2 * C, framing.INLINE_MAC + 1],
}


def pair(max_message=None):
    a, b = socket.socketpair()
    sender = channel(a, "client")
    receiver = channel(b, "server", max_message=max_message)
    return sender, receiver


def frames_of(sizes):
    rng = np.random.default_rng(len(sizes) + sum(sizes))
    return [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]


def wire_bytes(sizes, seq_messages=1):
    """The bytes of ``seq_messages`` messages with these frames, as a client sends them (seq 0, 1, …)."""
    send_key, _ = framing.direction_keys(KEY, "client")
    return [b"".join(bytes(memoryview(p).cast("B")) for p in framing.encode_message(send_key, seq, b"hdr",
                                                                                    frames_of(sizes)))
            for seq in range(seq_messages)]


def receive_all(data: bytes, trickle: int | None = None, max_message=None):
    """Feed ``data`` to a server-side channel (at once, or ``trickle`` bytes at a time, non-blocking)."""
    a, b = socket.socketpair()
    receiver = channel(b, "server", max_message=max_message)
    b.setblocking(False)
    got = []
    done = threading.Event()

    def feed():
        step = trickle or len(data)
        for at in range(0, len(data), step):
            a.sendall(data[at:at + step])
        done.set()

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    try:
        while True:
            if not receiver.buffered:
                select.select([b], [], [], 0.2)  # wait for bytes (a bare spin would starve the feeding thread)
            out = receiver.poll()
            if out is not None:
                got.append(out)
                if not receiver.pending and done.is_set():
                    break
            elif done.is_set() and not receiver.pending:
                break
    finally:
        t.join()
        a.close()
        b.close()
    return got


@pytest.mark.parametrize("sizes", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_round_trip_blocking(sizes):
    sender, receiver = pair()
    frames = frames_of(sizes)
    t = threading.Thread(target=lambda: [sender.send(b"hdr", frames) for _ in range(2)])
    t.start()
    for _ in range(2):
        header, got, nbytes = receiver.recv()
        assert header == b"hdr"
        assert [bytes(memoryview(g).cast("B")) for g in got] == frames
        assert nbytes == framing.message_size(b"hdr", frames)
    t.join()


@pytest.mark.parametrize("sizes", [LAYOUTS["chunk + 1"], LAYOUTS["several"]], ids=["chunk + 1", "several"])
def test_round_trip_in_pieces(sizes):
    """A message that arrives a few KiB at a time is assembled across non-blocking polls."""
    data = b"".join(wire_bytes(sizes, 2))
    got = receive_all(data, trickle=3001)
    assert len(got) == 2
    for header, frames, _ in got:
        assert header == b"hdr"
        assert [bytes(memoryview(g).cast("B")) for g in frames] == frames_of(sizes)


@pytest.mark.parametrize("sizes", [LAYOUTS["just over"], LAYOUTS["three chunks and a bit"], LAYOUTS["several"]],
                         ids=["just over", "three chunks", "several"])
def test_any_changed_byte_fails(sizes):
    (data,) = wire_bytes(sizes)
    body_start = len(data) - framing.MAC_SIZE - sum(sizes)
    # and the start, the middle and the end of every chunk of every frame
    spots = {body_start - 1, len(data) - 1}  # the last byte of the header, of the MAC
    at = body_start
    for n in sizes:
        for c in range(0, n, C):
            end = at + min(n, c + C)
            spots.update({at + c, at + (c + min(n, c + C)) // 2, end - 1})
        at += n
    for spot in sorted(s for s in spots if 0 < s < len(data)):
        bad = bytearray(data)
        bad[spot] ^= 0x40
        with pytest.raises(AuthFailed):
            receive_all(bytes(bad))


def test_swapped_chunks_fail():
    """Two chunks of the same message swapped: each tag is bound to the chunk's position."""
    (data,) = wire_bytes([2 * C])
    start = len(data) - framing.MAC_SIZE - 2 * C
    first, second = data[start:start + C], data[start + C:start + 2 * C]
    assert first != second
    swapped = data[:start] + second + first + data[start + 2 * C:]
    with pytest.raises(AuthFailed):
        receive_all(swapped)


def test_replayed_message_fails():
    first, _ = wire_bytes([C + 1], 2)
    with pytest.raises(AuthFailed, match="sequence"):
        receive_all(first + first)


def test_over_limit_message_is_authenticated_then_refused():
    """Over the receiver's total: read in chunks through a scratch buffer and tagged, then MessageTooLarge
    (the stream stays in step); the same message with a changed byte is AuthFailed instead."""
    sizes = [2 * C + 9, 5, C]
    (data,) = wire_bytes(sizes)
    with pytest.raises(MessageTooLarge):
        receive_all(data, trickle=70_001, max_message=C)
    bad = bytearray(data)
    bad[len(data) - framing.MAC_SIZE - C - 3] ^= 1  # a byte of the second frame
    with pytest.raises(AuthFailed):
        receive_all(bytes(bad), trickle=70_001, max_message=C)


def test_keys_differ_per_direction():
    """A message sent client-to-server does not verify as server-to-client (GMAC keys per direction too)."""
    (data,) = wire_bytes([framing.INLINE_MAC + 1])  # tagged, and small enough for the socket's buffer
    a, b = socket.socketpair()
    wrong_way = channel(b, "client")
    try:
        a.sendall(data)
        with pytest.raises(AuthFailed):
            wrong_way.recv()
    finally:
        a.close()
        b.close()


def test_random_layouts_round_trip():
    rng = np.random.default_rng(7)
    for _ in range(6):
        sizes = [int(x) for x in rng.choice([0, 1, 999, C - 1, C, C + 1, 3 * C + 77], size=rng.integers(1, 4))]
        data = b"".join(wire_bytes(sizes, 1))
        (got,) = receive_all(data, trickle=int(rng.integers(1000, 200_000)))
        assert [bytes(memoryview(g).cast("B")) for g in got[1]] == frames_of(sizes)


# --------------------------------------------- the two framings against each other
def test_the_compiled_framing_is_built_where_it_can_be():
    """scripts/setup.sh builds _cframing wherever a C compiler and OpenSSL's headers are (as here)."""
    import os
    import shutil
    import sysconfig

    if os.environ.get("REMOTORCH_FRAMING", "").lower() == "python":
        pytest.skip("REMOTORCH_FRAMING=python turns the compiled framing off")
    can_build = (shutil.which(sysconfig.get_config_var("CC").split()[0] if sysconfig.get_config_var("CC") else "cc")
                 and os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
                 and os.path.exists("/usr/include/openssl/evp.h"))
    if not can_build:
        pytest.skip("no C compiler, Python headers or OpenSSL headers here: the pure-Python framing is used")
    assert BUILT
    a, b = socket.socketpair()
    try:
        assert FramedChannel(a, KEY, role="client", max_frame=1, max_header=1).compiled  # the default
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(not BUILT, reason="_cframing not built")
@pytest.mark.parametrize("sizes", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_the_two_framings_send_the_same_bytes(sizes, impl):
    """What either framing sends is byte for byte framing.encode_message's, and the other one reads it
    (``impl`` receives; the other one sends)."""
    sender_compiled = not impl
    a, b = socket.socketpair()
    tap_a, tap_b = socket.socketpair()
    sender = FramedChannel(a, KEY, role="client", max_frame=1 << 30, max_header=1 << 20, compiled=sender_compiled)
    receiver = FramedChannel(tap_b, KEY, role="server", max_frame=1 << 30, max_header=1 << 20, compiled=impl)
    frames = frames_of(sizes)
    want = b"".join(wire_bytes(sizes, 2))
    got = bytearray()

    def relay():  # what the sender writes, recorded and passed on
        while len(got) < len(want):
            piece = b.recv(1 << 20)
            if not piece:
                break
            got.extend(piece)
            tap_a.sendall(piece)

    t = threading.Thread(target=relay, daemon=True)
    t.start()
    sent = []
    s = threading.Thread(target=lambda: sent.extend(sender.send(b"hdr", frames) for _ in range(2)))
    s.start()
    try:
        for _ in range(2):
            header, out, nbytes = receiver.recv()
            assert header == b"hdr" and [bytes(memoryview(g).cast("B")) for g in out] == frames
        s.join()
        t.join()
        assert bytes(got) == want
        assert sent == [len(want) // 2] * 2 == [framing.message_size(b"hdr", frames)] * 2
    finally:
        for x in (a, b, tap_a, tap_b):
            x.close()


def test_received_frames_are_writable_buffers_of_their_own():
    sender, receiver = pair()
    for sizes in ([5, 0], [C + 3]):
        frames = frames_of(sizes)
        sender.send(b"h", frames) if sum(sizes) < 100_000 else threading.Thread(
            target=sender.send, args=(b"h", frames)).start()
        _, got, _ = receiver.recv()
        for g, want in zip(got, frames):
            arr = np.frombuffer(g, dtype=np.uint8)
            assert arr.flags.writeable and bytes(arr) == want
            if len(want):
                arr[0] ^= 1  # writing one frame changes nothing else
                assert bytes(memoryview(g)[:1]) != want[:1]


def test_progress_adds_up_to_the_message():
    a, b = socket.socketpair()
    sender, receiver = channel(a, "client"), channel(b, "server")
    frames = frames_of([3 * C + 5, 10])
    steps = []
    t = threading.Thread(target=lambda: sender.send(b"h", frames, steps.append))
    t.start()
    receiver.recv()
    t.join()
    assert steps and sum(steps) == framing.message_size(b"h", frames)


def test_recv_times_out_with_the_sockets_timeout():
    a, b = socket.socketpair()
    receiver = channel(b, "server")
    b.settimeout(0.05)
    with pytest.raises(TimeoutError):
        receiver.recv()
    b.setblocking(False)
    with pytest.raises(BlockingIOError):  # a non-blocking socket: recv does not wait
        receiver.recv()
    assert receiver.poll() is None


def test_a_blocked_send_times_out_and_a_queued_one_goes_out_as_the_peer_reads():
    """A non-blocking socket: send() waits up to send_timeout; queue()/flush() write what fits, then the rest."""
    a, b = socket.socketpair()
    sender = channel(a, "server", send_timeout=0.1)
    receiver = channel(b, "client")
    a.setblocking(False)
    big = frames_of([8 * C])
    with pytest.raises(TimeoutError):
        sender.send(b"h", big)  # nobody reads: the socket's buffer fills
    assert not sender.sending
    a2, b2 = socket.socketpair()
    sender, receiver = channel(a2, "server", send_timeout=5.0), channel(b2, "client")
    a2.setblocking(False)
    size = sender.queue(b"h", big)
    assert size == framing.message_size(b"h", big)
    assert not sender.flush() and sender.sending  # more than the socket takes at once
    with pytest.raises(RuntimeError):
        sender.queue(b"again")
    got = []
    t = threading.Thread(target=lambda: got.append(receiver.recv()))
    t.start()
    while not sender.flush():
        select.select([], [a2], [], 1.0)
    t.join()
    assert not sender.sending
    assert [bytes(memoryview(g).cast("B")) for g in got[0][1]] == big
    sender.send(b"after", [b"x"])  # in step: the next message goes through
    assert receiver.recv()[0] == b"after"


def test_a_closed_peer_and_a_closed_socket_are_errors():
    a, b = socket.socketpair()
    receiver = channel(b, "server")
    a.close()
    with pytest.raises(ConnectionError):
        receiver.recv()
    b.close()
    with pytest.raises(OSError):
        receiver.recv()


def test_a_bad_prefix_and_an_oversized_frame_are_framing_errors():
    for data, match in ((b"XXXX" + bytes(12), "prefix"),
                        (framing._FIXED.pack(framing.MAGIC, 0, 2) + (1).to_bytes(8, "little") + (1 << 31).to_bytes(8, "little"),
                         "size limit")):
        a, b = socket.socketpair()
        receiver = channel(b, "server")
        a.sendall(data)
        with pytest.raises(framing.FramingError, match=match):
            receiver.recv()
        a.close()
        b.close()
