"""torch's OpInfo database through remotorch equals aot_eager, bit for bit: a fixed subset.

``remotorch.devtools.opinfo`` turns each sample of torch's operator database
(``op_db``) into a function of its tensors, compiled with ``backend="remotorch"``
against the suite's real ``remotorch serve`` (``fallback="raise"``) and with
``backend="aot_eager"``; forward compares the outputs, backward also the
gradients, with tolerance 0. This test runs every ``EVERY``-th operator (in
name order), one sample per dtype and direction, and every operator a sweep
found failing before its fix (``opinfo.FIXED``), two samples, in the five
dtypes. ``python benchmarks/conformance.py --opinfo`` runs the whole database.
"""

from __future__ import annotations

import pytest

import remotorch
from remotorch.devtools import opinfo

from conftest import TOKEN

EVERY = 36
# about four fifths of what the subset counts today (float32 forward: 43 of 44): a change that made
# samples stop counting (aot_eager failing, nothing compiled) would otherwise pass by comparing less
MIN_COUNTED = {("float32", "forward"): 34, ("float32", "backward"): 29, ("bfloat16", "forward"): 16,
               ("bfloat16", "backward"): 15, ("int64", "forward"): 13, ("bool", "forward"): 11,
               ("complex64", "forward"): 24, ("complex64", "backward"): 20}
EAGER_MIN_COUNTED = 11  # float32 forward samples of the subset counted in eager mode (14 today)


@pytest.fixture(scope="module")
def results(server):
    infos = opinfo.op_db()
    fixed = [info for info in infos if opinfo.full_name(info) in opinfo.FIXED]
    assert len(fixed) == len(opinfo.FIXED)
    others = [info for info in opinfo.subset(infos, EVERY) if opinfo.full_name(info) not in opinfo.FIXED]
    with remotorch.Session(server.url, token=TOKEN) as session:
        out = opinfo.sweep(others, session, limit=1) + opinfo.sweep(fixed, session, limit=2)
    assert server.alive(), server.stderr_text()[-4000:]
    return out


@pytest.fixture(scope="module")
def eager_results(server):
    """The same subset as eager calls on values kept on the worker (``opinfo_eager``), float32 and int64."""
    from remotorch.devtools import opinfo_eager

    infos = opinfo.subset(opinfo.op_db(), EVERY)
    with remotorch.Session(server.url, token=TOKEN, keep_min_bytes=0) as session:
        out = opinfo.sweep(infos, session, dtypes=("float32", "int64"), limit=1, checker=opinfo_eager.check)
    assert server.alive(), server.stderr_text()[-4000:]
    return out


def test_every_counted_eager_call_equals_eager_torch(eager_results):
    bad = [f"{r.case}: {r.detail}" for r in eager_results if r.status == opinfo.DIFFERS]
    assert not bad, f"{len(bad)} sample(s) differ from eager torch:\n" + "\n".join(bad)
    counted = opinfo.tally(eager_results)
    # about four fifths of what the subset counts today: a change that made calls stop going to the
    # worker (read and run here instead) would otherwise pass by comparing less
    assert counted[("float32", "forward")]["counted"] >= EAGER_MIN_COUNTED, counted


def _eager_sweep(server, names, **kw):
    from remotorch.devtools import opinfo_eager

    infos = [i for i in opinfo.op_db() if opinfo.full_name(i) in names]
    assert len(infos) == len(names)
    with remotorch.Session(server.url, token=TOKEN, keep_min_bytes=0) as session:
        return opinfo.sweep(infos, session, dtypes=("float32",), limit=2, checker=opinfo_eager.check, **kw)


def test_a_difference_that_torchs_own_compiled_graphs_make_is_told_apart(server, monkeypatch):
    """cosine_embedding_loss's target gets a gradient of zeros behind a compiled identity where eager
    gives None; linalg.qr's backward traced by aot_autograd rounds differently from eager autograd. Both
    equal torch alone behind the same references, so they are "as aot_eager", naming which; the same
    calls made wrong on the worker's side differ from every reference."""
    from remotorch.devtools import opinfo_eager

    names = ("nn.functional.cosine_embedding_loss", "linalg.qr")
    backward = {str(r.case): r for r in _eager_sweep(server, names) if r.case.direction == "backward"}
    as_compiled = {case: r.detail for case, r in backward.items() if r.status == opinfo.AS_COMPILED}
    assert set(as_compiled) >= {"nn.functional.cosine_embedding_loss float32 backward #0",
                                "linalg.qr float32 backward #0"}, backward
    assert as_compiled["nn.functional.cosine_embedding_loss float32 backward #0"].startswith("behind the identity")
    assert as_compiled["linalg.qr float32 backward #0"].startswith("the call compiled too")
    assert all(r.status in (opinfo.EQUAL, opinfo.AS_COMPILED) for r in backward.values()), backward

    keeper = opinfo_eager._keeper

    def off_by_a_little(session):  # the kept values a little off: a wrong result on the worker's side
        keep = keeper(session)
        if session is None:
            return keep
        return lambda *ts: tuple(t + 1e-3 if t.is_floating_point() else t for t in keep(*ts))

    monkeypatch.setattr(opinfo_eager, "_keeper", off_by_a_little)
    wrong = _eager_sweep(server, names)
    assert wrong and all(r.status == opinfo.DIFFERS for r in wrong if r.status in opinfo.COUNTED), wrong
    assert sum(r.status == opinfo.DIFFERS for r in wrong) >= 4, wrong


def test_every_counted_sample_equals_aot_eager(results):
    bad = [f"{r.case}: {r.detail}" for r in results if r.status == opinfo.DIFFERS]
    assert not bad, f"{len(bad)} sample(s) differ from aot_eager:\n" + "\n".join(bad)


def test_enough_samples_count_in_every_dtype_and_direction(results):
    table = opinfo.tally(results)
    counted = {key: row["counted"] for key, row in table.items()}
    short = {key: (counted.get(key, 0), least) for key, least in MIN_COUNTED.items() if counted.get(key, 0) < least}
    assert not short, f"too few samples counted (got, least): {short}"
    fixed = {r.case.op for r in results if r.status == opinfo.EQUAL and r.case.op in opinfo.FIXED}
    assert fixed == set(opinfo.FIXED), f"not compared equal: {set(opinfo.FIXED) - fixed}"
