"""Every message of the remotorch protocol, and nothing else.

A message is frame 0 (an msgpack :class:`Envelope`, with the protocol version) and raw buffer
frames (tensor bytes, never copied into the header); ``docs/protocol.md`` is the normative text.
The core requests and replies are declared here; the others live in sibling modules by part of
the protocol (:mod:`.args`: tensor layouts and call arguments; :mod:`.training`; :mod:`.values`;
:mod:`.groups`; :mod:`.cache`; :mod:`.stats`; :mod:`.attention`; :mod:`.weights`), and this module
is the face of them all: it takes them into ``Request`` and ``Reply`` and re-exports every one
(import them from here: ``m.OptimStep``).
"""

from __future__ import annotations

from typing import Union

import msgspec

from .args import compact, expand  # noqa: F401 (how a Run writes runs of handles and slots)
from .attention import AttentionCall, AttentionChoice, AttentionChoiceReply, TensorSig  # noqa: F401
from .attention import MAX_CALLS as MAX_ATTENTION_CALLS  # noqa: F401
from .args import (Arg, EchoArg, HandleArg, HandlesArg, KeptArg, OutputArg, RefArg, RunArg, ScalarArg, SlotArg,
                   SlotsArg, TensorArg, TensorMeta, ViewArg, ZerosArg)
from .cache import Challenge, ChallengeReply, Have, HaveReply
from .groups import BroadcastSlots, JoinGroup, LeaveGroup, OpenStore, ReduceGrads, StoreReply
from .stats import ErrorStats, GraphStats, Stats, StatsReply, TenantStats  # noqa: F401
from .training import (AccumulateGrads, BindSlots, ClipGradNorm, Hyper, NormReply, OptimCreate,
                       OptimGetState, OptimSetState, OptimStateReply, OptimStep, OptimZeroGrad, PullReply,
                       PullSlots)
from .values import Deliver, ExpectHandles, Fetch, FetchReply, SendHandles, TicketReply
from .weights import (MAX_SHARD_BYTES, LoadOptimizer, LoadWeights, OpenWeights, OptimLoaded, SaveOptimizer,  # noqa: F401
                      SaveReply, SaveWeights, TensorSpec, WeightsIndex)

PROTOCOL_VERSION = 8
MAX_BINDINGS = 4096  # argument bindings a session may hold on a worker (Run.bind, §8.1)
SHORT_GRAPH_ID = 16  # hex digits of a graph id that name it in a Run once the session ran it


# ----------------------------------------------------------------------- requests
class Health(msgspec.Struct, frozen=True, tag="health", omit_defaults=True):
    """Ask who the worker is and what it offers."""


