"""The remotorch cases of ``benchmarks/wan.py``: the user code of ``workload.py``, unchanged, on a worker.

Case 8 is eager code on values the worker keeps (``remotorch.client.eager``):
8a logs ten steps' losses with ``torch.stack(losses).mean().item()`` (training
session), 8b runs 200 eager calls on a kept 1 MiB value (inference session).

Each case has its own model pair (remote and local, the same seed; cases 1
and 2 share one), so the two trainings go in lockstep and every unit's result
is checked against the local one. Cases 1-6 run on one worker behind its
proxy, the training cases (1-3) in one session and the inference cases (4-6)
in another, as a training script and an inference script would: in one
session that trained, inference graphs take the training path, which keeps
no output on the worker (``Session.run_graph``; the report says what that
costs). Case 7 runs on two workers, each behind its own proxy.
"""

from __future__ import annotations

import time
from functools import partial

import torch

import remotorch
from remotorch.optim import RemoteOptimizer

from _wan import workload as w
from _wan.timing import Unit, loss_diff, same

CASES = {
    "train": "1. training step, loss read every step",
    "train10": "2. training step, loss read every 10 steps",
    "train_local_opt": "3. training step, local torch.optim.AdamW",
    "branch": "4. function with a data-dependent if",
    "generate": "5. greedy generate, per token",
    "infer": "6. warm inference call, output read",
    "dp": "7a. DataParallel, 2 workers",
    "pipeline": "7b. Pipeline (1F1B), 2 workers",
    "eager_log": "8a. eager: 10 training steps, losses logged once",
    "eager_chain": "8b. eager: 200 calls on a kept 1 MiB value, a read",
}
REMOTORCH = "remotorch"
CONTROL = "control: local, idle one RTT a read"
ONE_GRAPH = "remotorch, the calls compiled as one graph"
NO_EAGER = "remotorch, no eager call: the last loss read"


def counters(session: remotorch.Session) -> dict:
    """What the session counted so far: reads it waited for, requests, bytes each way."""
    st = session.stats()
    return {"blocking_reads": st["blocking_reads"], "requests": sum(c.link.stream.seq for c in session.pool.opened),
            "queue_waits": st["queue_waits"], "bytes_sent": st["bytes_sent"], "bytes_received": st["bytes_received"]}


def _compile(fn, session, **kw):
    return remotorch.compile(fn, session=session, fallback="raise", **kw)


def _unit(case: str, session, proxies, remote, local, check, **kw) -> Unit:
    return Unit(case, kw.pop("system", REMOTORCH), kw.pop("per", 1), remote, local, check,
                counters=partial(counters, session), sync=session.synchronize, proxies=list(proxies), **kw)


def _train_pair(session, local_opt: bool = False):
    model, ref = w.gpt2(), w.gpt2()
    f = _compile(model, session)
    opt = (torch.optim.AdamW(model.parameters(), lr=w.LR) if local_opt else
           RemoteOptimizer(torch.optim.AdamW, model.parameters(), lr=w.LR, session=session))
    return f, opt, ref, torch.optim.AdamW(ref.parameters(), lr=w.LR)


def training_cases(session, proxy, names, system: str = REMOTORCH) -> list[Unit]:
    """Cases 1-3 (those in ``names``) on ``session``'s worker, reached through ``proxy``."""
    bs = w.batches()
    units = []
    if {"train", "train10"} & set(names):
        # cases 1 and 2 train one model pair (one compile): both sides run the same steps in the same order
        f, opt, ref, ref_opt = _train_pair(session)

        def ten(i):
            return [bs[(10 * i + j) % len(bs)] for j in range(10)]
    if "train" in names:
        units.append(_unit("train", session, [proxy], lambda i: w.train_step(f, opt, bs[i % len(bs)]),
                           lambda i: w.train_step(ref, ref_opt, bs[i % len(bs)]), loss_diff, system=system))
    if "train10" in names:
        units.append(_unit("train10", session, [proxy], lambda i: w.train_steps_read_once(f, opt, ten(i)),
                           lambda i: w.train_steps_read_once(ref, ref_opt, ten(i)), loss_diff, per=10, scale=0.5,
                           system=system))
    if "eager_log" in names:  # its own model pair: ten steps a unit, the losses logged by eager calls
        f8, opt8, ref8, ref_opt8 = _train_pair(session)

        def ten8(i):
            return [bs[(10 * i + j) % len(bs)] for j in range(10)]
        units.append(_unit("eager_log", session, [proxy], lambda i: w.train_steps_logged(f8, opt8, ten8(i)),
                           lambda i: w.train_steps_logged(ref8, ref_opt8, ten8(i)), loss_diff, scale=0.5,
                           system=system))
        if system == REMOTORCH:  # its floor: the same ten steps reading the last loss, no eager call (not judged)
            f9, opt9, ref9, ref_opt9 = _train_pair(session)
            units.append(_unit("eager_log", session, [proxy], lambda i: w.train_steps_read_once(f9, opt9, ten8(i)),
                               lambda i: w.train_steps_read_once(ref9, ref_opt9, ten8(i)), loss_diff, scale=0.5,
                               system=NO_EAGER))
    if "train_local_opt" in names:
        f3, opt3, ref3, ref_opt3 = _train_pair(session, local_opt=True)
        units.append(_unit("train_local_opt", session, [proxy], lambda i: w.train_step(f3, opt3, bs[i % len(bs)]),
                           lambda i: w.train_step(ref3, ref_opt3, bs[i % len(bs)]), loss_diff))
    return units


