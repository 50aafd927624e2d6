"""What the client needs of a captured graph (:class:`remotorch.capture.graph.RemoteGraph` is one)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..codec.graph import GraphPayload


class Graph(Protocol):
    """What the client needs of a captured graph (``remotorch.capture.graph.RemoteGraph`` is one)."""

    graph_id: str
    engine: str
    payload: GraphPayload
    resident: list[int]  # argument indices of weights and buffers: sent by content id
    resident_set: frozenset[int]
    output_devices: list  # the device of each output (None: not a tensor)
    kind: str  # "inference", "forward" (of a training pair) or "backward"
    saved_from: int | None  # forward: outputs from here on are saved for backward
    worker: int | str | None  # which worker of the session runs it (None: the first)
    must_real: frozenset[int]  # outputs aot_autograd's runtime reads here: always sent back
    # args -> each output's layout (capture.layout.TensorLayout) or value; None when not known
    # here (the call then waits for the worker's answer); the attribute itself None: never known
    layouts: Callable[[Sequence], list | None] | None
    random: bool  # it draws random numbers: from this process's generator state (client/rng.py)
    cuda_graphs: bool  # the worker records it as a CUDA graph and replays it (Run.cuda_graphs)
