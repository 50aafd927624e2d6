"""remotorch on a CUDA machine: engines, data parallelism, throughput against local, profiles with CUDA events.

Run by ``scripts/gpu-check.sh OUT`` (which also sets up and runs ``pytest -m gpu``);
``python benchmarks/gpu_check.py OUT`` alone needs remotorch importable and a
CUDA device (``--device cpu --quick`` runs every part on the CPU, small, to
check the script itself). Every worker is a real ``remotorch serve --device
cuda`` on loopback, on the same GPU as this process. Parts, each reported
(PASS, FAIL with its error, or NOT RUN with why) in ``OUT/gpu_check.md``
and ``OUT/gpu_check.json``:

1. **engines**: a GPT-2 (small config: 2 layers, 128 wide, vocabulary 1000),
   eval, batch 4 x 64, compiled with ``remotorch.compile(engine=...)`` for
   eager, inductor, onnxrt (its CUDA provider) and tensorrt, against the same
   model run by eager PyTorch on the same GPU: the logits' largest difference
   against each engine's tolerance. An engine the worker does not offer (not
   installed, no CUDA provider) is NOT RUN, with the worker's own list.
2. **data parallel**: ``remotorch.parallel.DataParallel`` on two workers on the
   one GPU, three AdamW steps, against one process training on the whole batch
   (losses and parameters within 1e-4). NCCL refuses two ranks on one device:
   the workers then form a gloo group, and the report says which backend the
   workers logged.
3. **throughput**: GPT-2 with the 124M configuration (random weights) at batch
   8 x 512 tokens, ``labels=input_ids``: a forward (``torch.no_grad``) and an
   AdamW training step (``RemoteOptimizer`` against ``torch.optim.AdamW``),
   each reading its loss (``.item()``) every step, remote from a CPU client
   (tokens sent each step) against local on the same GPU. Steps per second,
   median of timed blocks; target remote >= 0.9 x local.
4. **profile**: ``remote_profile`` of the small GPT-2's forward on the worker's
   eager and inductor engines: the graph time it reports (CUDA events on the
   worker, per run) beside the wall-clock time of the same call seen from the
   client.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import secrets
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

import remotorch
from remotorch.client.embedded import spawn_worker
from remotorch.optim import RemoteOptimizer

ENGINE_TOL = {"eager": 1e-4, "inductor": 2e-3, "onnxrt": 2e-3, "tensorrt": 2e-2}


def gpt2(n_layer=2, n_embd=128, n_head=4, vocab=1000, positions=128, seed=0):
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab,
                                     n_positions=positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


class Workers:
    """``remotorch serve`` processes on this machine, stopped on exit; their standard error kept."""

    def __init__(self, device: str, folder: str) -> None:
        self.device, self.folder, self.token = device, folder, secrets.token_hex(16)
        self._stack = contextlib.ExitStack()
        self.logs: list[str] = []

    def start(self, name: str, *extra: str) -> str:
        log = os.path.join(self.folder, f"worker-{name}.log")
        self.logs.append(log)
        err = open(log, "w")  # noqa: SIM115 (closed with the stack)
        self._stack.callback(err.close)
        w = spawn_worker(["--host", "127.0.0.1", "--port", "0", "--token", self.token, "--name", name,
                          "--device", self.device, "--exit-on-stdin-close", *extra], stderr=err,
                         stdin=__import__("subprocess").PIPE, start_timeout=300)
        self._stack.callback(w.stop)
        return w.url

    def session(self, *urls: str, **options) -> remotorch.Session:
        return self._stack.enter_context(remotorch.Session(list(urls) if len(urls) > 1 else urls[0],
                                                           token=self.token, **options))

    def close(self) -> None:
        self._stack.close()


def part_engines(workers: Workers, device: str, quick: bool) -> dict:
    url = workers.start("engines")
    s = workers.session(url)
    offered = s.health().get("engines", [])
    model = gpt2().eval().to(device)
    ids = torch.randint(1, 1000, (4, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids.to(device)).logits.float().cpu()
    rows = {}
    for engine in ("eager", "inductor", "onnxrt", "tensorrt"):
        if engine not in offered:
            rows[engine] = dict(status="NOT RUN", why=f"the worker does not offer it (it offers {offered})")
            continue
        try:
            torch._dynamo.reset()
            f = remotorch.compile(model, session=s, engine=engine, fallback="raise")
            t0 = time.perf_counter()
            with torch.no_grad():
                got = f(ids.to(device)).logits.float().cpu()
            first = time.perf_counter() - t0
            diff = (got - want).abs().max().item()
            ok = diff <= ENGINE_TOL[engine] * max(1.0, want.abs().max().item())
            rows[engine] = dict(status="PASS" if ok else "FAIL", max_abs_diff=diff, tolerance=ENGINE_TOL[engine],
                                first_call_s=round(first, 2))
        except Exception as exc:  # reported, and the next engine runs
            rows[engine] = dict(status="FAIL", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    return dict(offered=offered, engines=rows)


def part_data_parallel(workers: Workers) -> dict:
    urls = [workers.start(f"dp{i}") for i in range(2)]
    s = workers.session(*urls)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    dp = remotorch.parallel.DataParallel(model, session=s, loss_fn=F.mse_loss)
    opt = dp.optimizer(torch.optim.AdamW, lr=1e-2)
    diffs = []
    for _ in range(3):
        expected = F.mse_loss(ref(x), y)
        expected.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        got = dp.step(x, y)
        opt.step()
        opt.zero_grad()
        diffs.append(abs(float(got) - expected.item()))
    dp.pull()
    pdiff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    logs = "".join(open(p).read() for p in workers.logs if "dp" in os.path.basename(p))
    backend = "gloo (the two workers share one GPU, which NCCL refuses)" if "gloo instead" in logs else (
        "nccl" if workers.device == "cuda" else "gloo")
    ok = max(diffs) <= 1e-4 and pdiff <= 1e-4
    return dict(status="PASS" if ok else "FAIL", replicas=dp.replicas, loss_diffs=diffs, param_max_diff=pdiff,
                backend=backend)


def _timed(step, units: int, blocks: int) -> float:
    """Steps per second: the median over ``blocks`` blocks of ``units`` steps (each reads its loss)."""
    rates = []
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(units):
            step()
        rates.append(units / (time.perf_counter() - t0))
    return statistics.median(rates)


def _math_rate(step, units: int, blocks: int) -> float:
    """``step``'s rate with attention as its math (what a client without this GPU's kernels traces)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        step()
        return _timed(step, units, blocks)


