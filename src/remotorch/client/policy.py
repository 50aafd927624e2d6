"""What the client learns about each graph from what the program does, kept by the client.

A captured graph (:class:`remotorch.capture.graph.RemoteGraph`) is immutable
capture output. What the client learns while the program runs lives here, one
:class:`GraphPolicy` per graph id, owned by the connection of the worker that
runs it (as httpx keeps cookies in the client, never on a request):

* ``read_outputs``: outputs Python read before: sent back, not kept on the worker;
* ``reused_inputs``: inputs a later graph of the same call took too: kept there
  (:mod:`remotorch.client.reuse`);
* ``ran``: the graph ran on this connection once, waited for (its upload,
  its compile and any refusal are behind it): from then on its calls are sent
  without waiting (:mod:`remotorch.client.launch`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .graph import Graph


@dataclass(eq=False)
class GraphPolicy:
    read_outputs: set[int] = field(default_factory=set)
    reused_inputs: set[int] = field(default_factory=set)
    ran: bool = False

    def keep(self, graph: Graph) -> list[int]:
        """Tensor outputs that stay on the worker: not needed here, and not read by Python before."""
        end = graph.saved_from if graph.saved_from is not None else len(graph.output_devices)
        devices, must_real, read = graph.output_devices, graph.must_real, self.read_outputs
        return [i for i in range(end) if devices[i] is not None and i not in must_real and i not in read]


class Policies:
    """Graph id -> its policy, for one connection."""

    def __init__(self) -> None:
        self._by_id: dict[str, GraphPolicy] = {}

    def of(self, graph: Graph) -> GraphPolicy:
        policy = self._by_id.get(graph.graph_id)
        if policy is None:
            policy = self._by_id.setdefault(graph.graph_id, GraphPolicy())
        return policy
