"""Attention traced as the kernel a CUDA worker picks, with the worker's answer mocked.

A client traces on its CPU; for a worker on a CUDA device, capture asks the worker which fused
attention kernel torch would pick for each call signature (protocol.md §8.5) and traces that
kernel's operator, so the forward graph holds ``_scaled_dot_product_efficient_attention`` (or the
flash or cuDNN one) and the backward graph its backward, as ``aot_eager`` traces them on that GPU.
Here a stub runner stands for such a worker (``tests/capture_helpers.py``): it says "cuda" and
answers each question as the test says; nothing runs (the first run of a graph stops the call).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from remotorch.capture.attention import device_only
from remotorch.codec import messages as m
from remotorch.codec.decoding import decode_graph
from remotorch.codec.rngstate import draws_random
from remotorch.errors import RemoteOutOfMemoryError

from capture_helpers import StubWorker as CudaWorker
from capture_helpers import trace

EFFICIENT = "aten._scaled_dot_product_efficient_attention.default"
FLASH = "aten._scaled_dot_product_flash_attention.default"
CUDNN = "aten._scaled_dot_product_cudnn_attention.default"


def ops(graph) -> list[str]:
    """The operators a captured graph calls, as the worker decodes its document."""
    return [str(n.target) for n in _module(graph).graph.nodes if n.op == "call_function"]


def _module(graph) -> torch.fx.GraphModule:
    """The aten graph a RemoteGraph was made of (decoded from the document it uploads: what the worker runs)."""
    return decode_graph(graph.payload.doc, [torch.zeros(0)] * len(graph.payload.consts), torch.device("cpu")).module


def qkv(heads=4, kv_heads=None, head=40, dtype=torch.float32, seq=64):
    torch.manual_seed(0)
    q = torch.randn(2, heads, seq, head, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, kv_heads or heads, seq, head, dtype=dtype, requires_grad=True) for _ in range(2))
    return q, k, v


def causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("answer, dtype, forward", [("efficient", torch.float32, EFFICIENT),
                                                    ("flash", torch.bfloat16, FLASH),
                                                    ("cudnn", torch.bfloat16, CUDNN)])
def test_each_fused_backend_is_traced_with_its_backward(answer, dtype, forward):
    runner = CudaWorker(answer)
    graphs = trace(causal, *qkv(dtype=dtype), runner=runner)
    fw, bw = ops(graphs["forward"]), ops(graphs["backward"])
    assert fw.count(forward) == 1
    assert bw.count(forward.replace(".default", "_backward.default")) == 1
    assert not any("bmm" in op or "softmax" in op or "_for_cpu" in op for op in fw + bw), fw + bw
    call = runner.asked[0][0]
    assert call.query == m.TensorSig(str(dtype).removeprefix("torch."), (2, 4, 64, 40), (10240, 2560, 40, 1), True)
    assert call.is_causal and call.mask is None and call.dropout_p == 0.0
    assert not graphs["forward"].random and not graphs["backward"].random


def test_flash_pads_a_head_size_to_eight_and_cuts_its_output_back():
    graphs = trace(causal, *qkv(head=36, dtype=torch.bfloat16), runner=CudaWorker("flash"))
    gm = _module(graphs["forward"])
    flash = next(n for n in gm.graph.nodes if str(n.target) == FLASH)
    fw = ops(graphs["forward"])
    assert fw.count("aten.constant_pad_nd.default") == 3 and "aten.slice.Tensor" in fw
    assert flash.kwargs["scale"] == pytest.approx(1 / 6)  # the head size it was given: 1/sqrt(36)


def test_a_boolean_mask_is_made_additive_for_the_efficient_kernel_and_its_backward():
    mask = torch.rand(64, 64, generator=torch.Generator().manual_seed(1)) > 0.3
    graphs = trace(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), *qkv(), mask,
                   runner=CudaWorker("efficient"))
    fw, bw = ops(graphs["forward"]), ops(graphs["backward"])
    assert EFFICIENT in fw and "aten.where.self" in fw and "aten.expand.default" in fw
    assert "aten._scaled_dot_product_efficient_attention_backward.default" in bw


def test_cudnn_with_a_boolean_mask_keeps_the_math():
    """torch's conversion of a boolean mask for cuDNN differs between its versions: not mirrored here."""
    mask = torch.ones(64, 64, dtype=torch.bool).tril()
    graphs = trace(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), *qkv(), mask,
                   runner=CudaWorker("cudnn"))
    fw = ops(graphs["forward"])
    assert not device_only(_module(graphs["forward"])) and any("softmax" in op for op in fw)
    assert not any("_for_cpu" in op for op in fw)  # the math, as for any accelerator


