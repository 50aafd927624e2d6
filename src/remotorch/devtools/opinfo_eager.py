"""torch's OpInfo database through remotorch's eager calls on kept values, against eager torch.

The eager mode of :mod:`remotorch.devtools.opinfo`: each sample's tensors are
first made values kept on the worker (the outputs of a compiled identity,
``fallback="raise"``), then the operator runs on them eagerly, outside any
compiled region, so every call goes to the worker as an eager call
(``remotorch.client.eager``). The reference is eager torch on the sample's
own tensors, run twice (a case whose two runs differ is not counted).
Forward compares the outputs; backward also the gradients of every input for
seeded random cotangents (they flow back through the eager call's backward
graph on the worker, then the identity's), bit for bit. A case none of whose
calls went to the worker (the operator read its inputs and ran here: ``item``,
``tolist``…) is *no graph*, not counted.

The kept values are the outputs of a compiled graph, and a compiled graph is
not quite eager torch in backward: aot_autograd's backward of the identity
gives a gradient of zeros where eager's gives None (an input the operator's
gradient does not reach), and sums gradients in its own order. So a sample
that differs from eager torch is also run by torch alone behind the same
identity compiled with ``backend="aot_eager"``, and then with the operator's
call compiled by aot_eager too (an eager call that needs gradients runs as an
aot_autograd pair of graphs, whose backward is traced from torch's own
formulas and may round differently from eager autograd); equal to either, it
is :data:`~remotorch.devtools.opinfo.AS_COMPILED` (counted, reported apart
from the equal ones, naming which): the difference is torch's own compiled
graph's, not the eager call's.
"""

from __future__ import annotations

import itertools
import time

import torch

from . import opinfo


_made = itertools.count()


def _keeper(session):
    """The tensors given, as values kept on the session's worker (a compiled identity). Each is a graph
    of its own (a constant output tells them apart): a graph whose outputs Python read before sends
    them back in its reply from then on (``client.policy``), and a sample's reads must not teach the
    next sample's identity that. Without a session: the same identity under torch's own aot_eager."""
    import remotorch

    tag = float(next(_made))

    def identity(*ts):
        return (*[t.clone() for t in ts], torch.full((), tag))

    if session is None:
        compiled = torch.compile(identity, backend="aot_eager", fullgraph=True)
    else:
        compiled = remotorch.compile(identity, session=session, fallback="raise")
    return lambda *ts: compiled(*ts)[:-1]


def check(info, sample, case: opinfo.Case, session) -> opinfo.Result:
    """Run one sample eagerly (twice) and eagerly on kept values; what it came to."""
    start = time.perf_counter()
    call = opinfo._Call(info, sample, case.direction)

    def result(status: str, detail: str = "") -> opinfo.Result:
        return opinfo.Result(case, status, detail, time.perf_counter() - start)

    if opinfo.marked_nondeterministic(info):
        return result(opinfo.NONDETERMINISTIC, "torch's OpInfo: output is non-deterministic")
    fn = call.function()
    try:
        want = call.run(fn)
        opinfo._scribble(want)
        again = call.run(fn)
    except Exception as exc:  # eager torch itself fails: not counted
        return result(opinfo.REFERENCE_FAILS, opinfo.describe(exc))
    why = opinfo.difference(want, again)
    if why is not None:
        return result(opinfo.NONDETERMINISTIC, why)
    before = session.stats()["eager_ops"]
    try:
        torch._dynamo.reset()
        keep = _keeper(session)
        have = call.run(lambda *ts: fn(*keep(*ts)))
        session.synchronize()
    except Exception as exc:
        return result(opinfo.DIFFERS, opinfo.describe(exc))
    why = opinfo.difference(want, have)
    if session.stats()["eager_ops"] == before:
        return result(opinfo.NO_GRAPH, "no eager call went to the worker (a view, or a read)"
                      + ("" if why is None else f" (and differs: {why})"))
    if why is None:
        return result(opinfo.EQUAL)
    # torch alone: behind the same identity compiled by aot_eager; then with the call compiled by
    # aot_eager too (an eager call that needs gradients is an aot_autograd graph pair on the worker)
    for what, wrap in (("behind the identity", lambda f: f),
                       ("the call compiled too", lambda f: torch.compile(f, backend="aot_eager"))):
        try:
            torch._dynamo.reset()
            keep, op = _keeper(None), wrap(fn)
            compiled = call.run(lambda *ts: op(*keep(*ts)))
        except Exception:
            continue
        if opinfo.difference(compiled, have) is None:
            return result(opinfo.AS_COMPILED, f"{what}; eager torch's: {why}")
    return result(opinfo.DIFFERS, why)
