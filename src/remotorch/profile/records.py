"""What a profiler records while the user's program runs: raw facts, no statistics.

One :class:`CallRecord` per call of an ``@accelerate`` function; in it one
:class:`GraphCall` per graph the call ran, each with one :class:`BackendRun`
per backend. Timestamps are the client's ``perf_counter`` in seconds; times
measured by workers are milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BackendRun:
    """One graph on one backend in one call: the worker's timed runs, or why it failed."""

    times_ms: list[float] = field(default_factory=list)
    error: str | None = None  # failure message (first line), grouped in reports
    compiled: bool = False
    compile_ms: float = 0.0
    network_ms: float = 0.0
    max_abs_diff: float | None = None  # largest |output - local eager output|
    started: float = 0.0  # client clock around the request (shows which requests overlapped)
    finished: float = 0.0
    clock: str = ""  # what timed the runs on the worker: "monotonic", or "cuda_events" on a GPU
    cuda_graph: str = ""  # a worker recording CUDA graphs: "replayed", or why the graph ran uncaptured


@dataclass
class GraphCall:
    """One graph run during a call: when the client handed it over and got it back."""

    graph_id: str
    ops: int
    start: float
    end: float
    runs: dict[str, BackendRun]


@dataclass
class CallRecord:
    """One call of an accelerated function."""

    function: str
    start: float
    end: float = 0.0
    graphs: list[GraphCall] = field(default_factory=list)
    compiled: bool = False  # dynamo or an engine compiled during this call
    fell_back: bool = False  # a graph ran locally instead of on the output backend
    failed: bool = False  # the call raised

    def local_ms(self) -> list[float]:
        """The local Python segments: before the first graph, between graphs, after the last."""
        marks = [self.start]
        for g in self.graphs:
            marks += [g.start, g.end]
        marks.append(self.end)
        return [(marks[i + 1] - marks[i]) * 1e3 for i in range(0, len(marks), 2)]

    @property
    def key(self) -> tuple:
        """Calls with equal keys ran the same sequence of graphs; they are grouped."""
        return (self.function, tuple(g.graph_id for g in self.graphs))

    @property
    def timed(self) -> bool:
        """Whether this call's times enter statistics (nothing compiled, fell back or failed)."""
        return not (self.compiled or self.fell_back or self.failed)


@dataclass(frozen=True)
class ProfileSettings:
    """What a profile was asked to do: which backends, which gave the outputs, how many runs."""

    backends: list[str]
    output_backend: str
    num_repeats: int
    num_warmups: int
    workers: dict[str, dict]  # by worker name: url, device, price_per_hour
