"""Each session's random generator state on the worker: random graphs draw from the client's generator.

A graph with random operators runs with the default generator set to the
session's state (the client's state, when the request carries it:
``Run.rng``), and the state it leaves is the session's again, so the
session's random graphs draw one sequence, as they would in one process,
whatever other sessions do in between. ``GeneratorState`` sends the client
what changed since it last knew the state (protocol.md §17.5).

On a CUDA worker, graphs draw from the CUDA generator: a state the client
sends seeds it (from a hash of the state), so the same seed gives the same
values run to run.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from ..codec.rngstate import delta
from ..errors import InvalidRequestError

_CPU_STATE_BYTES = torch.get_rng_state().numel()


@dataclass
class _State:
    cpu: torch.Tensor  # the CPU generator's state (uint8)
    known: bytes  # the state the client's mirror holds (what it sent, or was last told)
    cuda: torch.Tensor | None = None


class Generators:
    """Per session: the generator state its random graphs draw from (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._states: dict[Hashable, _State] = {}

    def run(self, session: Hashable, given: bytes, body: Callable[[], object]):
        """``body()`` (a random graph's run) with the session's generator state (``given``: start from it)."""
        state = self._states.get(session)
        if given:
            if len(given) != _CPU_STATE_BYTES:
                raise InvalidRequestError(f"a generator state is {_CPU_STATE_BYTES} bytes, not {len(given)}")
            state = self._states[session] = _State(torch.frombuffer(bytearray(given), dtype=torch.uint8),
                                                  bytes(given), self._cuda_seeded(given))
        elif state is None:  # the client never sent one: start from the worker's own
            now = torch.get_rng_state()
            state = self._states[session] = _State(now, bytes(now.numpy()), self._cuda_seeded(bytes(now.numpy())))
        torch.set_rng_state(state.cpu)
        if state.cuda is not None:
            torch.cuda.set_rng_state(state.cuda, self.device)
        try:
            return body()
        finally:
            state.cpu = torch.get_rng_state()
            if state.cuda is not None:
                state.cuda = torch.cuda.get_rng_state(self.device)

    def _cuda_seeded(self, cpu_state: bytes) -> torch.Tensor | None:
        """The CUDA generator's state, seeded from a CPU state (None on a CPU worker)."""
        if self.device.type != "cuda":
            return None
        seed = int.from_bytes(hashlib.sha256(cpu_state).digest()[:8], "little") >> 1
        gen = torch.cuda.default_generators[self.device.index or 0]
        saved = gen.get_state()
        gen.manual_seed(seed)
        seeded = gen.get_state()
        gen.set_state(saved)
        return seeded

    def changes(self, session: Hashable) -> list:
        """What changed in the session's state since the client last knew it (``[offset, bytes]`` runs);
        the client knows it from now on."""
        state = self._states.get(session)
        if state is None:
            return []
        now = bytes(state.cpu.numpy())
        out = delta(state.known, now)
        state.known = now
        return out

    def forget(self, session: Hashable) -> None:
        self._states.pop(session, None)
