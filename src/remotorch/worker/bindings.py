"""Argument bindings: a graph's resident arguments that a session named once (``Run.bind``).

A warm call then sends only the other arguments (``Run.bound``); the bound
tensors are held here by value, in place. A binding ends when the session
releases any of its content ids, makes another under the same id, or ends
(protocol.md §8.1).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..codec import messages as m
from ..errors import InvalidRequestError, MissingObjectsError


@dataclass(frozen=True)
class Binding:
    """A graph's resident arguments a session named once (``Run.bind``): their values, in place."""

    graph_id: str
    template: list  # the graph's arguments: the bound tensors at their positions, None elsewhere
    free: tuple[int, ...]  # the positions a ``Run.bound`` request's ``args`` fill, in order
    ids: frozenset[str]  # the content ids it holds (a release of one drops it)

    def fill(self, values: list) -> list:
        """The graph's full arguments: the bound ones, and ``values`` at the free positions."""
        full = self.template.copy()
        for i, v in zip(self.free, values):
            full[i] = v
        return full


class Bindings(dict):
    """Every session's bindings: session -> binding id -> :class:`Binding` (``pop(session)`` ends them)."""

    def find(self, session: object, bound: int, gid: str, n_args: int) -> Binding:
        """Binding ``bound`` of the session, for graph ``gid`` called with ``n_args`` free arguments."""
        binding = self.get(session, {}).get(bound)
        if binding is None:
            raise MissingObjectsError(f"worker does not hold argument binding {bound} for this session",
                                      bindings=[bound])
        if binding.graph_id != gid or n_args != len(binding.free):
            raise InvalidRequestError(f"argument binding {bound} is for another graph or takes "
                                      f"{len(binding.free)} arguments, not {n_args}")
        return binding

    def bind(self, session: object, bind: int, gid: str, args: list, values: list) -> None:
        """Remember the ``RefArg`` arguments of this call as binding ``bind`` (replacing one of that id)."""
        if not (type(bind) is int and 1 <= bind <= m.MAX_BINDINGS):
            raise InvalidRequestError(f"an argument binding id is 1 to {m.MAX_BINDINGS}, not {bind}")
        refs = [i for i, a in enumerate(args) if type(a) is m.RefArg]
        template = [None] * len(values)
        for i in refs:
            template[i] = values[i]
        free = tuple(i for i in range(len(args)) if type(args[i]) is not m.RefArg)
        self.setdefault(session, {})[bind] = Binding(gid, template, free, frozenset(args[i].id for i in refs))

    def unbind(self, session: object, ids) -> None:
        """Drop the session's bindings that hold any of these content ids (released: no longer its own)."""
        held = self.get(session)
        if held:
            gone = set(ids)
            for bid in [b for b, binding in held.items() if not gone.isdisjoint(binding.ids)]:
                del held[bid]