def test_grouped_query_attention_goes_to_flash_with_fewer_key_heads():
    runner = CudaWorker("flash")
    graphs = trace(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                   *qkv(heads=4, kv_heads=2, dtype=torch.bfloat16), runner=runner)
    assert FLASH in ops(graphs["forward"])
    assert "aten._scaled_dot_product_flash_attention_backward.default" in ops(graphs["backward"])
    call = runner.asked[0][0]
    assert call.enable_gqa and call.key.shape == (2, 2, 64, 40) and call.query.shape == (2, 4, 64, 40)


def test_attention_dropout_draws_from_the_seeded_generator_and_its_backward_replays_it():
    graphs = trace(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True),
                   *qkv(), runner=CudaWorker("efficient"))
    fw = _module(graphs["forward"])
    node = next(n for n in fw.graph.nodes if str(n.target) == EFFICIENT)
    assert node.args[5] == 0.1
    assert graphs["forward"].random and draws_random(fw)  # from the session's generator (worker/rng.py)
    assert not graphs["backward"].random  # the kernel replays its forward's draws from the saved seed
    # the seed and offset: 0-d int64 outputs saved for the backward, their layouts known before a run
    saved = graphs["forward"].layouts(list(qkv()))[graphs["forward"].saved_from:]
    assert sum(1 for t in saved if t.dtype == torch.int64 and t.shape == ()) == 2


def test_flash_saves_its_uint64_random_state_for_the_backward():
    graphs = trace(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True),
                   *qkv(dtype=torch.bfloat16), runner=CudaWorker("flash"))
    saved = graphs["forward"].layouts(list(qkv(dtype=torch.bfloat16)))[graphs["forward"].saved_from:]
    assert [tuple(t.shape) for t in saved if t.dtype == torch.uint64] == [(2,), ()]  # rng_state, unused


def test_a_math_answer_leaves_the_math_and_a_cpu_worker_is_not_asked():
    runner = CudaWorker("math")
    fw = ops(trace(causal, *qkv(), runner=runner)["forward"])
    assert runner.asked and not any("scaled_dot_product" in op for op in fw) and any("bmm" in op for op in fw)
    cpu = CudaWorker("efficient", device="cpu")
    fw = ops(trace(causal, *qkv(), runner=cpu)["forward"])
    assert not cpu.asked and any("_for_cpu" in op for op in fw)  # today's CPU trace: the CPU's fused kernel


def test_an_inference_call_needs_no_log_sumexp():
    with torch.no_grad():
        graphs = trace(causal, *qkv(), runner=CudaWorker("efficient"))
    node = next(n for n in _module(graphs["inference"]).graph.nodes if str(n.target) == EFFICIENT)
    assert node.args[4] is False  # compute_log_sumexp: nothing will differentiate it


def test_dynamic_shapes_keep_the_math():
    runner = CudaWorker("efficient")
    torch._dynamo.reset()
    graphs = trace(causal, *qkv(), runner=runner, dynamic=True)
    assert not runner.asked and not device_only(_module(graphs["forward"]))


def test_a_graph_with_a_fused_kernel_does_not_fall_back_to_this_cpu():
    graphs = trace(causal, *qkv(), runner=CudaWorker("efficient"))
    graph = graphs["forward"]
    assert graph._local is None

    class Failing(CudaWorker):
        def run_graph(self, graph, args):
            raise RemoteOutOfMemoryError("out of memory")

    graph._runner = Failing
    graph.fallback = "local"
    with pytest.raises(RemoteOutOfMemoryError):
        graph(list(qkv()))


@pytest.mark.parametrize("name, kwargs", [("GPT2LMHeadModel", {}), ("LlamaForCausalLM", {}),
                                          ("LlamaForCausalLM", {"no_mask": True})])
def test_transformers_models_trace_the_fused_kernel_and_its_backward(name, kwargs):
    from remotorch.devtools import zoo

    spec = zoo.by_name(name)
    model = spec.build().train()
    inputs = spec.inputs()
    labels = spec.labels(inputs)
    if kwargs.get("no_mask"):  # no padding: causal attention, grouped heads as they are (Llama: 4 and 2)
        del inputs["attention_mask"]
    runner = CudaWorker("flash" if kwargs.get("no_mask") else "efficient")
    graphs = trace(model, runner=runner, **inputs, **labels)
    forward = FLASH if kwargs.get("no_mask") else EFFICIENT
    fw, bw = ops(graphs["forward"]), ops(graphs["backward"])
    layers = model.config.num_hidden_layers if hasattr(model.config, "num_hidden_layers") else model.config.n_layer
    assert fw.count(forward) == layers
    assert bw.count(forward.replace(".default", "_backward.default")) == layers
    assert "aten._softmax.default" not in fw and "aten._safe_softmax.default" not in fw  # no attention math
    assert len(runner.asked) == 1  # one question for the graph's signatures, at capture
    if kwargs.get("no_mask") and name.startswith("Llama"):
        assert runner.asked[0][0].key.shape[1] < runner.asked[0][0].query.shape[1]
