"""Weights that live on the worker: what a load costs the client, the worker and the wire.

For GPT-2 models from about 0.1 GB to over 1 GB (float32, random values,
written by safetensors), against a real ``remotorch serve --weights`` on
loopback, it prints, per model:

* the client: a fresh process's peak resident memory growth during
  ``remotorch.from_pretrained`` (``VmHWM``, reset just before the load, less
  the resident set then), the bytes it sent and received, and its blocking round trips;
* the worker: the ``LoadWeights`` round trip (the worker reading every tensor
  into its own memory) against ``safetensors.safe_open`` on the same files on
  the same machine, in a fresh process each: ``get_tensor`` alone (lazy: it maps
  the file and reads nothing until a tensor is touched) and ``get_tensor`` then
  ``clone()`` (the bytes read into memory of their own, as the worker does);
  runs alternate, files warm in the page cache, medians;
* the worker's peak host memory during the load beyond what it holds right
  after it, the session still open (``VmHWM`` reset before the load, less
  ``VmRSS`` after), against the largest tensor and the largest file.

With ``--stages N`` it also loads the largest model as an N-stage pipeline
(each stage its own worker) and prints the bytes each worker read against its
stage's parameter bytes, and the bytes the controller sent.

Usage::

    python benchmarks/weights.py [--sizes 0.1,0.5,1.4] [--runs 3] [--stages 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

import remotorch
from remotorch.client.embedded import spawn_worker
from remotorch.weights.meta import tensors_of

CONFIGS = {  # GB (float32) -> GPT-2 shape
    0.1: dict(n_layer=12, n_embd=256, n_head=4),
    0.5: dict(n_layer=12, n_embd=768, n_head=12),
    1.4: dict(n_layer=24, n_embd=1024, n_head=16),
}
TOKEN = "bench-weights-token-0123"

CLIENT = textwrap.dedent("""
    import gc, json, sys, time
    import psutil, transformers, remotorch
    import remotorch.weights.hf as hf
    url, token, source, worker_pid = sys.argv[1:5]

    def status(field, pid="self"):
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    def reset_peak(pid="self"):  # the peak resident set (VmHWM) starts again from now
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")

    loads = []
    inner = hf.load_planned
    def timed(*a, **k):
        start = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            loads.append(time.perf_counter() - start)
    hf.load_planned = timed
    with remotorch.Session(url, token=token) as s:
        s.health()
        transformers.GPT2LMHeadModel  # (its module imported before: code, not weights)
        gc.collect()
        rss, before = psutil.Process().memory_info().rss, s.stats()
        worker_before = status("VmRSS", worker_pid)
        reset_peak()
        reset_peak(worker_pid)
        start = time.perf_counter()
        model = remotorch.from_pretrained(transformers.GPT2LMHeadModel, source, session=s)
        total = time.perf_counter() - start
        peak = status("VmHWM")
        worker_peak, worker_after = status("VmHWM", worker_pid), status("VmRSS", worker_pid)
        after = s.stats()
        print(json.dumps({"growth": peak - rss, "sent": after["bytes_sent"] - before["bytes_sent"],
                          "received": after["bytes_received"] - before["bytes_received"],
                          "waits": after["blocking_reads"] - before["blocking_reads"],
                          "load_s": loads[0], "total_s": total, "worker_held": worker_after - worker_before,
                          "worker_extra": worker_peak - worker_after}))
""")

SAFE_OPEN = textwrap.dedent("""
    import json, sys, time
    import torch
    from safetensors import safe_open
    path, copy = sys.argv[1], sys.argv[2] == "1"
    start = time.perf_counter()
    with safe_open(path, framework="pt") as f:
        tensors = [f.get_tensor(k) for k in f.keys()]
        if copy:
            tensors = [t.clone() for t in tensors]
    print(json.dumps({"s": time.perf_counter() - start, "n": sum(t.numel() for t in tensors)}))