def part_throughput(workers: Workers, device: str, quick: bool) -> dict:
    size = dict(n_layer=2, n_embd=64, n_head=2, vocab=500, positions=64) if quick else \
        dict(n_layer=12, n_embd=768, n_head=12, vocab=50257, positions=1024)
    batch, seq = (2, 32) if quick else (8, 512)
    units, blocks = (2, 2) if quick else (5, 3)
    url = workers.start("throughput")
    s = workers.session(url)
    ids = torch.randint(1, size["vocab"], (batch, seq), generator=torch.Generator().manual_seed(2))
    out = {}
    # forward
    model = gpt2(**size).eval()
    local = copy.deepcopy(model).to(device)
    local_ids = ids.to(device)
    remote = remotorch.compile(model, session=s, fallback="raise")
    with torch.no_grad():
        def local_fwd():
            return local(local_ids, labels=local_ids).loss.item()

        def remote_fwd():
            return remote(ids, labels=ids).loss.item()

        want, got = local_fwd(), remote_fwd()  # (compiles, uploads)
        remote_fwd()
        local_rate, remote_rate = _timed(local_fwd, units, blocks), _timed(remote_fwd, units, blocks)
        local_rate, remote_rate = max(local_rate, _timed(local_fwd, units, blocks)), max(
            remote_rate, _timed(remote_fwd, units, blocks))  # (alternated: each side's best of two)
        math_rate = _math_rate(local_fwd, units, blocks)
    out["forward"] = dict(local_steps_s=local_rate, remote_steps_s=remote_rate, ratio=remote_rate / local_rate,
                          local_math_steps_s=math_rate, ratio_to_math=remote_rate / math_rate,
                          loss_local=want, loss_remote=got, status=_speed(remote_rate, local_rate, quick, want, got))
    del local, remote
    torch._dynamo.reset()
    # training step
    model = gpt2(**size).train()
    local = copy.deepcopy(model).to(device)
    remote = remotorch.compile(model, session=s, fallback="raise")
    opt = RemoteOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-4, session=s)
    local_opt = torch.optim.AdamW(local.parameters(), lr=1e-4)

    def local_step():
        loss = local(local_ids, labels=local_ids).loss
        loss.backward()
        local_opt.step()
        local_opt.zero_grad()
        return loss.item()

    def remote_step():
        loss = remote(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    first_local, first_remote = local_step(), remote_step()
    remote_step()
    local_rate, remote_rate = _timed(local_step, units, blocks), _timed(remote_step, units, blocks)
    local_rate, remote_rate = max(local_rate, _timed(local_step, units, blocks)), max(
        remote_rate, _timed(remote_step, units, blocks))
    math_rate = _math_rate(local_step, units, blocks)
    out["train"] = dict(local_steps_s=local_rate, remote_steps_s=remote_rate, ratio=remote_rate / local_rate,
                        local_math_steps_s=math_rate, ratio_to_math=remote_rate / math_rate,
                        first_loss_local=first_local, first_loss_remote=first_remote,
                        status=_speed(remote_rate, local_rate, quick, first_local, first_remote))
    out["config"] = dict(size, batch=batch, seq=seq, steps_per_block=units, blocks=blocks)
    return out


def _speed(remote_rate: float, local_rate: float, quick: bool, want: float, got: float) -> str:
    """PASS when remote runs at 0.9 of local speed at least; with ``--quick`` (a check of the script, where
    the client and its worker share one CPU) when the losses agree, whatever the speed."""
    if quick:
        return "PASS" if abs(got - want) <= 1e-4 * max(1.0, abs(want)) else "FAIL"
    return "PASS" if remote_rate >= 0.9 * local_rate else "FAIL"


def part_profile(workers: Workers, device: str) -> dict:
    url = workers.start("gpu")
    s = workers.session(url)
    model = gpt2().eval()
    ids = torch.randint(1, 1000, (4, 64), generator=torch.Generator().manual_seed(3))
    engines = [e for e in ("eager", "inductor") if e in s.health().get("engines", [])]
    fast = remotorch.accelerate(lambda t: model(t).logits, local_backend="eager")
    with torch.no_grad(), remotorch.remote_profile(s, backends=[f"gpu/{e}" for e in engines], num_repeats=20,
                                                   num_warmups=2) as prof:
        for _ in range(3):
            fast(ids)
    report = prof.report()
    clocks = sorted({run.clock for call in prof.records for g in call.graphs for run in g.runs.values()
                     if getattr(run, "clock", None)})
    rows = {}
    for e in engines:
        summary = report.summaries[f"gpu/{e}"]
        torch._dynamo.reset()
        f = remotorch.compile(model, session=s, engine=e, fallback="raise")
        with torch.no_grad():
            f(ids).logits.sum().item()
            walls = []
            for _ in range(20):
                t0 = time.perf_counter()
                f(ids).logits.sum().item()
                walls.append((time.perf_counter() - t0) * 1e3)
        rows[e] = dict(graph_ms_reported=summary.graph_ms, wall_ms_client=statistics.median(walls),
                       compile_ms=summary.compile_ms)
    calls = dict(calls=report.calls, timed=report.timed_calls, compiled=report.compile_calls,
                 fell_back=report.fallback_calls, failed=report.failed_calls,
                 failures={b: report.summaries[b].failures for b in report.summaries if report.summaries[b].failures})
    return dict(clocks=clocks, engines=rows, calls=calls,
                status="PASS" if (device != "cuda" or clocks == ["cuda_events"]) else "FAIL")


PARTS = ("engines", "data_parallel", "throughput", "profile")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="folder for the results")
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="small models and few steps (a check of the script)")
    p.add_argument("--parts", default=",".join(PARTS))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here", file=sys.stderr)
        return 2
    env = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
               device=torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
               remotorch=getattr(remotorch, "__version__", "?"))
    try:
        import onnxruntime
        env["onnxruntime"] = f"{onnxruntime.__version__} {onnxruntime.get_available_providers()}"
    except ImportError:
        env["onnxruntime"] = "not installed"
    try:
        import torch_tensorrt  # noqa: F401
        env["torch_tensorrt"] = torch_tensorrt.__version__
    except Exception as exc:
        env["torch_tensorrt"] = f"not importable ({type(exc).__name__})"
    print("gpu_check:", env, flush=True)
    results: dict = dict(env=env)
    logs = args.out
    for part in args.parts.split(","):
        workers = Workers(args.device, logs)
        t0 = time.perf_counter()
        try:
            if part == "engines":
                results[part] = part_engines(workers, args.device, args.quick)
            elif part == "data_parallel":
                results[part] = part_data_parallel(workers)
            elif part == "throughput":
                results[part] = part_throughput(workers, args.device, args.quick)
            elif part == "profile":
                results[part] = part_profile(workers, args.device)
        except Exception as exc:
            results[part] = dict(status="FAIL", error=f"{type(exc).__name__}: {exc}"[:2000],
                                 traceback=traceback.format_exc()[-4000:])
        finally:
            workers.close()
            torch._dynamo.reset()
        results[part]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"gpu_check: {part}: {json.dumps(results[part], default=str)[:1500]}", flush=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
        f.write(render(results))
    print(render(results))
    failed = [k for k in PARTS if k in results and (results[k].get("status") == "FAIL" or any(
        isinstance(v, dict) and v.get("status") == "FAIL" for v in results[k].values()) or any(
        v.get("status") == "FAIL" for v in results[k].get("engines", {}).values() if isinstance(v, dict)))]
    print(f"gpu_check: {'FAIL: ' + ', '.join(failed) if failed else 'every part passed'}")
    return 1 if failed else 0


