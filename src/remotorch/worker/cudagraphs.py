"""CUDA graphs on the worker: a graph recorded once, then replayed (``serve --cuda-graphs``, or per graph
``options={"cuda_graphs": True}``, ``Run.cuda_graphs``).

A graph's call launches its kernels one at a time from Python (a few µs of Python for each of a
model's thousands of nodes); a CUDA graph launches them all at once. A graph's first call runs as
usual; its second records it and replays the recording; later calls replay it. The recording is
made on a side stream after a warm-up run there (as ``torch.cuda.make_graphed_callables`` does),
in a memory pool of its own. A replay runs the recorded kernels on the recorded addresses, so it
computes what an uncaptured run computes, bit for bit.

Addresses: an argument the worker keeps between runs (an upload, a parameter slot, an output of
a recorded graph: a forward's saved activations, taken by its backward) is recorded where it is
and must be there again at each replay; any other argument (an input sent with the call) is
copied into a buffer of the recording. The outputs are the recording's own buffers, handed out
as new tensors over them (small ones copied): a replay while one of its last outputs is still
held would overwrite it, so that call runs uncaptured instead.

A graph that cannot be recorded runs uncaptured, and :class:`CudaGraphs` counts each such run by
its reason: not a CUDA device; dynamic shapes (size arguments); an operator that waits for the
device (reads a value back, or makes an output whose size depends on the data); one that writes
into an argument; random numbers (the session's generator state changes from run to run);
control flow and effect tokens (higher-order operators); a CPU tensor argument; a recording that
failed. Which graphs these are is decided from the graph once, before anything is recorded.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable

import torch
import torch.fx

from ..codec.rngstate import draws_random
from .engines import call

log = logging.getLogger(__name__)

CLONE_BELOW = 1 << 20  # outputs smaller than this are handed out as copies (a loss): never held over a replay
_SYNCS = frozenset({"aten::_local_scalar_dense", "aten::item", "aten::equal", "aten::is_nonzero",
                    "aten::allclose", "aten::_assert_async", "aten::_assert_scalar"})


def skip_reason(module: torch.fx.GraphModule, device: torch.device) -> str | None:
    """Why a graph cannot be recorded as a CUDA graph (None: it can), from the graph alone."""
    if device.type != "cuda":
        return "not a CUDA device"
    if draws_random(module):
        return "random numbers"
    if any(isinstance(m, torch.fx.GraphModule) for name, m in module.named_modules() if name):
        return "control flow"
    placeholders = {n for n in module.graph.nodes if n.op == "placeholder"}
    for node in module.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            if isinstance(target, torch._ops.HigherOrderOperator):
                return "control flow"
            continue
        schema = target._schema
        if schema.name in _SYNCS or torch.Tag.data_dependent_output in target.tags \
                or torch.Tag.dynamic_output_shape in target.tags:
            return f"waits for the device ({schema.name})"
        if any(k == "device" and torch.device(v).type == "cpu" for k, v in node.kwargs.items()
               if isinstance(v, (str, torch.device))):
            return f"makes a CPU tensor ({schema.name})"
        for arg, value in zip(schema.arguments, node.args):
            if arg.alias_info is not None and arg.alias_info.is_write and _reaches(value, placeholders):
                return f"writes into an argument ({schema.name})"
    return None


def _reaches(value, placeholders: set) -> bool:
    """Whether an argument is a graph input or a view of one."""
    while isinstance(value, torch.fx.Node):
        if value in placeholders:
            return True
        schema = getattr(value.target, "_schema", None)
        if value.op != "call_function" or schema is None or not schema.returns or \
                schema.returns[0].alias_info is None or not value.args:
            return False
        value = value.args[0]
    return False


class CudaGraphs:
    """The worker's recordings' counters, and which storages are outputs of a recording."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()  # "recorded", "replays", and "uncaptured: <reason>"
        self.outputs: set[int] = set()  # storages (by address) that recordings own as outputs
        self._lock = threading.Lock()

    def count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def wrap(self, fn: Callable, module: torch.fx.GraphModule, device: torch.device,
             kept: Callable[[], frozenset[int]]) -> Recorded:
        """``fn`` (an engine's callable for ``module``) recorded on its second call, replayed after.
        ``kept()``: the storages the worker keeps between runs (uploads, parameter slots)."""
        return Recorded(fn, skip_reason(module, device), device, kept, self)