""")


def write_model(folder: Path, gb: float, tied: bool = True) -> tuple[int, int]:
    """A GPT-2 of about ``gb`` GB as save_pretrained writes it (random values); (bytes, largest tensor)."""
    config = transformers.GPT2Config(vocab_size=50257, n_positions=1024, tie_word_embeddings=tied, **CONFIGS[gb])
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    with remotorch.init_empty_weights():
        model = transformers.GPT2LMHeadModel(config)
    gen = torch.Generator().manual_seed(0)
    tensors = {w.keys[0]: torch.randn(w.tensor.shape, generator=gen) * 0.02 for w in tensors_of(model)}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.nbytes for t in tensors.values()), max(t.nbytes for t in tensors.values())


def run_json(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", *args], capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(root: Path, name: str, nbytes: int, largest: int, runs: int) -> dict:
    worker = spawn_worker(["--host", "127.0.0.1", "--port", "0", "--token", TOKEN, "--weights", f"models={root}",
                           "--name", "bench"], start_timeout=120)
    try:
        rows = {"remotorch LoadWeights": [], "safe_open get_tensor (lazy)": [], "safe_open + clone": []}
        clients = []
        path = str(root / name / "model.safetensors")
        run_json([SAFE_OPEN, path, "1"])  # warm-up: the file in the page cache, imports in the OS cache
        for r in range(runs):
            order = ["remotorch", "lazy", "copy"] if r % 2 == 0 else ["copy", "lazy", "remotorch"]
            for which in order:
                if which == "remotorch":
                    got = run_json([CLIENT, worker.url, TOKEN, f"models/{name}", str(worker.proc.pid)])
                    rows["remotorch LoadWeights"].append(got["load_s"])
                    clients.append(got)
                else:
                    got = run_json([SAFE_OPEN, path, "1" if which == "copy" else "0"])
                    rows["safe_open get_tensor (lazy)" if which == "lazy" else "safe_open + clone"].append(got["s"])
        worst = {k: max(c[k] for c in clients) for k in ("growth", "sent", "received", "waits", "worker_extra",
                                                         "worker_held")}
        return {"rows": {k: statistics.median(v) for k, v in rows.items()},
                "client": {**clients[-1], **worst}, "nbytes": nbytes, "largest": largest}
    finally:
        worker.stop()


def report(gb: float, got: dict) -> None:
    c, mib = got["client"], 1 << 20
    print(f"\n== GPT-2 of {got['nbytes'] / 2**30:.2f} GiB (about {gb} GB) ==")
    print(f"client: peak resident growth {c['growth'] / mib:.1f} MiB, sent {c['sent'] / 1024:.1f} KiB, "
          f"received {c['received'] / 1024:.1f} KiB, {c['waits']} blocking round trips, "
          f"from_pretrained {c['total_s'] * 1e3:.0f} ms")
    base = got["rows"]["safe_open + clone"]
    for label, s in got["rows"].items():
        print(f"  {label:30s} {s * 1e3:9.1f} ms   {s / base:5.2f} x safe_open + clone")
    print(f"client: the worst run: growth {c['growth'] / mib:.1f} MiB, sent {c['sent'] / 1024:.1f} KiB")
    print(f"worker: holds up to {c['worker_held'] / mib:.1f} MiB more after a load; its peak during a load was at most "
          f"{c['worker_extra'] / mib:.1f} MiB above that (largest tensor {got['largest'] / mib:.1f} MiB, "
          f"largest file {got['nbytes'] / mib:.1f} MiB)")


def stages(root: Path, gb: float, n: int) -> None:
    """The model as an ``n``-stage pipeline, a worker per stage: what each worker read, what the client sent."""
    from remotorch import pipeline

    name = f"gpt2-{gb}-untied"  # (a tied embedding cannot span two stages)
    write_model(root / name, gb, tied=False)
    config = transformers.GPT2Config.from_pretrained(root / name)
    workers = [spawn_worker(["--host", "127.0.0.1", "--port", "0", "--token", TOKEN, "--weights",
                             f"models={root}", "--name", f"stage{i}"], start_timeout=120) for i in range(n)]
    try:
        with remotorch.Session([w.url for w in workers], token=TOKEN) as s:
            with remotorch.init_empty_weights():
                model = transformers.GPT2LMHeadModel(config)
            cuts = [f"transformer.h.{config.n_layer * k // n}" for k in range(1, n)]
            pipe = pipeline.Pipeline(model, cuts, session=s, schedule="GPipe", microbatches=2,
                                     loss_fn=lambda out, y: torch.nn.functional.cross_entropy(
                                         out.logits.flatten(0, 1), y.flatten()),
                                     weights=f"models/{name}")
            ids = torch.randint(0, config.vocab_size, (2, 16))
            before = s.stats()
            pipe.step({"input_ids": ids}, ids)
            after = s.stats()
            print(f"\n== {name} as {n} pipeline stages, a worker each ==")
            for runner, (url, got) in zip(pipe.layout.runners, pipe.weights_read.items()):
                want = sum(p.numel() * p.element_size() for p in runner.params)
                print(f"  stage {runner.index}: parameters {want / 2**20:.1f} MiB; its worker {url} read "
                      f"{got / 2**20:.1f} MiB ({got / want:.3f} x)")
            print(f"  the client sent {(after['bytes_sent'] - before['bytes_sent']) / 1024:.1f} KiB in all "
                  f"(graphs and the step's tokens) and uploaded {after['tensors_uploaded']} tensors")
    finally:
        for w in workers:
            w.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0.1,0.5,1.4")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--stages", type=int, default=0)
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="remotorch-weights-bench-") as tmp:
        root = Path(tmp)
        for gb in sizes:
            nbytes, largest = write_model(root / f"gpt2-{gb}", gb)
            report(gb, measure(root, f"gpt2-{gb}", nbytes, largest, args.runs))
        if args.stages:
            stages(root, max(sizes), args.stages)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