def render(r: dict) -> str:
    env = r["env"]
    lines = [f"device: {env['device']}; torch {env['torch']} (CUDA {env['cuda']}); Python {env['python']}; "
             f"onnxruntime {env['onnxruntime']}; torch_tensorrt {env['torch_tensorrt']}", ""]
    e = r.get("engines", {})
    lines += ["| engine | result | largest difference (tolerance) | first call s |", "|---|---|---|---|"]
    for name, row in e.get("engines", {}).items():
        detail = row.get("error") or row.get("why") or ""
        diff = f"{row['max_abs_diff']:.2e} ({row['tolerance']:g})" if "max_abs_diff" in row else detail
        lines.append(f"| {name} | {row['status']} | {diff} | {row.get('first_call_s', '')} |")
    if "error" in e:
        lines.append(f"| (all) | FAIL | {e['error']} | |")
    dp = r.get("data_parallel", {})
    lines += ["", f"DataParallel, 2 workers on one GPU: {dp.get('status')} (backend {dp.get('backend', '?')}; "
              f"loss differences {dp.get('loss_diffs', dp.get('error'))}; parameters {dp.get('param_max_diff')})"]
    t = r.get("throughput", {})
    lines += ["", f"throughput ({t.get('config', t.get('error'))}):", "",
              "| step | local steps/s | remote steps/s | remote / local | target >= 0.9 "
              "| local, math attention, steps/s | remote / local math |", "|---|---|---|---|---|---|---|"]
    for k in ("forward", "train"):
        row = t.get(k)
        if row:
            lines.append(f"| {k} | {row['local_steps_s']:.2f} | {row['remote_steps_s']:.2f} | {row['ratio']:.3f} | "
                         f"{row['status']} | {row['local_math_steps_s']:.2f} | {row['ratio_to_math']:.3f} |")
    pr = r.get("profile", {})
    lines += ["", f"remote_profile: clocks {pr.get('clocks', pr.get('error'))}; calls {pr.get('calls')}", "",
              "| engine | graph ms (worker, reported) | call ms (client wall clock) |", "|---|---|---|"]
    for name, row in pr.get("engines", {}).items():
        g = row["graph_ms_reported"]
        lines.append(f"| {name} | {g:.3f} | {row['wall_ms_client']:.3f} |" if g is not None else
                     f"| {name} | - | {row['wall_ms_client']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
