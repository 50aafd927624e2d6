"""The workloads of ``benchmarks/wan.py``, built alike in every process from fixed seeds.

The user code of each case is written here once, as ordinary PyTorch, and
run unchanged on a local model and on a ``remotorch.compile``\\ d one. The
peers' servers hold :class:`StepServer`, the same model and step moved by
hand to the other side (what a user of pickle/zmq, torch RPC or Ray writes).
"""

from __future__ import annotations

import threading

import torch
from torch import nn
from torch.nn import functional as F

SEED = 0
LR = 1e-3
# The tiny GPT-2. Dropout is off (and the special tokens are inside the vocabulary) so that
# every system's losses can be checked against local ones; the work per step is the same.
GPT2 = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=300, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
BATCH = (2, 16)  # sequences x tokens
N_BATCHES = 8  # the steps cycle through these
PROMPT_TOKENS = 8
MLP_BATCH = 32  # the seed MLP, 784-256-10
BRANCH = (8, 64)  # the branch function's x (its w is 64 x 64)
_BUILDING = threading.Lock()  # torch's default generator is process-wide


def gpt2(seed: int = SEED, train: bool = True, tied: bool = True) -> nn.Module:
    """The tiny GPT-2 (``GPT2LMHeadModel``), weights drawn from ``seed``; ``tied=False`` unties the output
    layer from the embedding (a pipeline stage must own each parameter it uses)."""
    import transformers

    with _BUILDING:
        torch.manual_seed(seed)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2, tie_word_embeddings=tied))
    return model.train(train)


def mlp(seed: int = SEED) -> nn.Module:
    """The seed MLP (784-256-10) in eval mode."""
    with _BUILDING:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
    return model.eval()


def batches() -> list[torch.Tensor]:
    """The token batches a training loop cycles through (2 x 16 int64 each)."""
    return [torch.randint(1, GPT2["vocab_size"], BATCH, generator=torch.Generator().manual_seed(100 + i))
            for i in range(N_BATCHES)]


def mlp_input() -> torch.Tensor:
    return torch.randn(MLP_BATCH, 784, generator=torch.Generator().manual_seed(7))


def branch_inputs() -> tuple[list[torch.Tensor], torch.Tensor]:
    """Inputs that take both sides of the branch (alternately), and the weight."""
    g = torch.Generator().manual_seed(8)
    w = torch.randn(BRANCH[1], BRANCH[1], generator=g) / BRANCH[1] ** 0.5
    xs = [torch.randn(*BRANCH, generator=g) for _ in range(4)]
    # the sign of x picks the side: tanh(-x @ w) = -tanh(x @ w)
    return [x if (torch.tanh(x @ w).sum() > 0) == (i % 2 == 0) else -x for i, x in enumerate(xs)], w


def prompt() -> torch.Tensor:
    return torch.randint(1, GPT2["vocab_size"], (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(9))


# ------------------------------------------------------------------ the user code
def train_step(model, opt, b: torch.Tensor) -> float:
    """Case 1 (and 3): a training step that reads its loss."""
    loss = model(b, labels=b).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def train_steps_read_once(model, opt, bs: list[torch.Tensor]) -> float:
    """Case 2: steps whose loss is read once, after the last."""
    for b in bs:
        loss = model(b, labels=b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss.item()


def train_steps_logged(model, opt, bs: list[torch.Tensor]) -> float:
    """Case 8a: steps whose losses are logged once, after the last, as a mean (eager calls on them)."""
    losses = []
    for b in bs:
        loss = model(b, labels=b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses).mean().item()


CHAIN = (256, 1024)  # case 8b's value: 1 MiB of float32


def chain_input() -> torch.Tensor:
    return torch.randn(*CHAIN, generator=torch.Generator().manual_seed(10))


def chain(y: torch.Tensor) -> float:
    """Case 8b: 200 eager elementwise calls on a value (remotely, one the worker keeps), then a scalar read."""
    return chain_calls(y).sum().item()


def chain_calls(y: torch.Tensor) -> torch.Tensor:
    """Case 8b's 200 elementwise calls (its floor row compiles them into one graph)."""
    for _ in range(100):
        y = y * 1.0001
        y = y + 0.5
    return y


def branchy(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Case 4: one data-dependent ``if`` (a read, and a graph break)."""
    h = torch.tanh(x @ w)
    if h.sum() > 0:
        h = h * 2
    return (h @ w.t()).relu()


def read_branchy(fn, x: torch.Tensor, w: torch.Tensor) -> list:
    """Case 4's call, its output read."""
    return fn(x, w).tolist()


def generate(model, p: torch.Tensor, tokens: int) -> list:
    """Case 5: greedy decoding of exactly ``tokens`` new tokens."""
    with torch.no_grad():
        return model.generate(p, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                              pad_token_id=0).tolist()


def infer(model, x: torch.Tensor) -> list:
    """Case 6: a warm inference call whose output is read (the predicted classes)."""
    with torch.no_grad():
        return model(x).argmax(-1).tolist()


def lm_loss(out, labels: torch.Tensor) -> torch.Tensor:
    """The language-model loss of ``model(b, labels=b)``, as a ``loss_fn(output, target)`` (case 7)."""
    logits = out.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def lm_step(model, opt, b: torch.Tensor) -> float:
    """Case 7's local reference: the same step on the whole batch through ``lm_loss``."""
    loss = lm_loss(model(b), b)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


# ----------------------------------------------------------- the peers' server side
class StepServer:
    """What a peer's server holds: the tiny GPT-2 with its AdamW, and the seed MLP.

    ``forward``/``backward``/``step`` are the per-graph calls of the seed
    pattern (pickle/zmq); ``whole_step`` is the step moved by hand into one
    call (torch RPC, Ray). ``whole_step(seq, b)`` runs the calls in ``seq``
    order even when several arrive at once (torch RPC serves on a thread
    pool: pipelined calls would otherwise race on the model).
    """

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.net = mlp()
        self._turn = threading.Condition()
        self.model = gpt2()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.loss = None
        self.next_seq = 0

    def forward(self, b: torch.Tensor) -> torch.Tensor:
        self.loss = self.model(b, labels=b).loss
        return self.loss.detach()

    def backward(self) -> None:
        self.loss.backward()
        self.loss = None

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()

    def whole_step(self, seq: int, b: torch.Tensor) -> float:
        with self._turn:
            self._turn.wait_for(lambda: self.next_seq == seq)
            try:
                return train_step(self.model, self.opt, b)
            finally:
                self.next_seq += 1
                self._turn.notify_all()

    def infer(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.net(x)
