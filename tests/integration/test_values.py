"""What can go in and come out of a remote graph: containers, scalars, dtypes, layouts."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

import remotorch


def compile_remote(fn, session, **kwargs):
    return remotorch.compile(fn, session=session, fallback="raise", **kwargs)


def assert_same(out, expected) -> None:
    """Same container structure and bitwise-equal tensors (same dtype, same shape)."""
    out_leaves, out_spec = pytree.tree_flatten(out)
    exp_leaves, exp_spec = pytree.tree_flatten(expected)
    assert out_spec == exp_spec
    for o, e in zip(out_leaves, exp_leaves):
        if isinstance(e, torch.Tensor):
            assert isinstance(o, torch.Tensor)
            assert o.dtype == e.dtype and o.shape == e.shape
            assert torch.equal(o, e)
        else:
            assert o == e


def run_both(fn, session, *calls, **kwargs):
    compiled = compile_remote(fn, session, **kwargs)
    for args in calls:
        with torch.no_grad():
            assert_same(compiled(*args), fn(*args))
    assert session.stats()["fallbacks"] == 0
    assert session.stats()["remote_calls"] >= len(calls)
    return compiled


def test_tuple_output(session):
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    run_both(lambda a, b: (a + b, a * b), session, (a, b))


def test_list_output(session):
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    run_both(lambda a, b: [a + b, a - b, a.sum()], session, (a, b))


def test_dict_output(session):
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    run_both(lambda a, b: {"sum": a + b, "prod": a * b, "nested": (a.max(), [b.min()])}, session, (a, b))


def test_several_inputs_of_different_shapes(session):
    def fn(a, b, c, d):
        return (a @ b + c).relu() * d.unsqueeze(0)

    args = (torch.randn(3, 4), torch.randn(4, 6), torch.randn(6), torch.randn(6))
    run_both(fn, session, args, tuple(torch.randn_like(t) for t in args))


def test_python_int_inputs(session):
    x = torch.randn(4, 5)
    run_both(lambda a, n: a * n + n, session, (x, 2), (x, 3), (x, 7))


def test_python_float_inputs(session):
    x = torch.randn(4, 5)
    run_both(lambda a, f: a * f - f / 2, session, (x, 0.5), (x, 1.5), (x, -2.25))


def test_int64_tensors(session):
    a = torch.randn(6, 5)
    idx = torch.tensor([3, 0, 2, 5])
    run_both(lambda a, i: (a[i], i * 2 + 1, i.sum(), torch.argmax(a, dim=1)), session, (a, idx))


def test_embedding_lookup_with_int64_ids(session):
    w = torch.randn(10, 3)
    ids = torch.randint(0, 10, (4, 6))
    run_both(lambda w, i: torch.nn.functional.embedding(i, w), session, (w, ids))


def test_bool_tensors(session):
    a = torch.randn(4, 5)
    mask = a > 0
    run_both(lambda a, m: (torch.where(m, a, -a), m & (a < 1), ~m, m.any()), session, (a, mask))


def test_bool_output(session):
    run_both(lambda a: a > 0, session, (torch.randn(3, 3),))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.uint8])
def test_other_dtypes(session, dtype):
    a = (torch.randn(4, 4) * 10).to(dtype)
    run_both(lambda a: (a + a, a.sum(0)), session, (a,))


def test_transposed_input(session):
    x = torch.randn(5, 4)
    w = torch.randn(5, 2)
    assert not x.t().is_contiguous()
    run_both(lambda t, w: t @ w + 1, session, (x.t(), w))


def test_sliced_with_step_input(session):
    y = torch.randn(8, 10)
    sliced = y[::2, 1::3]
    assert not sliced.is_contiguous()
    # elementwise only: the worker receives a compacted copy, and a reduction over a
    # different layout may round differently
    run_both(lambda t: (t.sin() * 2 + 1, t[:, 0] - t[:, -1]), session, (sliced,))


def test_channels_last_input(session):
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    conv = torch.nn.Conv2d(3, 4, 3).eval()
    run_both(lambda t: conv(t).relu(), session, (x,))


def test_expanded_input(session):
    base = torch.randn(1, 6)
    expanded = base.expand(4, 6)
    run_both(lambda t: t * torch.arange(4.0).unsqueeze(1), session, (expanded,))


def test_output_that_is_a_view_of_an_input(session):
    x = torch.randn(5, 4)
    run_both(lambda t: (t.t(), t[1:3] * 2), session, (x,))


def test_zero_dim_and_empty_tensors(session):
    run_both(lambda s, e: (s * 2, e + 1, e.sum()), session, (torch.tensor(3.5), torch.empty(0, 4)))


def test_scalar_outputs(session):
    run_both(lambda t: (t.sum(), t.shape[0] * 2), session, (torch.randn(3, 2),))


def test_an_expanded_output_comes_back_with_its_layout(session):
    """An output that views one element many times (``expand``: stride 0) is filled once per element."""
    def f(x):
        return x.expand(3, 4, 5), (x * 2).expand(2, 4, 5), x.t().expand(2, 5, 4)

    compiled = compile_remote(f, session)
    x = torch.randn(4, 1).expand(4, 5).contiguous()[:, :1]
    with torch.no_grad():
        got, want = compiled(x), torch.compile(f, backend="aot_eager")(x)
    assert_same(got, want)
    assert [t.stride() for t in got] == [t.stride() for t in want]
    big = torch.randn(1, 512).expand(4096, 512)  # an expanded input travels as its one row (2 KiB, not 8 MiB)
    before = session.stats()["bytes_sent"]
    with torch.no_grad():
        assert_same(compile_remote(lambda t: t * 3 + 1, session)(big), big * 3 + 1)
    assert session.stats()["bytes_sent"] - before < 1 << 20
    assert session.stats()["fallbacks"] == 0
