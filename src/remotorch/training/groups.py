"""A process group of some of a session's workers, formed and driven by the client.

The client owns rendezvous: it asks the first member to host a store on
its group host (``OpenStore``), picks a fresh key prefix for this group's
generation (so a group re-formed after a failure never meets the old one's
keys, as torchft does), and asks every member to join at once, with a
deadline. Afterwards every collective is one small request to each member,
sent at once; the tensors move between the workers, never through here.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable, Sequence

from .. import errors
from ..client.connection import Connection
from ..client.launched import Launched
from ..codec import messages as m

_ids = itertools.count(1)  # group ids: unique among this process's groups, so within every worker session


class WorkerGroup:
    """Members (connections, rank = position) of one torch.distributed group on the workers."""

    def __init__(self, members: Sequence[Connection], *, timeout_s: float = 60.0, generation: int = 0) -> None:
        if len({id(c) for c in members}) != len(members):
            raise ValueError("a worker can be in a group once")
        self.members = list(members)
        self.timeout_s = timeout_s
        self.generation = generation
        self.id = next(_ids)
        self.prefix = f"remotorch/{secrets.token_hex(8)}/{generation}/"
        self.broken: BaseException | None = None
        self._form()

    @property
    def world(self) -> int:
        return len(self.members)

    def names(self, ranks: Sequence[int]) -> str:
        return ", ".join(f"{self.members[r].name or self.members[r].url} (rank {r})"
                         for r in ranks if 0 <= r < self.world)

    def _form(self) -> None:
        store = self.members[0].request(m.OpenStore(self.timeout_s), expect=m.StoreReply)[0].address
        try:
            self.ask([m.JoinGroup(self.id, store, self.prefix, rank, self.world, self.timeout_s)
                      for rank in range(self.world)])
        except errors.GroupError as exc:  # the worker names the ranks missing; here, which worker each is
            raise errors.GroupError(f"the group of {self.world} workers did not form: {exc.message} "
                                    f"(ranks: {self.names(range(self.world))})", ranks=exc.ranks) from None

    def ask(self, bodies: Sequence, expect: type = m.Ok) -> list:
        """Send ``bodies[rank]`` to every member, all before waiting for any (a collective needs every
        member): each request is posted on its member's link, then the replies are read. The replies,
        by rank.

        The first failure is raised once every reply is in: a typed error of a
        member that died is preferred to the ``GroupError`` the others see.
        After a failure the group is broken (form a new one).
        """
        if self.broken is not None:
            raise errors.GroupError(f"this group broke earlier ({self.broken}); form a new one")
        replies: list = [None] * self.world
        sent = []
        try:
            for rank, (conn, body) in enumerate(zip(self.members, bodies)):
                done = Launched(f"{type(body).__name__} to {self.names([rank])}",
                                lambda reply, _frames, rank=rank: replies.__setitem__(rank, reply), expect)
                sent.append((conn, conn.link.launch(body, (), done)))
        finally:  # whatever went out is waited for, so no reply is left behind on a link
            for conn, done in sent:
                conn.link.settle(done)
        failures = [done.error for _, done in sent if done.error is not None]
        for _, done in sent:
            done.reported = True  # raised here (as the group's failure), not again at synchronize()
        if failures or len(sent) < self.world:
            failures.sort(key=lambda exc: isinstance(exc, errors.GroupError))
            self.broken = failures[0] if failures else errors.GroupError("a member could not be asked")
            raise self.broken
        return replies

    def _run(self, go: Callable[[], list]) -> list:
        try:
            return go()
        except BaseException as exc:
            self.broken = exc
            raise

    def leave(self) -> None:
        """Every member drops the group (best effort: a dead member is past caring)."""
        for conn in self.members:
            try:
                conn.request(m.LeaveGroup(self.id), expect=m.Ok)
            except errors.RemoteError:
                pass
