"""Evaluate a GPT-2-style model on a worker; write every result file here, in a folder you name.

The pattern of a remote GPU with local files: one session for the whole run
(start-up paid once), the weights uploaded once and kept on the worker, each
batch sending only token ids and bringing back only what this process reads
(per-sequence losses and next-token predictions; the logits stay on the
worker). CSV, JSON and the chart are written by this process.

    python examples/gpt2_eval.py --out results/                 # $REMOTORCH_URL, else an embedded worker
    python examples/gpt2_eval.py --out results/ --modal A100    # a worker on a Modal A100 for this run
    python examples/gpt2_eval.py --out results/ --layers 12 --width 768 --vocab 50257   # GPT-2 124M's shape

The model is built from a config (random weights, nothing downloaded); each
problem is a token pattern repeated twice, the model's job to predict the
next token of the repeat.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

import remotorch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for results.csv, summary.json and timing.png")
    parser.add_argument("--modal", default=None, metavar="GPU", help="run on a fresh Modal worker with this GPU")
    parser.add_argument("--problems", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=32, help="tokens per problem")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1000)
    return parser.parse_args()


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    config = transformers.GPT2Config(vocab_size=args.vocab, n_positions=max(128, args.length), n_embd=args.width,
                                     n_layer=args.layers, n_head=max(1, args.width // 64),
                                     bos_token_id=args.vocab - 1, eos_token_id=args.vocab - 1)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def make_problems(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (a pattern, then its repeat minus the last token) and the token that should come next."""
    g = torch.Generator().manual_seed(1)
    half = args.length // 2
    pattern = torch.randint(0, args.vocab, (args.problems, half), generator=g)
    ids = torch.cat([pattern, pattern[:, :-1]], dim=1)
    return ids, pattern[:, -1]


def worker_session(args: argparse.Namespace):
    if args.modal:
        from remotorch.deploy.modal import worker
        return worker(gpu=args.modal, timeout=1800, name=f"modal-{args.modal.lower()}")
    return remotorch.Session()


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(args)
    ids, expected = make_problems(args)

    def evaluate(batch: torch.Tensor):
        logits = model(input_ids=batch).logits
        loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), batch[:, 1:], reduction="none").mean(dim=1)
        return loss, logits[:, -1].argmax(dim=-1)

    rows, started = [], time.perf_counter()
    with contextlib.ExitStack() as stack:
        session = stack.enter_context(worker_session(args))
        stack.enter_context(torch.no_grad())
        print(f"worker: {session.health()['name']} on {session.health()['device']}")
        remote = remotorch.compile(evaluate, session=session, fallback="raise")
        for start in range(0, args.problems, args.batch):
            t0 = time.perf_counter()
            loss, predicted = remote(ids[start:start + args.batch])
            batch_ms = (time.perf_counter() - t0) * 1e3
            for i, (l, p) in enumerate(zip(loss.tolist(), predicted.tolist())):
                n = start + i
                rows.append(dict(problem=n, loss=round(l, 5), perplexity=round(float(torch.tensor(l).exp()), 3),
                                 predicted=p, expected=int(expected[n]), correct=int(p == int(expected[n])),
                                 batch_ms=round(batch_ms, 3)))
        stats = session.stats()
    write_results(out, rows, stats, time.perf_counter() - started)


def write_results(out: Path, rows: list[dict], stats: dict, seconds: float) -> None:
    """Every file of the run, written by this process."""
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    summary = dict(problems=len(rows), accuracy=sum(r["correct"] for r in rows) / len(rows),
                   mean_loss=sum(r["loss"] for r in rows) / len(rows), seconds=round(seconds, 3),
                   remote_calls=stats["remote_calls"], tensors_uploaded=stats["tensors_uploaded"],
                   bytes_sent=stats["bytes_sent"], bytes_received=stats["bytes_received"])
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    saved = ["results.csv", "summary.json"]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        pass
    else:
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.plot([r["problem"] for r in rows], [r["batch_ms"] for r in rows])
        ax.set_xlabel("problem")
        ax.set_ylabel("batch time (ms)")
        fig.savefig(out / "timing.png", dpi=100)
        plt.close(fig)
        saved.append("timing.png")
    print(f"accuracy {summary['accuracy']:.1%}, mean loss {summary['mean_loss']:.3f}, "
          f"{summary['remote_calls']} remote calls, {summary['tensors_uploaded']} weight tensors uploaded once")
    print(f"saved in {out}: {', '.join(saved)}")


if __name__ == "__main__":
    main()
