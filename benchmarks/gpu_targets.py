"""The GPU targets: remote / local steps per second for GPT-2 124M, and the worker's memory (gpu_check.py's part).

GPT-2 with the 124M configuration (random weights), batch 8 x 512 tokens, ``labels=input_ids``,
for each local side and its remote counterpart:

* local eager against the worker's ``eager`` engine, without and with CUDA graphs (a worker
  started with ``--cuda-graphs``); local ``torch.compile`` (inductor) against the worker's
  ``inductor`` engine;
* float32, and bfloat16 autocast (local: ``torch.autocast("cuda")``; remote: a CPU client traces
  under its own device's autocast, ``torch.autocast("cpu")``: CUDA's autocast does not reach a
  CPU trace, so its graphs are not CUDA autocast's);
* a forward (``torch.no_grad``) and an AdamW training step (``RemoteOptimizer`` against
  ``torch.optim.AdamW``), each reading its loss every step.

Each row times blocks of steps of the two sides alternately (local, remote, local, remote…) and
keeps each side's median; the target is remote >= 0.95 x local. Each remote configuration gets a
fresh worker, so for a training step the worker's peak device memory (``StatsReply.device_memory_peak``)
is that configuration's alone; the local peak is this process's over the same steps, above what it
held before. Target: worker peak <= 1.05 x local peak.

``quick`` (with ``--device cpu``: a check of the script): a 2-layer GPT-2 at batch 2 x 32, the
eager engine in float32 only, two blocks of two steps; a row passes when its first losses agree
(the figures are printed, not judged).
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time

import torch

import remotorch
from remotorch.codec import messages as m
from remotorch.optim import RemoteOptimizer

TARGET_SPEED, TARGET_MEMORY = 0.95, 1.05
FULL = dict(n_layer=12, n_embd=768, n_head=12, vocab=50257, positions=1024)
QUICK = dict(n_layer=2, n_embd=64, n_head=2, vocab=500, positions=64)


def _autocast(dtype: str, device: str):
    return torch.autocast(device, dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()


def _alternated(local, remote, units: int, blocks: int) -> tuple[float, float]:
    """Steps per second of each side: the median of ``blocks`` blocks of ``units`` steps, the sides alternating."""
    rates: dict[str, list[float]] = {"local": [], "remote": []}
    for _ in range(blocks):
        for name, step in (("local", local), ("remote", remote)):
            t0 = time.perf_counter()
            for _ in range(units):
                step()
            rates[name].append(units / (time.perf_counter() - t0))
    return statistics.median(rates["local"]), statistics.median(rates["remote"])


def _worker_peak(session) -> int:
    reply, _ = session.connection_for(None).request(m.Stats(), expect=m.StatsReply)
    return reply.device_memory_peak


def _counts(session) -> dict:
    """What the worker's CUDA graphs did (recorded, replays, uncaptured runs by why)."""
    reply, _ = session.connection_for(None).request(m.Stats(), expect=m.StatsReply)
    return dict(reply.cuda_graphs)


def _steps(model, ids, engine: str, dtype: str, kind: str, device: str, session):
    """(local step, remote step) for one configuration, each reading its loss."""
    local = copy.deepcopy(model).to(device)
    local_fn = torch.compile(local) if engine == "inductor" else local
    remote_fn = remotorch.compile(model, session=session, engine=engine, fallback="raise")
    local_ids = ids.to(device)
    if kind == "forward":
        def local_step():
            with torch.no_grad(), _autocast(dtype, device):
                return local_fn(local_ids, labels=local_ids).loss.item()

        def remote_step():
            with torch.no_grad(), _autocast(dtype, "cpu"):
                return remote_fn(ids, labels=ids).loss.item()
        return local_step, remote_step
    local_opt = torch.optim.AdamW(local.parameters(), lr=1e-4)
    remote_opt = RemoteOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-4, session=session)

    def local_train():
        with _autocast(dtype, device):
            loss = local_fn(local_ids, labels=local_ids).loss
        loss.backward()
        local_opt.step()
        local_opt.zero_grad()
        return loss.item()

    def remote_train():
        with _autocast(dtype, "cpu"):
            loss = remote_fn(ids, labels=ids).loss
        loss.backward()
        remote_opt.step()
        remote_opt.zero_grad()
        return loss.item()
    return local_train, remote_train


