"""Seeded randomness as torch does it: the process's CPU generator, wherever the random graph runs.

A graph with random operators (dropout, ``rand``…) draws from a generator.
Run locally it would draw from this process's default CPU generator and
advance it; run remotely it must do the same, or ``torch.manual_seed(7)``
would not make a run repeatable and a remote run would never equal a local
one. So the generator's state travels with the random graphs, and back:

* The state "lives" in one place at a time: here, or on one worker (after a
  random graph was sent there, until its reply is read). A random graph
  sent to a worker carries this process's state (``Run.rng``) when the
  worker's session does not hold it already; else it continues from the
  state the session's previous random graph left, as a local run would.
* Each reply to a random graph carries what changed in the worker's state
  (``RunReply.rng``: a few bytes; the generator's words change only every
  624 draws). The client keeps a mirror of each worker's state, so it knows
  the state after the last random graph as soon as its reply is read.
* While the state lives on a worker, this process's generator is *parked*
  on a sentinel state; once the reply of the last random graph sent is read
  (at any read on that worker, or ``synchronize()``), the generator takes
  the worker's state, and local code draws what a local run would have.
  Code that reseeds (``manual_seed``, ``set_rng_state``) in between moves
  the generator off the sentinel: that state wins, and travels with the
  next random graph. Code that draws locally in between draws from the
  sentinel: deterministic, but not what eager would draw (a warning says
  so once; ``REMOTORCH_LAUNCH_BLOCKING=1`` makes it exact).

On a CUDA worker, graphs draw from the worker's CUDA generator, seeded from
this process's state when it travels: the same seed gives the same values
run to run (eager on a GPU draws from the GPU's generator too).
"""

from __future__ import annotations

import logging
import secrets
import threading

import torch

from ..codec.rngstate import patched

log = logging.getLogger(__name__)


class Generators:
    """Where this process's default CPU generator's state lives, and each worker's mirror of it.

    One per process (the default generator is the process's); the
    connections call it around random graphs (see the module docstring).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._mirror: dict[int, bytes] = {}  # id(link) -> the state that worker's session holds
        self._owner = None  # the link whose worker holds the state now (None: here)
        self._last = None  # the last random graph sent to the owner (its Launched)
        sentinel = torch.Generator()
        self._sentinel_seed = secrets.randbits(63)
        sentinel.manual_seed(self._sentinel_seed)
        self._sentinel = sentinel.get_state()
        self._before = None
        self._warned = False

    def _parked(self) -> bool:
        return torch.equal(torch.get_rng_state(), self._sentinel)

    def state_for(self, link) -> bytes | None:
        """The state a random graph about to go to ``link``'s worker must carry (None: its session
        continues from the one it holds)."""
        with self._lock:
            owner = self._owner
            if owner is not None and not self._parked():
                self._took_back_here()  # the program reseeded (or drew) meanwhile: its state wins
                owner = None
            if owner is link:
                return None
            if owner is not None:  # it lives on another worker: bring it here first (a read)
                owner.settle(self._last)
                self._take_back(owner)
            state = bytes(torch.get_rng_state().numpy())
            return None if self._mirror.get(id(link)) == state else state

    def sent(self, link, launched, state: bytes | None) -> None:
        """A random graph went to ``link``'s worker: the state lives there now; park this process's."""
        with self._lock:
            if state is not None:
                self._mirror[id(link)] = state
            if self._owner is None:
                self._before = torch.get_rng_state()  # restored if that worker is lost
            self._owner, self._last = link, launched
            torch.set_rng_state(self._sentinel)

    def answered(self, link, launched, changes: list) -> None:
        """The reply of a random graph: the worker's state after it; the state comes back here when
        it was the last random graph sent."""
        with self._lock:
            base = self._mirror.get(id(link), b"")
            self._mirror[id(link)] = patched(base, changes)
            if self._owner is link and self._last is launched:
                self._take_back(link)

    def _take_back(self, link) -> None:
        if self._parked():
            torch.set_rng_state(torch.frombuffer(bytearray(self._mirror[id(link)]), dtype=torch.uint8))
        else:
            self._took_back_here()
        self._owner = self._last = None

    def _took_back_here(self) -> None:
        """The program changed the generator while its state lived on a worker: its state wins.

        A reseed (``manual_seed``, ``set_rng_state``) is what the program
        meant; a draw from the sentinel is not what eager would have drawn,
        and is said once.
        """
        self._owner = self._last = None
        if torch.initial_seed() == self._sentinel_seed and not self._warned:
            self._warned = True
            log.warning("random numbers were drawn here while a remote random graph's generator state was "
                        "on its worker (before any read): they are not those a local run would draw. Read a "
                        "value (or call session.synchronize()) first, or set REMOTORCH_LAUNCH_BLOCKING=1")

    def forget(self, link) -> None:
        """``link``'s worker no longer holds its session's state (a new session, or the link closed)."""
        with self._lock:
            self._mirror.pop(id(link), None)
            if self._owner is link:
                self._owner = self._last = None
                if self._parked() and self._before is not None:  # as it was before the lost graphs
                    torch.set_rng_state(self._before)


GENERATORS = Generators()
