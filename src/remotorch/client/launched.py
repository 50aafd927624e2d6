"""The record of one request on a stream (:class:`Launched`), and how its failure is named.

A request sent without waiting is a :class:`Launched` call: its reply, or
its error, is read later, in order (:mod:`remotorch.client.stream`). A
failure is raised where its results are used, naming what failed and the
Python line that issued it; a request that failed only because it used what
another one was to make names that one (its root).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from .. import errors
from . import origin as origins


class Launched:
    """A request sent without waiting for its reply; its reply (or error) is read in order later.

    ``what`` names it in errors ("graph 3f2a9c01d2e4"); ``on_reply(reply,
    frames)`` runs when its reply is read (an exception it raises fails the
    call); ``effect``: it makes no value Python can read (an optimizer step, an
    upload): a failure is raised at the next read on the stream. ``makes``:
    keys of the objects it creates on the worker (``("h", handle id)``), so a
    later request that misses one of them fails with this call's error.
    ``quiet``: lost with its worker, it loses nothing Python holds (releases of
    values that went with the worker): not raised unread. ``step``: an
    optimizer step (counts against ``QueueLimits.steps``); ``on_read``: called
    at the first read that waits for it, with whether that came at once;
    ``queued``: False when its caller waits for the reply at once; ``origin``:
    the line that issued it. (Not a dataclass: one is made per request, and
    only the arguments are set; the rest starts from the class's values.)
    """

    seq, done, reported, nbytes, sent_at = 0, False, False, 0, 0.0
    error: errors.RemoteError | None = None
    reply, frames = None, None
    message: tuple = ()  # (header, frames) as sent, for a replay
    alone = False  # sent while nothing else was in flight (its round trip had no queue)
    coalesce = False  # an eager call: it may leave together with those queued next to it (client.coalesce)
    subs: tuple | list = ()  # a message of coalesced calls: their records (each answered on its own)
    # a coalesced call's handler of a reply that said nothing of it (only its worker's milliseconds),
    # instead of on_reply with a reply made for it: None (on_reply is called)
    on_quiet: Callable[[float], None] | None = None

    def __init__(self, what: str, on_reply: Callable[[object, list], None] | None = None,
                 expect: type | None = None, on_error: Callable[[errors.RemoteError], None] | None = None,
                 effect: bool = False, quiet: bool = False, makes: tuple = (), step: bool = False,
                 on_read: Callable[[bool], None] | None = None, queued: bool = True, origin: tuple = ()) -> None:
        self.what, self.on_reply, self.expect, self.on_error = what, on_reply, expect, on_error
        self.effect, self.quiet, self.makes, self.step = effect, quiet, makes, step
        self.on_read, self.queued, self.origin = on_read, queued, origin

    def __repr__(self) -> str:
        state = "failed" if self.error is not None else ("answered" if self.done else "in flight")
        return f"<Launched {self.seq}: {self.what}, {state}>"

    def raise_error(self) -> None:
        """Raise what the call failed with, naming the call and the line that issued it."""
        exc = self.error
        if exc is None:
            return
        root = getattr(exc, "launched_root", None) or self
        self.reported = root.reported = True
        raise named(root.error if root.error is not None else exc, root, self) from exc


def root(launched: Launched) -> Launched:
    """The failure a failed call's error comes from (itself, or the one it depended on)."""
    return getattr(launched.error, "launched_root", None) or launched


def named(exc: errors.RemoteError, root: Launched, dependent: Launched) -> errors.RemoteError:
    """The error as the user sees it: the root failure's type, what failed, the line that issued it,
    and the worker's text (and, for a request that failed because of it, that one too)."""
    issued = f" (issued at {origins.describe(root.origin)})" if root.origin or root.queued else ""
    text = f"{root.what}{issued} failed: {exc.message}"
    if dependent is not root:
        text = f"{dependent.what} could not run: it depends on {text}"
    new = copy.copy(exc)  # its type and what it carries (missing objects, ranks…)
    new.message, new.args = text, (text,)
    new.launched_root = root
    return new