def measure(workers, gpt2, device: str, quick: bool, engine: str, dtype: str, kind: str,
            cuda_graphs: bool = False) -> dict:
    """One row: both sides' steps per second (and, for a training step on CUDA, both peaks)."""
    size = QUICK if quick else FULL
    batch, seq = (2, 32) if quick else (8, 512)
    units, blocks = (2, 2) if quick else (5, 3)
    extra = ("--cuda-graphs",) if cuda_graphs else ()
    session = workers.session(workers.start(f"{engine}{'-graphs' if cuda_graphs else ''}-{dtype}-{kind}", *extra))
    ids = torch.randint(1, size["vocab"], (batch, seq), generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    model = gpt2(**size).train(kind == "train")
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    local_step, remote_step = _steps(model, ids, engine, dtype, kind, device, session)
    first = (local_step(), remote_step())  # compiles, uploads
    local_step(), remote_step()
    local_rate, remote_rate = _alternated(local_step, remote_step, units, blocks)
    row = dict(local="torch.compile (inductor)" if engine == "inductor" else "eager",
               engine=engine + (" + CUDA graphs" if cuda_graphs else ""), dtype=dtype,
               step=kind, local_steps_s=local_rate, remote_steps_s=remote_rate, ratio=remote_rate / local_rate,
               first_loss_local=first[0], first_loss_remote=first[1],
               status=_judged(quick, remote_rate, local_rate, *first))
    if cuda_graphs:
        row["cuda_graphs"] = _counts(session)
    if device == "cuda" and kind == "train":
        local_peak = torch.cuda.max_memory_allocated() - base
        worker_peak = _worker_peak(session)
        row.update(local_peak_mib=local_peak / 2**20, worker_peak_mib=worker_peak / 2**20,
                   memory_ratio=worker_peak / max(local_peak, 1),
                   memory_status="PASS" if worker_peak <= TARGET_MEMORY * local_peak else "FAIL")
    return row


def _judged(quick: bool, remote_rate: float, local_rate: float, want: float, got: float) -> str:
    """PASS at remote >= 0.95 x local; with ``quick`` (a check of the script, where the client and its
    worker share one CPU) when the first losses agree, whatever the speed."""
    if quick:
        return "PASS" if abs(got - want) <= 1e-4 * max(1.0, abs(want)) else "FAIL"
    return "PASS" if remote_rate >= TARGET_SPEED * local_rate else "FAIL"


SIDES = {"eager": ("eager", False), "graphs": ("eager", True), "inductor": ("inductor", False)}


def part_targets(workers, gpt2, device: str, quick: bool, sides: str = "eager,graphs,inductor",
                 dtypes: str = "fp32,bf16") -> dict:
    """The rows of the targets table for ``sides`` (of :data:`SIDES`) and ``dtypes`` (a failing row is
    reported and the others still run)."""
    engines = [SIDES["eager"]] if quick else [SIDES[k] for k in sides.split(",") if k]
    dtypes = ("fp32",) if quick else tuple(d for d in dtypes.split(",") if d)
    rows = []
    for engine, graphs in engines:
        for dtype in dtypes:
            for kind in ("forward", "train"):
                try:
                    rows.append(measure(workers, gpt2, device, quick, engine, dtype, kind, graphs))
                except Exception as exc:  # reported; the next configuration runs
                    rows.append(dict(engine=engine + (" + CUDA graphs" if graphs else ""), dtype=dtype, step=kind,
                                     status="FAIL", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"))
                torch._dynamo.reset()
    size = QUICK if quick else FULL
    return dict(rows=rows, config=dict(size, batch=2 if quick else 8, seq=32 if quick else 512),
                status="FAIL" if any(r["status"] == "FAIL" or r.get("memory_status") == "FAIL" for r in rows)
                else "PASS")


def render_targets(t: dict) -> list[str]:
    """The targets table (markdown lines)."""
    lines = [f"targets ({t.get('config', t.get('error'))}): remote / local >= {TARGET_SPEED}, "
             f"worker peak <= {TARGET_MEMORY} x local", "",
             "| local side | remote engine | dtype | step | local steps/s | remote steps/s | remote / local | speed "
             "| local peak MiB | worker peak MiB | worker / local | memory |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in t.get("rows", []):
        if "error" in r:
            lines.append(f"| | {r['engine']} | {r['dtype']} | {r['step']} | FAIL: {r['error']} | | | | | | | |")
            continue
        mem = (f"{r['local_peak_mib']:.0f} | {r['worker_peak_mib']:.0f} | {r['memory_ratio']:.3f} | {r['memory_status']}"
               if "memory_ratio" in r else " | | | ")
        lines.append(f"| {r['local']} | {r['engine']} | {r['dtype']} | {r['step']} | {r['local_steps_s']:.2f} | "
                     f"{r['remote_steps_s']:.2f} | {r['ratio']:.3f} | {r['status']} | {mem} |")
    graphs = [r for r in t.get("rows", []) if r.get("cuda_graphs")]
    if graphs:
        lines += ["", "CUDA graphs on the worker: " + "; ".join(f"{r['dtype']} {r['step']}: {r['cuda_graphs']}"
                                                         for r in graphs)]
    return lines
