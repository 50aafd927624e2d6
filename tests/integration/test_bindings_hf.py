"""Argument bindings end to end: a real ``remotorch serve``, a Hugging Face GPT-2 from a tiny config.

The first call names the model's weights as a binding (``Run.bind``,
protocol.md §8.1); warm calls carry only the token ids (``Run.bound``). What
a user sees must not change: logits equal to eager call after call, after a
weight changes in place (fine-tuning a layer locally), after the weights are
swapped for another model's of the same shape, and in a fresh session.
"""

from __future__ import annotations

import torch

import remotorch
from remotorch.codec import messages as m

import transformers  # noqa: E402 (part of the test extra: a missing one fails here rather than skipping)


def tiny_gpt2_lm(seed: int):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(seed))


def record_runs(session) -> list:
    """The header of every ``Run`` the session sends from now on, decoded as the worker reads it."""
    stream, sent = session.connection.link.stream, []
    encode = stream._encode  # every request's header is made by it, waited for or not

    def recording(body, *args):
        if type(body) is m.Run:
            sent.append(m.decode(m.encode(body)))
        return encode(body, *args)
    stream._encode = recording
    return sent


def of_the_model(sent: list) -> list:
    """The runs of the model's graph among ``sent`` (the first one's; a warm run names it by a prefix of
    its id), without the eager calls a comparison makes on outputs kept on the worker."""
    return [r for r in sent if sent[0].graph_id.startswith(r.graph_id)]


def logits(compiled, x):
    return compiled(input_ids=x, use_cache=False).logits


def test_gpt2_warm_calls_send_only_the_tokens_and_match_eager(session):
    model = tiny_gpt2_lm(11)
    compiled = remotorch.compile(model, session=session, fallback="raise")
    sent = record_runs(session)
    with torch.no_grad():
        for seed in (1, 2, 3):
            torch.testing.assert_close(logits(compiled, ids(seed)), logits(model, ids(seed)), rtol=0, atol=0)
    first, *warm = of_the_model(sent)
    resident = [a for a in first.args if type(a) is m.RefArg]
    assert first.bind and len(resident) >= 20  # every weight and buffer of the model, by content id
    for run in warm:
        assert run.bound == first.bind and not run.bind
        assert len(run.args) == len(first.args) - len(resident)
        assert not any(type(a) is m.RefArg for a in run.args)
    assert len(m.encode(warm[0])) < len(m.encode(first)) - 64 * len(resident)
    stats = session.stats()
    assert stats["remote_calls"] - stats["eager_ops"] == 3 and stats["fallbacks"] == 0  # (and the comparisons' calls)


def test_gpt2_fine_tuned_in_place_between_calls_is_bound_again(session):
    model = tiny_gpt2_lm(12)
    compiled = remotorch.compile(model, session=session, fallback="raise")
    x = ids(4)
    sent = record_runs(session)
    with torch.no_grad():
        logits(compiled, x), logits(compiled, x)
        model.transformer.h[1].mlp.c_fc.weight.add_(0.5)  # a local update between calls
        torch.testing.assert_close(logits(compiled, x), logits(model, x), rtol=0, atol=0)
        torch.testing.assert_close(logits(compiled, x), logits(model, x), rtol=0, atol=0)
    runs = of_the_model(sent)
    assert [bool(r.bound) for r in runs] == [False, True, False, True]
    assert runs[2].bind == runs[0].bind


def test_gpt2_with_another_models_weights_loaded_gets_those(session):
    model, donor = tiny_gpt2_lm(13), tiny_gpt2_lm(14)
    compiled = remotorch.compile(model, session=session, fallback="raise")
    x = ids(5)
    with torch.no_grad():
        before = logits(compiled, x)
        model.load_state_dict(donor.state_dict())  # copies in place: every version moves
        after = logits(compiled, x)
        torch.testing.assert_close(after, logits(donor, x), rtol=0, atol=0)
    assert not torch.equal(before, after)


def test_a_fresh_session_binds_again_on_the_same_worker(server, session_for):
    model = tiny_gpt2_lm(15)
    x = ids(6)
    with torch.no_grad():
        want = logits(model, x)
        for _ in range(2):  # the second session finds nothing of the first's bindings
            with session_for(server) as session:
                compiled = remotorch.compile(model, session=session, fallback="raise")
                sent = record_runs(session)
                got = [logits(compiled, x) for _ in range(2)]
            assert [bool(r.bound) for r in of_the_model(sent)] == [False, True]
            for out in got:  # read after the block that made them
                torch.testing.assert_close(out, want, rtol=0, atol=0)
