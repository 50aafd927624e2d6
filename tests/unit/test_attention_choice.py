"""The worker says which attention kernel it picks (protocol.md §8.5); the client asks once per signature.

The kernel torch picks on a CUDA device can only be asked of a CUDA worker (``tests/integration/
test_gpu_parity.py`` compares it with torch's own choice there); here: a CPU worker's answer,
its checks, the worker remembering its answers, and the client asking only what it does not know.
"""

from __future__ import annotations

import pytest
import torch

import remotorch
from remotorch.client.attention import AttentionKernels
from remotorch.codec import messages as m
from remotorch.worker import attention as worker_attention
from remotorch.worker.quota import Limits
from remotorch.worker.service import Service
from remotorch.worker.worker import Worker

from conftest import TOKEN


def sig(*shape, dtype="float32", grad=False, strides=None) -> m.TensorSig:
    strides = strides or tuple(int(s) for s in torch.empty(shape).stride())
    return m.TensorSig(dtype, tuple(shape), strides, grad)


def call(**kw) -> m.AttentionCall:
    q = sig(2, 4, 64, 40, grad=True)
    return m.AttentionCall(q, q, q, **kw)


def ask(service: Service, body) -> object:
    header, _ = service.handle(1, m.encode(body), [])
    return m.decode(header)


def test_a_cpu_worker_answers_math_for_every_call():
    service = Service(Worker("cpu"))
    reply = ask(service, m.AttentionChoice([call(is_causal=True), call(mask=sig(64, 64, dtype="bool"))]))
    assert reply == m.AttentionChoiceReply(["math", "math"])


@pytest.mark.parametrize("bad, kind", [
    (call(dropout_p=1.5), "invalid"),
    (m.AttentionCall(sig(64, 40), m.TensorSig("float32", (64,), (1,)), sig(64, 40)), "invalid"),
    (m.AttentionCall(sig(64, 40), sig(64, 40), m.TensorSig("float99", (64, 40), (40, 1))), "invalid"),
    (call(mask=m.TensorSig("bool", (1 << 20, 1 << 20), (1 << 20, 1))), "limit"),
])
def test_a_malformed_or_oversized_signature_is_refused(bad, kind):
    service = Service(Worker("cpu", limits=Limits(max_tensor_bytes=1 << 30)))
    reply = ask(service, m.AttentionChoice([bad]))
    assert isinstance(reply, m.ErrorReply) and reply.kind == kind, reply
    assert isinstance(ask(service, m.Health()), m.HealthReply)  # and the worker keeps serving


def test_more_calls_than_one_request_may_name_are_refused():
    reply = ask(Service(Worker("cpu")), m.AttentionChoice([call()] * (m.MAX_ATTENTION_CALLS + 1)))
    assert isinstance(reply, m.ErrorReply) and reply.kind == "limit"


def test_the_worker_answers_each_signature_once(monkeypatch):
    choices = worker_attention.AttentionChoices(torch.device("cpu"), 1 << 30)
    asked = []
    monkeypatch.setattr(choices, "_choose", lambda c: asked.append(c) or "efficient")
    assert choices.choose([call(), call(), call(is_causal=True)]) == ["efficient"] * 3
    assert choices.choose([call(is_causal=True)]) == ["efficient"]
    assert asked == [call(), call(is_causal=True)]


class _Worker:
    """What a connection's request reaches: answers "flash" for causal calls, records each request."""

    def __init__(self) -> None:
        self.requests = []

    def __call__(self, body, frames=(), expect=None):
        self.requests.append(body)
        return m.AttentionChoiceReply(["flash" if c.is_causal else "math" for c in body.calls]), []


def test_the_client_asks_only_for_signatures_it_does_not_know():
    worker = _Worker()
    kernels = AttentionKernels(worker)
    assert kernels.choose([call(is_causal=True), call(), call(is_causal=True)]) == ["flash", "math", "flash"]
    assert kernels.choose([call(), call(is_causal=True)]) == ["math", "flash"]
    assert [len(r.calls) for r in worker.requests] == [2]  # one request, each signature once
    many = [call(scale=float(i + 1)) for i in range(m.MAX_ATTENTION_CALLS + 3)]
    kernels.choose(many)
    assert [len(r.calls) for r in worker.requests[1:]] == [m.MAX_ATTENTION_CALLS, 3]
    kernels.forget()  # a reconnect (perhaps to a restarted worker): asked again
    kernels.choose([call()])
    assert len(worker.requests) == 4


def test_a_session_asks_a_real_worker_over_the_wire(server):
    with remotorch.Session(server.url, token=TOKEN) as s:
        assert s.attention_backends(None, [call(is_causal=True)]) == ["math"]
        sent = s.connection_for(None).bytes_sent
        assert s.attention_backends(None, [call(is_causal=True)]) == ["math"]
        assert s.connection_for(None).bytes_sent == sent  # known: not asked again