class Pending(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """Housekeeping the client deferred, on the envelope: applied before the request it carries.

    ``zero_grad``: optimizers whose gradients are cleared (set to None) first;
    then the handles, parameter slots, optimizers and uploaded tensors
    (content ids, e.g. a buffer's superseded value) the client no longer
    references are dropped. Ids the session does not hold are ignored.
    ``spans`` names runs of consecutive handle ids (a step's activations) in
    two numbers each.
    """

    handles: list[int] = []
    slots: list[int] = []
    optims: list[int] = []
    zero_grad: list[int] = []
    tensors: list[str] = []
    spans: list[list[int]] = []  # [first, count]: handles first, first + 1, … dropped too


class Flush(msgspec.Struct, frozen=True, tag="flush", omit_defaults=True):
    """Nothing but the envelope's housekeeping (answered ``Ok``)."""


class PutGraph(msgspec.Struct, frozen=True, tag="put_graph", omit_defaults=True):
    """Upload a graph document; frames hold its tensor constants (see ``consts``)."""

    graph_id: str
    doc: bytes
    consts: list[TensorMeta] = []


class PutTensors(msgspec.Struct, frozen=True, tag="put_tensors", omit_defaults=True):
    """Upload resident tensors (weights, buffers) under their content ids."""

    ids: list[str]
    metas: list[TensorMeta]


class SendOutputs(msgspec.Struct, frozen=True, array_like=True):
    """After the run, deliver these outputs to the worker at ``url`` under its ticket (§18)."""

    outputs: list[int]
    url: str
    ticket_id: bytes
    secret: bytes


class Run(msgspec.Struct, frozen=True, tag="run", omit_defaults=True):
    """Run an uploaded graph on an engine with the given flat arguments; say what becomes of each output.

    * Tensor outputs at index >= ``saved_from`` (a training forward's
      activations saved for its backward) stay on the worker as handles
      ``handle_base``, ``handle_base + 1``, … and are answered as ``HandleArg``.
    * Tensor outputs listed in ``keep`` stay there as the next handle ids, in
      ``keep`` order, answered as ``KeptArg`` (the worker may send one inline
      instead: smaller than ``keep_min_bytes``, or over the session's quota).
    * ``grad_slots``: output ``grads_from + k`` is accumulated into the
      gradient of slot ``grad_slots[k]`` (answered as a nil scalar); -1: that
      output is not (see :func:`grad_fields`).
    * ``send``: outputs delivered worker to worker before the reply (nil here).
    * Everything else is sent back inline.

    ``bind`` (1 … MAX_BINDINGS) asks the worker to remember this call's
    ``RefArg`` arguments as binding ``bind`` of the session, for this graph;
    ``bound`` names such a binding: ``args`` then holds only the arguments
    at the positions it does not cover, in order (protocol.md §8.1).

    ``strides`` (one list per ``keep`` entry, or none): the strides the client
    promised for each kept output, having sent this run without waiting for
    its reply; the worker keeps each output with exactly those strides.
    ``echo``: kept outputs that are also sent back inline (``EchoArg``): the
    client reads them from the reply, and may name them by handle meanwhile.
    ``brief``: answer only the outputs that carry something the client does
    not know (``RunReply.at``): values sent back, and every output that was
    not disposed of as planned; saved, kept and accumulated ones go unsaid, and
    kept ones are kept row-major unless ``strides`` says otherwise.

    ``graph_id`` may be the first :data:`SHORT_GRAPH_ID` hex digits of the id of
    a graph the session ran before (a warm call need not repeat all 64).

    ``rng``: a graph that draws random numbers starts from this CPU generator
    state (the client's); empty, it goes on from the state the session's
    previous random graph left (§17.5).

    ``take``: handles the run takes, as ``[first id, count]`` runs of consecutive
    ids (a backward's saved activations were made together): the session drops
    them before the graph runs, so each is freed as soon as the graph has last
    used it (a backward whose autograd graph is not kept takes its saved
    activations, §17.1).

    ``cuda_graphs``: record the graph as a CUDA graph on its second run and
    replay it after (a worker started with ``--cuda-graphs`` does for every
    graph); one it cannot record runs as usual (§8.1).
    """

    graph_id: str
    engine: str = "eager"
    args: list[RunArg] = []
    keep: list[int] = []
    handle_base: int = 0
    keep_min_bytes: int = 0
    keep_inputs: list[list[int]] = []  # [argument index, handle id]: keep these inputs as handles too
    saved_from: int = -1
    grads_from: int = 0
    grad_slots: list[int] = []
    send: list[SendOutputs] = []
    bind: int = 0
    bound: int = 0
    strides: list[list[int]] = []
    echo: list[int] = []
    brief: bool = False
    rng: bytes = b""
    take: list[tuple[int, int]] = []
    cuda_graphs: bool = False


def grad_fields(pairs) -> dict:
    """``Run``'s fields for the gradients ``pairs`` (``[output index, slot id]``) leave in slots:
    one slot id per output from the first (-1 between), a byte or two each on the wire."""
    if not pairs:
        return {}
    first = min(i for i, _ in pairs)
    slots = [-1] * (max(i for i, _ in pairs) - first + 1)
    for i, sid in pairs:
        slots[i - first] = sid
    return dict(grads_from=first, grad_slots=slots)


class Echo(msgspec.Struct, frozen=True, tag="echo", omit_defaults=True):
    """Send the frames straight back: measures the transport alone."""


# ------------------------------------------------------- sessions beyond a connection
class Attach(msgspec.Struct, frozen=True, tag="attach", omit_defaults=True):
    """Serve this connection as the session ``session_id`` (kept for the lease after a drop).

    Sent first on every new connection by clients that want their uploads to
    survive a reconnect; the id is a random secret of the client.
    """

    session_id: str


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat", omit_defaults=True):
    """Keep an idle attached session's lease alive (answered ``Ok``)."""


class Detach(msgspec.Struct, frozen=True, tag="detach", omit_defaults=True):
    """End this connection's attached session now: the worker frees what it held (answered ``Ok``)."""


class AttachReply(msgspec.Struct, frozen=True, tag="attach_reply", omit_defaults=True):
    """``resumed``: the worker still held this session; ``lease_s``: how long it keeps an idle one."""

    resumed: bool
    lease_s: float


# ------------------------------------------------------------------------ replies
class HealthReply(msgspec.Struct, frozen=True, tag="health_reply", omit_defaults=True):
    name: str
    device: str
    torch_version: str
    engines: list[str]
    protocol: int
    sessions: int = 0  # worker-side sessions: attached ones, and connections serving as their own
    resident_bytes: int = 0
    cached_bytes: int = 0  # objects no session holds, kept for re-use (evicted first)
    price_per_hour: float = 0.0  # $ per hour (``remotorch serve --price-per-hour``), for cost reports
    connections: int = 0  # connections that have sent a request and are open now
    allowed_ops: list[str] = []  # namespaces of custom operators graphs may call (``serve --allow-ops``)
    disk_cache: dict[str, Union[int, str]] = {}  # ``serve --cache-dir``: folder, bytes, counters (§20)
    framing: str = ""  # "compiled" (_cframing) or "python": what this worker frames plain (not TLS) sockets with
    weight_roots: dict[str, str] = {}  # ``serve --weights/--checkpoints``: root name -> "read" or "write" (§22)
    weights_read: int = 0  # tensor bytes read from weight files since the worker started (§22)


class Ok(msgspec.Struct, frozen=True, tag="ok", omit_defaults=True):
    pass


class RunReply(msgspec.Struct, frozen=True, tag="run_reply", omit_defaults=True):
    """A ``Run``'s flat outputs (tensors in frames, scalars inline, the others as ``Run`` says) and the
    worker's own timing. To a ``brief`` run, ``outputs`` holds only the outputs the client does not
    know, and ``at`` their indices. After a graph that draws random numbers, ``rng`` says what changed
    in the session's generator state since the client last knew it (``[offset, bytes]`` runs;
    ``[[-1, state]]``: all of it)."""

    outputs: list[OutputArg]
    run_ms: float
    compiled: bool = False  # this call compiled the graph for its engine
    at: list[int] = []
    rng: list[tuple[int, bytes]] = []  # a random graph: what changed in the session's generator state (§17.5)


class EchoReply(msgspec.Struct, frozen=True, tag="echo_reply", omit_defaults=True):
    pass


class ErrorReply(msgspec.Struct, frozen=True, tag="error", omit_defaults=True):
    """A typed failure; ``kind`` names a class in ``remotorch.errors``."""

    kind: str
    message: str
    traceback: Union[str, None] = None
    graphs: list[str] = []  # ``missing``: graph ids and content ids the client can upload again,
    tensors: list[str] = []
    handles: list[int] = []  # and worker-side state it cannot (saved activations, values, slots, optimizers)
    slots: list[int] = []
    optims: list[int] = []
    bindings: list[int] = []  # argument bindings (Run.bound) the client makes again by sending the arguments


# -------------------------------------------------------------------- profiling
class ProfileGraph(msgspec.Struct, frozen=True, tag="profile", omit_defaults=True):
    """Run an uploaded graph ``warmups`` times untimed, then ``repeats`` times timed."""

    graph_id: str
    engine: str
    args: list[Arg]
    warmups: int = 1
    repeats: int = 10
    cuda_graphs: bool = False  # as Run.cuda_graphs


class ProfileReply(msgspec.Struct, frozen=True, tag="profile_reply", omit_defaults=True):
    """Outputs of the last run, the worker's time for each timed run, and how it timed them."""

    outputs: list[Arg]
    times_ms: list[float]
    clock: str  # "monotonic" (CPU) or "cuda_events" (CUDA)
    compiled: bool = False  # this request compiled the graph for its engine
    compile_ms: float = 0.0
    worker_ms: float = 0.0  # the worker's wall time for the whole request (network excluded)
    cuda_graph: str = ""  # with cuda_graphs: "replayed", or why its last run ran uncaptured


# ------------------------------------------------- eager calls queued together (§18.4)
class Runs(msgspec.Struct, frozen=True, tag="runs", omit_defaults=True):
    """Run these graphs in order, each as its ``Run`` says, each after its own housekeeping.

    An eager torch call on a value kept on the worker is one small ``Run``
    (``remotorch.client.eager``); the client sends those it queues back to
    back as one message. ``frames``: how many of the message's buffer frames
    each run takes, in order (empty: none takes any); ``housekeeping``: each
    run's deferred housekeeping (a ``Pending``, or nil), applied just before
    it, as an envelope's is before its request (empty: none has any).
    """

    runs: list[Run]
    frames: list[int] = []
    housekeeping: list[Union[Pending, None]] = []


class RunsReply(msgspec.Struct, frozen=True, tag="runs_reply", omit_defaults=True):
    """What each run of a ``Runs`` came to: its time, and, for a run with more to say than an empty
    brief reply (values, the generator's changes, a compile, a failure), that reply by its index (a
    failed run: its ``ErrorReply``; the runs after it still ran). Buffer frames: every run's values,
    numbered across the message."""

    run_ms: list[float]
    said: dict[int, Union[RunReply, ErrorReply]] = {}


# ------------------------------------------------------------ every message, once
Request = Union[Health, PutGraph, PutTensors, Run, Echo, Flush,  # core (§8.1)
                Attach, Heartbeat, Detach, ProfileGraph,  # sessions (§8.4), profiling (§8.3)
                BindSlots, AccumulateGrads, PullSlots, OptimCreate,  # training (§17)
                OptimStep, OptimZeroGrad, ClipGradNorm, OptimGetState, OptimSetState,
                Fetch, ExpectHandles, SendHandles, Deliver,  # values that stay on the worker (§18)
                OpenStore, JoinGroup, LeaveGroup, BroadcastSlots, ReduceGrads,  # process groups (§19)
                Challenge, Have,  # the disk cache (§20)
                Stats,  # the operator's view (§21)
                AttentionChoice,  # the worker's attention kernels (§8.5)
                Runs,  # eager calls queued together (§18.4)
                OpenWeights, LoadWeights, SaveWeights, SaveOptimizer, LoadOptimizer]  # weights on the worker (§22)
Reply = Union[HealthReply, Ok, RunReply, EchoReply, ErrorReply, AttachReply, ProfileReply,
              PullReply, NormReply, OptimStateReply, FetchReply, TicketReply, StoreReply,
              ChallengeReply, HaveReply, StatsReply, AttentionChoiceReply, RunsReply, WeightsIndex, SaveReply,
              OptimLoaded]


class Envelope(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """Frame 0 of every message: protocol version, one request or reply, and (requests only)
    the session's deferred housekeeping, applied before the request.

    ``seq`` numbers a session's requests 1, 2, 3… (0: a request outside the
    stream: attach, heartbeat, detach); the worker runs each number once and
    answers one sent again (after a reconnect) from its memory. ``ack``: the
    client has read the replies up to this number (the worker forgets them).
    """

    v: int
    body: Union[Request, Reply]
    pending: Union[Pending, None] = None
    seq: int = 0
    ack: int = 0


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Envelope)


def encode(body: Request | Reply, pending: Pending | None = None, seq: int = 0, ack: int = 0) -> bytes:
    """Serialize a message body (and a request's housekeeping and place in its stream) into frame 0."""
    return _encoder.encode(Envelope(PROTOCOL_VERSION, body, pending, seq, ack))


def decode_envelope(frame0: bytes | memoryview) -> Envelope:
    """Parse frame 0; raises ``msgspec.ValidationError``/``DecodeError`` on bad input."""
    try:
        env = _decoder.decode(frame0)
    except UnicodeDecodeError as exc:  # msgspec lets invalid UTF-8 in a str through as this
        raise msgspec.DecodeError(f"invalid UTF-8 in a string: {exc}") from None
    if env.v != PROTOCOL_VERSION:
        raise msgspec.ValidationError(
            f"protocol version {env.v} is not supported (this side speaks {PROTOCOL_VERSION})")
    return env


def decode(frame0: bytes | memoryview) -> Request | Reply:
    """Parse frame 0 into its body (the housekeeping, if any, is dropped: see :func:`decode_envelope`)."""
    return decode_envelope(frame0).body
