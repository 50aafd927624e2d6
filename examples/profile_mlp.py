"""Profile the core example MLP on every backend of the session's workers.

    python examples/profile_mlp.py                      # embedded worker: local/eager, local/inductor, local/onnxrt
    python examples/profile_mlp.py --url tcp://a:7878 --url tcp://b:7878 --out prof/
"""

from __future__ import annotations

import torch

import remotorch
from remotorch import models

from _common import backends_for, finish, parse_args, session_for


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    torch.manual_seed(0)
    model = remotorch.accelerate(models.mlp().eval(), dynamic=True)
    with session_for(args) as session, torch.no_grad():
        with remotorch.remote_profile(session, backends=backends_for(args, session),
                                      num_repeats=args.repeats) as prof:
            for i in range(args.calls):
                model(torch.randn(32 if i % 2 else 64, 784))  # one graph serves both batch sizes
        finish(prof.report(), args)


if __name__ == "__main__":
    main()