class Recorded:
    """One graph's recording: boxed, as the engine's callable it wraps. ``state`` says what its last
    call did: ``"replayed"``, or why it ran uncaptured."""

    _boxed_call = True

    def __init__(self, fn: Callable, skip: str | None, device: torch.device, kept: Callable[[], frozenset[int]],
                 graphs: CudaGraphs) -> None:
        self.fn, self.skip, self.device, self.kept, self.graphs = fn, skip, device, kept, graphs
        self.calls = 0
        self.graph: Callable[[], None] | None = None  # replays the recording
        self.capture = cuda_capture
        # per argument: the buffer of ours it is copied into, or (address, strides) where it was recorded in
        # place (no reference: what lives there at a replay is what the replay reads)
        self.static: list = []
        self.out: list = []
        self.baseline: list[int] = []  # each output storage's use count when only this recording holds it
        self.state = ""
        self._lock = threading.Lock()  # one call at a time: the buffers are shared

    def __call__(self, args: list):
        with self._lock:
            self.calls += 1
            why = self.skip or (self._record(args) if self.graph is None and self.calls >= 2 else None)
            if self.graph is None or why is not None:
                return self._uncaptured(args, why or "its first call (a warm-up)")
            why = self._refill(args)
            if why is not None:
                return self._uncaptured(args, why)
            self.graph()
            self.graphs.count("replays")
            self.state = "replayed"
            return self._hand_out()

    def _uncaptured(self, args: list, why: str):
        self.graphs.count(f"uncaptured: {why}")
        self.state = why
        return call(self.fn, args)

    def _record(self, args: list) -> str | None:
        """Record the graph on these arguments (None), or say why it cannot be."""
        if any(not isinstance(a, torch.Tensor) for a in args):
            self.skip = "dynamic shapes (a size argument)"
            return self.skip
        if any(a.device != self.device for a in args):  # (this time: a forward that ran uncaptured made its
            return "a CPU tensor argument"               # attention seeds on the CPU; recorded, on the device)
        kept = self.kept() | self.graphs.outputs
        recorded = [a if a.untyped_storage().data_ptr() in kept else
                    torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device).copy_(a) for a in args]
        try:
            replay, out = self.capture(self.fn, recorded, self.device)
        except Exception as exc:  # e.g. an operator that cannot be recorded: uncaptured for good
            log.warning("recording a CUDA graph failed, the graph runs uncaptured: %s", exc)
            self.skip = f"recording failed ({type(exc).__name__})"
            return self.skip
        self.static = [(r.data_ptr(), r.stride()) if r is a else r for r, a in zip(recorded, args)]
        self.graph, self.out = replay, list(out) if isinstance(out, (list, tuple)) else [out]
        self.graphs.outputs.update(o.untyped_storage().data_ptr() for o in self.out if isinstance(o, torch.Tensor))
        self.baseline = [_uses(o) for o in self.out]
        self.graphs.count("recorded")
        return None

    def _refill(self, args: list) -> str | None:
        """Put this call's arguments where the recording reads them (None), or say why it cannot run."""
        if any(_uses(o) > b for o, b in zip(self.out, self.baseline)):
            return "an output of its last run is still held"
        for a, s in zip(args, self.static):
            if not isinstance(a, torch.Tensor) or a.device != self.device:
                return "a CPU tensor argument"
            if isinstance(s, tuple):  # recorded in place: it must be there again
                if a.data_ptr() != s[0] or a.stride() != s[1]:
                    return "an argument it recorded in place moved"
            elif a.data_ptr() != s.data_ptr():
                s.copy_(a)
        args.clear()  # (boxed: the inputs are freed once copied)
        return None

    def _hand_out(self) -> list:
        """The outputs: new tensors over the recording's buffers (small ones copied)."""
        return [o.clone() if isinstance(o, torch.Tensor) and o.numel() * o.element_size() < CLONE_BELOW
                else o.detach() if isinstance(o, torch.Tensor) else o for o in self.out]


def cuda_capture(fn: Callable, static: list, device: torch.device) -> tuple[Callable[[], None], object]:
    """Record ``fn`` on ``static`` as a CUDA graph: (its replay, its outputs). A warm-up run on the
    recording's side stream first, as ``torch.cuda.make_graphed_callables`` does."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        call(fn, list(static))  # lazy set-up (cuBLAS handles, allocator growth) happens outside the recording
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = call(fn, list(static))
    return graph.replay, out


def _uses(o) -> int:
    """How many tensors hold an output's storage (0 for a value that is not a tensor)."""
    return torch._C._storage_Use_Count(o.untyped_storage()._cdata) if isinstance(o, torch.Tensor) else 0

