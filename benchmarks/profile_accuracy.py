"""Do the worker's own graph timings match the same engine timed in-process?

For a graph of known cost (a chain of K square matmuls, 2·N³·K flops), this
script compares, in one run on this machine:

* **worker**: the mean of the per-run times a real ``remotorch serve``
  subprocess reports for a ``ProfileGraph`` request (the path
  ``remote_profile`` uses): ``warmups`` untimed runs, then ``repeats`` runs,
  each timed by the worker alone (monotonic clock on CPU, CUDA events on CUDA);
* **in-process**: the same graph document decoded here, compiled by the same
  engine module, and timed here as one block of ``repeats`` calls divided by
  ``repeats`` (a different way to time, with no remotorch code in the loop;
  synchronized before and after on CUDA).

Both sides use the same number of intra-op threads (``--threads``, default
half the cores, the embedded worker's share) and run one after the other,
never at once. Rounds alternate worker and in-process measurements so that
drift in machine load hits both. Two ratios are printed: the median over
rounds of (worker mean / in-process mean), and the ratio of the best rounds
(lowest worker mean / lowest in-process mean), the rounds least disturbed by
other load on a shared machine. Target: within 10% (0.90–1.10) on CPU,
judged on the best-rounds ratio; the median shows how much the machine's
noise moves single rounds. Every output the worker sends back must also
match the graph run locally in eager (max abs difference <= 1e-4 of the
output's largest magnitude), and every engine asked for must be offered by
the worker: the script exits 1 on a timing outside the target, a wrong
output, or an engine it could not measure.

Usage::

    python benchmarks/profile_accuracy.py [--device cpu|cuda] [--engines eager,inductor,onnxrt]
                                          [--sizes 128,256,512] [--rounds 5] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import time

import torch

from remotorch.capture.graph import RemoteGraph, output_devices
from remotorch.codec.graph import decode_graph, encode_graph
from remotorch.codec.tensors import tensor_from_wire
from remotorch.worker import engines
from remotorch.client.connection import Connection
from remotorch.client.embedded import spawn_worker
from remotorch.profile.profiler import profile_graph

CHAIN = 4
OUTPUT_TOL = 1e-4  # of the output's largest magnitude


def chain(x, w):
    for _ in range(CHAIN):
        x = x @ w
    return x


def capture(n: int) -> tuple[RemoteGraph, list]:
    """The aten graph of ``chain`` for n×n inputs, as the client would ship it."""
    from torch._dynamo.backends.common import aot_autograd

    found = []

    def keep(gm, example_inputs):
        found.append(gm)
        return gm.forward

    torch._dynamo.reset()
    x, w = torch.randn(n, n), torch.randn(n, n) / n ** 0.5
    with torch.no_grad():
        torch.compile(chain, backend=aot_autograd(fw_compiler=keep, inference_compiler=keep))(x, w)
    gm = found[0]
    graph = RemoteGraph(encode_graph(gm), runner=lambda: None, engine="eager", fallback="raise",
                        resident=[], output_devices=output_devices(gm), local=gm.forward)
    return graph, [x, w]


def output_error(outputs: list, expected: torch.Tensor) -> float:
    """Max abs difference of the worker's single output from ``expected``, relative to its magnitude."""
    if len(outputs) != 1 or outputs[0].shape != expected.shape:
        return float("inf")
    diff = (outputs[0].to(expected.device) - expected).abs().max().item()
    return diff / max(expected.abs().max().item(), 1e-30)


def in_process(graph: RemoteGraph, args: list, engine: str, device: torch.device):
    p = graph.payload
    consts = [tensor_from_wire(m, f).clone() for m, f in zip(p.consts, p.const_frames)]
    decoded = decode_graph(p.doc, consts, device)
    values = [a.to(device) for a in args]
    return engines.load(engine).compile(decoded, device, values), values


def time_block(fn, values: list, device: torch.device, warmups: int, repeats: int) -> float:
    with torch.no_grad():
        for _ in range(warmups):
            engines.call(fn, list(values))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            engines.call(fn, list(values))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) * 1e3 / repeats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--engines", default="eager,inductor,onnxrt")
    parser.add_argument("--sizes", default="128,256,512")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmups", type=int, default=3)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    args = parser.parse_args()

    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    token = secrets.token_hex(16)
    worker = spawn_worker(["--host", "127.0.0.1", "--port", "0", "--token", token, "--device", args.device,
                           "--name", "accuracy", "--threads", str(args.threads)])  # a real `remotorch serve`
    url = worker.url
    print(f"device {device}, {args.threads} thread(s) on each side, {os.cpu_count()} CPU(s); "
          f"{args.rounds} rounds x {args.repeats} timed runs after {args.warmups} warm-ups; "
          f"graph: {CHAIN} chained NxN matmuls")
    print(f"{'engine':9s} {'N':>5s} {'GFLOP/run':>9s} {'worker ms':>10s} {'in-proc ms':>10s} "
          f"{'median':>6s} {'best':>6s} {'net ms/req':>10s} {'out err':>8s}  within 10%, output right")
    failed = missing = wrong = 0
    link = Connection(lambda: (url, token))
    try:
        offered = link.info()["engines"]
        for engine in [e for e in args.engines.split(",") if e]:
            if engine not in offered:
                print(f"{engine:9s} not offered by the worker (has {', '.join(offered)}): NOT MEASURED")
                missing += 1
                continue
            for n in [int(s) for s in args.sizes.split(",")]:
                graph, call_args = capture(n)
                with torch.no_grad():
                    expected = chain(*call_args)
                fn, values = in_process(graph, call_args, engine, device)
                first = profile_graph(link, graph, call_args, engine, warmups=1, repeats=1)  # compile there, untimed
                ratios, w_means, l_means, nets = [], [], [], []
                err = output_error(first.outputs, expected)
                for _ in range(args.rounds):
                    res = profile_graph(link, graph, call_args, engine, warmups=args.warmups, repeats=args.repeats)
                    err = max(err, output_error(res.outputs, expected))
                    w = statistics.fmean(res.times_ms)
                    local = time_block(fn, values, device, args.warmups, args.repeats)
                    ratios.append(w / local)
                    w_means.append(w)
                    l_means.append(local)
                    nets.append(res.network_ms)
                ratio = statistics.median(ratios)
                best = min(w_means) / min(l_means)
                ok = 0.9 <= best <= 1.1
                right = err <= OUTPUT_TOL
                failed += not ok
                wrong += not right
                gflop = 2 * n ** 3 * CHAIN / 1e9
                print(f"{engine:9s} {n:5d} {gflop:9.3f} {min(w_means):10.3f} {min(l_means):10.3f} "
                      f"{ratio:6.3f} {best:6.3f} {statistics.median(nets):10.3f} {err:8.1e}  "
                      f"{'yes' if ok else 'NO'}, {'yes' if right else 'NO'}")
    finally:
        link.close()
        worker.stop()
    print("worker ms, in-proc ms: best round's mean per run; median: median over rounds of worker/in-process; "
          "best: best worker round / best in-process round; out err: the worker's outputs against local "
          f"eager, max abs difference over the output's largest magnitude (target <= {OUTPUT_TOL:g})")
    measured = "every engine asked for" if not missing else f"{missing} engine(s) NOT MEASURED"
    print(f"{'all within' if not failed else f'{failed} outside'} the 10% target (judged on best); "
          f"{'all outputs right' if not wrong else f'{wrong} with WRONG outputs'}; {measured}")
    return 0 if not (failed or wrong or missing) else 1


if __name__ == "__main__":
    sys.exit(main())
