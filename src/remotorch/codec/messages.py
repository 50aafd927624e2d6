"""Every message of the remotorch protocol, and nothing else.

A message travels as frame 0 (an msgpack :class:`Envelope`) followed by raw
buffer frames (tensor bytes, never copied into the header). The envelope
carries the protocol version; ``docs/protocol.md`` is the normative text.
"""

from __future__ import annotations

from typing import Union

import msgspec

PROTOCOL_VERSION = 2


class TensorMeta(msgspec.Struct, frozen=True, array_like=True):
    """How to view one buffer frame as a tensor: dtype, shape, strides (elements)."""

    dtype: str
    shape: list[int]
    strides: list[int]
    frame: int  # index into the message's buffer frames (0 = first after the header)


# ----------------------------------------------------------------- call arguments
class TensorArg(msgspec.Struct, frozen=True, tag="t", array_like=True):
    """A tensor sent inline in this message's frames."""

    meta: TensorMeta


class RefArg(msgspec.Struct, frozen=True, tag="r", array_like=True):
    """A tensor already held by the worker, named by its content id."""

    id: str


class ScalarArg(msgspec.Struct, frozen=True, tag="s", array_like=True):
    """A Python scalar (int, float, bool or None): symbolic sizes, unwrapped numbers."""

    value: Union[int, float, bool, None]


Arg = Union[TensorArg, RefArg, ScalarArg]


# ----------------------------------------------------------------------- requests
class Health(msgspec.Struct, frozen=True, tag="health"):
    """Ask who the worker is and what it offers."""


class PutGraph(msgspec.Struct, frozen=True, tag="put_graph"):
    """Upload a graph document; frames hold its tensor constants (see ``consts``)."""

    graph_id: str
    doc: bytes
    consts: list[TensorMeta] = []


class PutTensors(msgspec.Struct, frozen=True, tag="put_tensors"):
    """Upload resident tensors (weights, buffers) under their content ids."""

    ids: list[str]
    metas: list[TensorMeta]


class RunGraph(msgspec.Struct, frozen=True, tag="run"):
    """Run an uploaded graph on an engine with the given flat arguments."""

    graph_id: str
    engine: str
    args: list[Arg]


class Echo(msgspec.Struct, frozen=True, tag="echo"):
    """Send the frames straight back: measures the transport alone."""


Request = Union[Health, PutGraph, PutTensors, RunGraph, Echo]


# ------------------------------------------------------- sessions beyond a connection
class Attach(msgspec.Struct, frozen=True, tag="attach"):
    """Serve this connection as the session ``session_id`` (kept for the lease after a drop).

    Sent first on every new connection by clients that want their uploads to
    survive a reconnect; the id is a random secret of the client.
    """

    session_id: str


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat"):
    """Keep an idle attached session's lease alive (answered ``Ok``)."""


class Detach(msgspec.Struct, frozen=True, tag="detach"):
    """End this connection's attached session now: the worker frees what it held (answered ``Ok``)."""


class AttachReply(msgspec.Struct, frozen=True, tag="attach_reply"):
    """``resumed``: the worker still held this session; ``lease_s``: how long it keeps an idle one."""

    resumed: bool
    lease_s: float


Request = Union[Request, Attach, Heartbeat, Detach]


# ------------------------------------------------------------------------ replies
class HealthReply(msgspec.Struct, frozen=True, tag="health_reply"):
    name: str
    device: str
    torch_version: str
    engines: list[str]
    protocol: int
    sessions: int = 0
    resident_bytes: int = 0
    cached_bytes: int = 0  # objects no session holds, kept for re-use (evicted first)
    price_per_hour: float = 0.0  # $ per hour (``remotorch serve --price-per-hour``), for cost reports


class Ok(msgspec.Struct, frozen=True, tag="ok"):
    pass


class RunReply(msgspec.Struct, frozen=True, tag="run_reply"):
    """Flat outputs (tensors in frames, scalars inline) and the worker's own timing."""

    outputs: list[Arg]
    run_ms: float
    compiled: bool = False  # this call compiled the graph for its engine


class EchoReply(msgspec.Struct, frozen=True, tag="echo_reply"):
    pass


class ErrorReply(msgspec.Struct, frozen=True, tag="error"):
    """A typed failure; ``kind`` names a class in ``remotorch.errors``."""

    kind: str
    message: str
    traceback: Union[str, None] = None
    graphs: list[str] = []
    tensors: list[str] = []


Reply = Union[HealthReply, Ok, RunReply, EchoReply, ErrorReply]
Reply = Union[Reply, AttachReply]


# -------------------------------------------------------------------- profiling
class ProfileGraph(msgspec.Struct, frozen=True, tag="profile"):
    """Run an uploaded graph ``warmups`` times untimed, then ``repeats`` times timed."""

    graph_id: str
    engine: str
    args: list[Arg]
    warmups: int = 1
    repeats: int = 10


class ProfileReply(msgspec.Struct, frozen=True, tag="profile_reply"):
    """Outputs of the last run, the worker's time for each timed run, and how it timed them."""

    outputs: list[Arg]
    times_ms: list[float]
    clock: str  # "monotonic" (CPU) or "cuda_events" (CUDA)
    compiled: bool = False  # this request compiled the graph for its engine
    compile_ms: float = 0.0
    worker_ms: float = 0.0  # the worker's wall time for the whole request (network excluded)


Request = Union[Request, ProfileGraph]
Reply = Union[Reply, ProfileReply]


class Envelope(msgspec.Struct, frozen=True, array_like=True):
    """Frame 0 of every message: protocol version plus one request or reply."""

    v: int
    body: Union[Request, Reply]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Envelope)


def encode(body: Request | Reply) -> bytes:
    """Serialize a message body into frame 0."""
    return _encoder.encode(Envelope(PROTOCOL_VERSION, body))


def decode(frame0: bytes | memoryview) -> Request | Reply:
    """Parse frame 0; raises ``msgspec.ValidationError``/``DecodeError`` on bad input."""
    try:
        env = _decoder.decode(frame0)
    except UnicodeDecodeError as exc:  # msgspec lets invalid UTF-8 in a str through as this
        raise msgspec.DecodeError(f"invalid UTF-8 in a string: {exc}") from None
    if env.v != PROTOCOL_VERSION:
        raise msgspec.ValidationError(
            f"protocol version {env.v} is not supported (this side speaks {PROTOCOL_VERSION})")
    return env.body
