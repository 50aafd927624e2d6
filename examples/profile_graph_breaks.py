"""Profile a function with graph breaks: Python (here ``time.sleep``) between its graphs.

The local segments show the sleeps, timed on the client; the graphs show
what each backend takes for them, timed on the worker.

    python examples/profile_graph_breaks.py --backends eager,onnxrt
"""

from __future__ import annotations

import time

import torch

import remotorch

from _common import backends_for, finish, parse_args, session_for


@remotorch.accelerate(local_backend="eager")
def pipeline(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x @ w)
    time.sleep(0.002)  # stands for I/O or Python logic between graphs: a graph break
    h = torch.softmax(h @ w.T, dim=-1)
    time.sleep(0.001)
    return (h * x).sum(-1)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    torch.manual_seed(0)
    x, w = torch.randn(128, 256), torch.randn(256, 256) / 16
    print(remotorch.explain(pipeline, x, w).render(), end="\n\n")
    with session_for(args) as session, torch.no_grad():
        with remotorch.remote_profile(session, backends=backends_for(args, session),
                                      num_repeats=args.repeats) as prof:
            for _ in range(args.calls):
                pipeline(x, w)
        finish(prof.report(), args)


if __name__ == "__main__":
    main()
