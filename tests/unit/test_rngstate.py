"""A generator state's changes travel as the bytes that changed (codec/rngstate.py, protocol.md §17.5)."""

from __future__ import annotations

import pytest
import torch

from remotorch.codec.rngstate import delta, draws_random, patched


def state(g: torch.Generator) -> bytes:
    return bytes(g.get_state().numpy())


@pytest.mark.parametrize("draw", [lambda g: torch.rand(3, generator=g), lambda g: torch.randn(100, generator=g),
                                  lambda g: torch.empty(5000).bernoulli_(0.3, generator=g)])
def test_the_changes_rebuild_the_state_after_any_draw(draw):
    g = torch.Generator().manual_seed(4)
    torch.rand(1, generator=g)  # past the first turn of the words
    before = state(g)
    draw(g)
    after = state(g)
    changes = delta(before, after)
    assert patched(before, changes) == after
    assert delta(after, after) == [] and patched(after, []) == after


def test_a_few_draws_change_a_few_bytes():
    g = torch.Generator().manual_seed(4)
    torch.rand(1, generator=g)
    before = state(g)
    torch.rand(3, generator=g)
    assert sum(len(data) for _, data in delta(before, state(g))) < 32


def test_a_whole_state_and_bad_changes():
    assert patched(b"abc", [[-1, b"xyzw"]]) == b"xyzw"
    assert delta(b"ab", b"abc") == [[-1, b"abc"]]
    with pytest.raises(ValueError):
        patched(b"abc", [[2, b"xy"]])


def test_random_graphs_are_told_from_the_others():
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.randn(4, 4)
    assert draws_random(make_fx(lambda t: torch.nn.functional.dropout(t, 0.5, training=True))(x))
    assert draws_random(make_fx(lambda t: t + torch.rand_like(t))(x))
    assert not draws_random(make_fx(lambda t: t.relu() * 2)(x))


def test_attention_without_dropout_and_dropout_in_eval_draw_nothing_and_are_not_random():
    from torch.fx.experimental.proxy_tensor import make_fx

    aten = torch.ops.aten
    q = torch.randn(2, 2, 8, 16)

    def moved(f) -> bool:  # what torch does: does the call move the generator?
        state = torch.get_rng_state()
        f()
        return not torch.equal(state, torch.get_rng_state())

    cases = [  # (a call, whether it draws)
        (lambda t: aten._scaled_dot_product_flash_attention_for_cpu(t, t, t, 0.0, True)[0], False),
        (lambda t: aten._scaled_dot_product_attention_math(t, t, t, None, 0.0, True)[0], False),
        (lambda t: aten._scaled_dot_product_attention_math(t, t, t, None, 0.5, True)[0], True),
        (lambda t: aten._scaled_dot_product_attention_math(t, t, t, dropout_p=0.0)[0], False),
        (lambda t: aten.native_dropout(t, 0.5, False)[0], False),
        (lambda t: aten.native_dropout(t, 0.0, True)[0], True),  # p 0 in training still draws
        (lambda t: aten.native_dropout(t, 0.5, True)[0], True),
    ]
    for call, draws in cases:
        assert moved(lambda: call(q)) == draws
        assert draws_random(make_fx(call)(q)) == draws
