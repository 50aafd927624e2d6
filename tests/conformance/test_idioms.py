"""The idioms of everyday PyTorch code, on real models, equal to aot_eager.

Each test is one piece of user code written once and run twice: under
``torch.compile(backend="aot_eager")`` with ``torch.optim`` optimizers, and
on remotorch (a real ``remotorch serve``, ``fallback="raise"``,
``RemoteOptimizer``) inside ``with Session()``, its results read after the
block. ``torch.inference_mode``, bf16 autocast, gradient accumulation, a
learning-rate scheduler, activation checkpointing, and outputs kept in a
list and read much later.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import remotorch
from remotorch.devtools import conformance, zoo
from remotorch.optim import RemoteOptimizer

from conftest import TOKEN
from helpers import train_steps

# the zoo's aot_eager references start computing in a second process while these tests run
pytestmark = pytest.mark.usefixtures("zoo_references")


def both(server, user_code: Callable) -> tuple[dict, dict]:
    """``user_code(compile, optimizer)`` under aot_eager and on remotorch; the tensors each returned."""
    results = []
    for backend in ("aot_eager", "remotorch"):
        conformance._seed()
        torch._dynamo.reset()
        if backend == "aot_eager":
            held = user_code(lambda fn, **kw: torch.compile(fn, backend="aot_eager", **kw),
                             lambda params, **kw: torch.optim.AdamW(params, **kw))
        else:
            with remotorch.Session(server.url, token=TOKEN) as session:
                held = user_code(lambda fn, **kw: remotorch.compile(fn, session=session, fallback="raise", **kw),
                                 lambda params, **kw: RemoteOptimizer(torch.optim.AdamW, params, session=session,
                                                                      **kw))
                assert session.stats()["remote_calls"] > 0 and session.stats()["fallbacks"] == 0
        results.append(conformance._read(held))  # (remotorch: read after the block)
    return results[0], results[1]


def assert_same(reference: dict, got: dict, rtol: float = conformance.RTOL, atol: float = conformance.ATOL):
    assert reference.keys() == got.keys()
    for name, want in reference.items():
        torch.testing.assert_close(got[name], want, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("name", ["GPT2LMHeadModel", "BertForMaskedLM"])
def test_inference_mode(server, name):
    spec = zoo.by_name(name)

    def user_code(compile, optimizer):
        model = spec.build().eval()
        compiled = compile(model)
        with torch.inference_mode():
            first = compiled(**spec.inputs())
            second = compiled(**spec.inputs())
        return {"first": first.logits, "second": second.logits}

    assert_same(*both(server, user_code))


def test_bf16_autocast_forward_and_training(server):
    spec = zoo.by_name("LlamaForCausalLM")

    def user_code(compile, optimizer):
        model = spec.build().train()
        compiled, opt = compile(model), optimizer(model.parameters(), lr=1e-3)
        inputs = spec.inputs()
        outs = []

        def loss():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outs.append(compiled(**inputs, labels=inputs["input_ids"]))
            return outs[-1].loss

        losses = train_steps(loss, opt)
        assert outs[-1].logits.dtype == torch.bfloat16
        return {"losses": losses, "logits": outs[-1].logits, **dict(model.named_parameters())}

    reference, got = both(server, user_code)
    assert_same(reference, got, rtol=1e-2, atol=1e-3)


def test_gradient_accumulation(server):
    spec = zoo.by_name("BertForMaskedLM")

    def user_code(compile, optimizer):
        model = spec.build().train()
        compiled, opt = compile(model), optimizer(model.parameters(), lr=1e-3)
        inputs = spec.inputs()
        labels = spec.labels(inputs)["labels"]
        halves = [{k: v[i:i + 1] for k, v in inputs.items()} for i in range(2)]
        losses = []
        for _ in range(2):  # two optimizer steps of two micro-batches each
            for i, half in enumerate(halves):
                loss = compiled(**half, labels=labels[i:i + 1]).loss / len(halves)
                loss.backward()
                losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
        return {"losses": losses, **dict(model.named_parameters())}

    assert_same(*both(server, user_code), atol=conformance.PARAM_ATOL)


def test_a_learning_rate_scheduler(server):
    spec = zoo.by_name("GPT2LMHeadModel")

    def user_code(compile, optimizer):
        model = spec.build().train()
        compiled, opt = compile(model), optimizer(model.parameters(), lr=1e-2)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        warm = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        inputs = spec.inputs()
        lrs = []

        def after_step():
            schedule.step()
            warm.step()
            lrs.append(torch.tensor(opt.param_groups[0]["lr"]))

        losses = train_steps(lambda: compiled(**inputs, **spec.labels(inputs)).loss, opt, 3, after_step)
        return {"losses": losses, "lrs": lrs, **dict(model.named_parameters())}

    assert_same(*both(server, user_code), atol=conformance.PARAM_ATOL)


def test_activation_checkpointing_on_a_decoder(server):
    spec = zoo.by_name("LlamaForCausalLM")

    def user_code(compile, optimizer):
        model = spec.build()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        compiled, opt = compile(model), optimizer(model.parameters(), lr=1e-3)
        inputs = spec.inputs()
        losses = train_steps(lambda: compiled(**inputs, **spec.labels(inputs)).loss, opt)
        return {"losses": losses, **dict(model.named_parameters())}

    assert_same(*both(server, user_code), atol=conformance.PARAM_ATOL)


def test_outputs_kept_in_a_list_and_read_much_later(server):
    spec = zoo.by_name("Qwen2ForCausalLM")

    def user_code(compile, optimizer):
        model = spec.build().eval()
        compiled = compile(model, dynamic=True)
        kept = []
        g = torch.Generator().manual_seed(9)
        with torch.no_grad():
            for length in (4, 6, 8, 5, 7, 6):
                ids = torch.randint(3, zoo.VOCAB, (2, length), generator=g)
                out = compiled(input_ids=ids, use_cache=False)
                kept.append(out.logits)  # nothing reads them now
                kept.append(out.logits[:, -1].softmax(-1))  # eager work on a remote value, also kept
        return {"kept": kept}

    assert_same(*both(server, user_code))