def inference_cases(session, proxy, names, tokens: int = 16) -> list[Unit]:
    """Cases 4-6 (those in ``names``) on ``session``'s worker, reached through ``proxy``."""
    units = []
    if "branch" in names:
        xs, weight = w.branch_inputs()
        fb = _compile(w.branchy, session)
        units.append(_unit("branch", session, [proxy], lambda i: w.read_branchy(fb, xs[i % len(xs)], weight),
                           lambda i: w.read_branchy(w.branchy, xs[i % len(xs)], weight), same))
    if "generate" in names:
        units.append(_generate_unit(session, proxy, tokens))
    if "infer" in names:
        net, ref_net, x = w.mlp(), w.mlp(), w.mlp_input()
        fi = _compile(net, session)
        units.append(_unit("infer", session, [proxy], lambda i: w.infer(fi, x), lambda i: w.infer(ref_net, x), same))
    if "eager_chain" in names:
        x8 = w.chain_input()  # (its own names: the lambdas above close over x)
        with torch.no_grad():
            y8 = _compile(lambda a: a.clone(), session)(x8)  # kept on the worker: the chain's calls run there
        units.append(_unit("eager_chain", session, [proxy], lambda i: w.chain(y8), lambda i: w.chain(x8), same,
                           scale=0.5))
        # its floor: the same calls compiled into one graph, so one request runs them all (a remote eager call
        # cannot do better than the calls it stands for sent at once); not judged
        one = _compile(w.chain_calls, session)
        units.append(_unit("eager_chain", session, [proxy], lambda i: one(y8).sum().item(), lambda i: w.chain(x8),
                           same, scale=0.5, system=ONE_GRAPH))
    return units


def _generate_unit(session, proxy, tokens: int) -> Unit:
    model, ref = w.gpt2(train=False), w.gpt2(train=False)
    model.forward = _compile(model.forward, session, dynamic=True)
    p = w.prompt()
    return _unit("generate", session, [proxy], lambda i: w.generate(model, p, tokens),
                 lambda i: w.generate(ref, p, tokens), same, per=tokens, scale=0.25)


def control_units(names, tokens: int = 16) -> list[Unit]:
    """What a remote that cost nothing but the round trip would give on this machine (cases 5 and 6).

    The local code, unchanged, sleeping one RTT (``time.sleep``, the unit's
    ``rtt_s``) before each forward whose result a remote run would wait for,
    timed against itself without the sleeps. Its (remote - local) / RTT is 1
    plus what waking from that idle time costs the same work here: caches and
    a virtual CPU gone cold, which on a shared machine can make the next
    millisecond of work take two or three. A remote call pays that too (and on
    both ends), so this row is the floor for cases 5 and 6 on this machine, not
    a target.
    """
    units = []
    if "generate" in names:
        idle, ref, p = w.gpt2(train=False), w.gpt2(train=False), w.prompt()
        forward = idle.forward

        def slept(*args, **kwargs):
            time.sleep(unit.rtt_s)
            return forward(*args, **kwargs)
        idle.forward = slept
        unit = Unit("generate", CONTROL, tokens, lambda i: w.generate(idle, p, tokens),
                    lambda i: w.generate(ref, p, tokens), same, scale=0.25)
        units.append(unit)
    if "infer" in names:
        net, ref_net, x = w.mlp(), w.mlp(), w.mlp_input()

        def infer(i, net=net):
            time.sleep(infer_unit.rtt_s)
            return w.infer(net, x)
        infer_unit = Unit("infer", CONTROL, 1, infer, lambda i: w.infer(ref_net, x), same)
        units.append(infer_unit)
    return units


def two_worker_cases(session, proxies, names) -> list[Unit]:
    """Case 7: ``DataParallel`` and ``Pipeline`` training loops on ``session``'s two workers."""
    from remotorch.parallel import DataParallel
    from remotorch.pipeline import Pipeline

    bs = w.batches()
    units = []
    makers = {"dp": lambda m: DataParallel(m, session=session, loss_fn=w.lm_loss),
              "pipeline": lambda m: Pipeline(m, ["transformer.h.1"], session=session, schedule="1F1B",
                                             microbatches=2, loss_fn=w.lm_loss)}
    for name in ("dp", "pipeline"):
        if name not in names:
            continue
        tied = name != "pipeline"  # a pipeline stage must own each parameter it uses
        trainer = makers[name](w.gpt2(tied=tied))
        opt = trainer.optimizer(torch.optim.AdamW, lr=w.LR)
        ref = w.gpt2(tied=tied)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=w.LR)

        def step(i, trainer=trainer, opt=opt):
            b = bs[i % len(bs)]
            loss = trainer.step(b, b)
            opt.step()
            opt.zero_grad()
            return float(loss)
        units.append(_unit(name, session, proxies, step, lambda i, ref=ref, ref_opt=ref_opt:
                           w.lm_step(ref, ref_opt, bs[i % len(bs)]), loss_diff, scale=0.5))
    return units
