"""Seeded randomness as torch does it: the process's CPU generator, wherever the random graph runs.

A graph with random operators (dropout, ``rand``…) draws from a generator.
Run locally it would draw from this process's default CPU generator and
advance it; run remotely it must do the same, or ``torch.manual_seed(7)``
would not make a run repeatable and a remote run would never equal a local
one. So the generator's state travels with the random graphs, and back:

* The state lives in one place at a time: here, or on one worker (from a
  random graph sent there until the state comes back). A random graph sent
  to a worker carries this process's state (``Run.rng``) unless the worker's
  session holds that state already (it does after its own previous random
  graph, unless the program reseeded since): then it goes on from it, as a
  local run would.
* While the state lives on a worker, this process's generator is *parked*
  on a sentinel state. The reply to every random graph says what changed in
  the worker's state (``RunReply.rng``: a few bytes after a few draws, about
  5 KB once the generator's words turned over); a read on that worker (any
  wait for a reply, ``synchronize()``) also waits for the reply of the last
  random graph sent there (in flight already: no round trip of its own), and
  the generator takes that state: local code after a read draws what a local
  run would.
* Code that reseeds (``manual_seed``, ``set_rng_state``) while the generator is
  parked moves it off the sentinel: that state wins and travels with the next
  random graph. Code that draws random numbers while it is parked (before any
  read) draws from the sentinel: repeatable, but not what eager would draw
  (a warning says so once; ``REMOTORCH_LAUNCH_BLOCKING=1`` makes it exact).

Several workers at once (a pipeline's stages, data-parallel replicas): each
step draws one seed from this process's generator and gives each worker's
session a generator of its own derived from it (:meth:`Generators.fork`, as
``DataLoader`` seeds its workers), so the same seed gives the same values run
to run whatever order the threads send in, and no request waits on another
worker's generator.

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
    """Where this process's default CPU generator's state lives, and each worker session's copy of it.

    One per process (the default generator is the process's); links call it
    around random graphs and before they wait (see the module docstring).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._mirror: dict[int, bytes] = {}  # id(link) -> the state that worker's session last told us of
        self._valid: set[int] = set()  # links whose session still holds its mirror (no random graph since)
        self._last_sent: dict[int, int] = {}  # id(link) -> the epoch of the last random graph sent there
        self._owner = None  # the link whose worker holds the state now (None: here)
        self._epoch = 0  # counts random graphs sent: a state answered for an older one is stale
        self._last = None  # the Launched of the last random graph sent to the owner without waiting
        seed = secrets.randbits(63)
        sentinel = torch.Generator()
        sentinel.manual_seed(seed)
        self._sentinel, self._sentinel_seed = sentinel.get_state(), seed
        self._before: torch.Tensor | None = None  # the state when it left (restored if that worker is lost)
        self._warned = False
        self._forked: dict[int, bytes | None] = {}  # id(link) -> its own stream's first state (None: sent)

    def _parked(self) -> bool:
        return torch.equal(torch.get_rng_state(), self._sentinel)

    def state_for(self, link) -> bytes | None:
        """The state a random graph about to go to ``link``'s worker must carry (None: its session
        goes on from the state it holds)."""
        with self._lock:
            if id(link) in self._forked:  # a stream of its own (fork): its first state, then on from it
                state = self._forked[id(link)]
                self._forked[id(link)] = None
                return state
            owner = self._owner
            if owner is not None and not self._parked():
                self._changed_here()
                owner = None
            if owner is link:
                return None
        if owner is not None:  # it lives on another worker: bring it back first (a read there)
            owner.bring_back_generator()  # (outside this lock: that worker's link has its own)
        with self._lock:
            if self._owner is not None and self._owner is not link:  # it could not come back: go on
                self._owner = self._last = None
            if self._owner is link:
                return None
            state = bytes(torch.get_rng_state().numpy())
            return None if id(link) in self._valid and self._mirror.get(id(link)) == state else state

    def sent(self, link, state: bytes | None) -> int:
        """A random graph goes to ``link``'s worker (carrying ``state``, or going on from its own): the
        state lives there now; this process's generator is parked. Returns the graph's epoch (its
        reply's changes are :meth:`answered` with it)."""
        with self._lock:
            if state is not None:
                self._mirror[id(link)] = state  # what the worker's session knows the client knows
            self._valid.discard(id(link))  # its state moves on from there: unknown until it tells
            self._epoch += 1
            self._last_sent[id(link)] = self._epoch
            if id(link) in self._forked:  # its own stream: this process's generator stays where it is
                return self._epoch
            if self._owner is None:
                self._before = torch.get_rng_state()
            self._owner, self._last = link, None  # (launched() names its Launched once it is sent)
            torch.set_rng_state(self._sentinel)
            return self._epoch

    def launched(self, link, launched) -> None:
        """The random graph last sent to ``link`` went without waiting: a read there waits for it too."""
        with self._lock:
            if self._owner is link:
                self._last = launched

    def awaited(self, link):
        """Before a wait on ``link``: the random graph whose reply brings the state back, if it lives
        there and that reply is not read yet (else None)."""
        last = self._last
        return last if self._owner is link and last is not None and not last.done else None

    def answered(self, link, epoch: int, changes: list) -> None:
        """What changed in ``link``'s worker's state with random graph ``epoch``: the state comes back
        here if it was the last one sent."""
        with self._lock:
            self._mirror[id(link)] = patched(self._mirror.get(id(link), b""), changes)
            if self._last_sent.get(id(link), 0) <= epoch:
                self._valid.add(id(link))
            if self._owner is link and epoch == self._epoch:
                if self._parked():
                    torch.set_rng_state(torch.frombuffer(bytearray(self._mirror[id(link)]), dtype=torch.uint8))
                else:
                    self._changed_here()
                self._owner = self._last = None

    def _changed_here(self) -> None:
        """The program changed the generator while its state lived on a worker: its state wins.

        A reseed (``manual_seed``, ``set_rng_state``) is what the program
        meant; a draw from the sentinel (its seed is still the sentinel's) is
        not what eager would have drawn, and is said once.
        """
        self._owner = self._last = None
        if torch.initial_seed() == self._sentinel_seed and not self._warned:
            self._warned = True
            log.warning("random numbers were drawn here while a remote random graph's generator state was on "
                        "its worker (before any read there): they are not those a local run would draw. Read "
                        "a value (or call session.synchronize()) first, or set REMOTORCH_LAUNCH_BLOCKING=1")

    def fork(self, links: list) -> None:
        """Give each of ``links`` a generator stream of its own for the next random graphs (a step on
        several workers at once): one seed drawn from this process's generator (brought back here
        first), and stream ``i`` seeded with it plus ``i``. Until the next fork, those links' random
        graphs go on from their own streams."""
        for link in {id(l): l for l in links}.values():
            self.bring_back(link)
        with self._lock:
            if self._owner is not None:  # it could not come back: go on from here
                self._owner = self._last = None
            base = int(torch.empty((), dtype=torch.int64).random_().item())
            self._forked = {}
            for i, link in enumerate(links):
                g = torch.Generator()
                g.manual_seed((base + i) % (1 << 63))
                self._forked[id(link)] = bytes(g.get_state().numpy())

    def bring_back(self, link) -> None:
        """Bring the state back here if it lives on ``link``'s worker (a read there)."""
        if self._owner is link:
            link.bring_back_generator()

    def forget(self, link) -> None:
        """``link``'s worker no longer holds its session's state (a new session, or the link closed)."""
        with self._lock:
            self._mirror.pop(id(link), None)
            self._valid.discard(id(link))
            self._forked.pop(id(link), None)
            if self._owner is link:
                self._owner = self._last = None
                if self._parked() and self._before is not None:  # as it was before the lost graphs
                    torch.set_rng_state(self._before)


GENERATORS = Generators()
