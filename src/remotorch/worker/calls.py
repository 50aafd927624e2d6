"""One run of a compiled graph: its arguments handed over boxed, the saved activations it takes,
and its second try after running out of memory.

Engines take their arguments as aot_autograd's runtime hands them to a compiled graph: boxed, one
list the callable empties as it takes them (:func:`remotorch.worker.engines.call`), so an input is
freed once the graph has last used it, not when the call returns. For that the run path keeps no
other reference to them: the list of values the worker resolved is handed over
(:meth:`Prepared.hand_over`), and a backward whose autograd graph is not kept drops the saved
activations it takes from the session's handles first (``Run.take``), as aot_autograd's
``ctx.maybe_clear_saved_tensors()`` does before it calls a compiled backward. A run that ran out of
memory runs once more (after the caches were given up: :func:`remotorch.worker.guard.guarded`)
with its arguments resolved again; one that took saved activations cannot, and says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import InvalidRequestError


@dataclass
class Ran:
    """One graph run: its outputs (after :func:`~remotorch.worker.outputs.dispose`: wire arguments
    for those not sent inline), the worker's milliseconds, whether it compiled."""

    outputs: list
    ms: float
    compiled: bool
    rng: list | None = None  # a random graph: what changed in the session's generator state


@dataclass
class Prepared:
    """A run ready to go: the engine's callable and the argument values, handed over once."""

    fn: Callable
    values: list | None
    compiled: bool
    compile_ms: float
    random: bool = False  # the graph draws random numbers (from the session's generator state)
    again: Callable[[], list] | None = None  # the arguments resolved once more (None: they cannot be)

    def hand_over(self) -> list:
        """The argument values for one call: the list resolved for this run (nothing else keeps it),
        or, for a second try, the arguments resolved again."""
        values, self.values = self.values, None
        if values is not None:
            return values
        if self.again is None:
            raise MemoryError("out of memory, and the run had taken the saved activations it was given "
                              "(Run.take): it cannot run again")
        return self.again()


def storages(values: list) -> frozenset[int]:
    """The storages of the tensors among ``values`` (by address): an output at one of them is not a
    fresh tensor (taken before the call, which may free them)."""
    return frozenset(v.untyped_storage().data_ptr() for v in values if isinstance(v, torch.Tensor))


def taken(runs: list, arguments: int) -> list[int]:
    """The handle ids of ``Run.take``'s ``[first, count]`` runs; a run takes at most as many handles as it
    has arguments (a count past that, or below one, is refused before anything is dropped)."""
    total = 0
    for run in runs:
        if len(run) != 2 or run[1] < 1:
            raise InvalidRequestError(f"Run.take: {list(run)} is not a [first id, count] run")
        total += run[1]
        if total > arguments:
            raise InvalidRequestError(f"Run.take names more handles than the run's {arguments} argument(s)")
    return [h for first, count in runs for h in range(first, first + count)]
