"""A model of over 1 GB loaded by a fresh client process: its memory stays flat and it sends almost nothing.

The checkpoint is written the way safetensors lays it out (a header, then the tensors' bytes) as a sparse
file of zeros: real to the worker, which reads all of it, and cheap to make. The client runs in its own
process: its peak resident set (``VmHWM``, reset just before the load) against its resident set then.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import transformers

import remotorch
from remotorch.weights.meta import tensors_of

from conftest import TOKEN, clean_env

BIG = dict(n_layer=20, n_embd=1024, n_head=16, vocab_size=50257, n_positions=1024)  # 354M parameters, 1.42 GB


def write_sparse_checkpoint(folder, config) -> int:
    """A save_pretrained-like folder whose safetensors file holds zeros (a sparse file); its bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    with remotorch.init_empty_weights():
        model = transformers.GPT2LMHeadModel(config)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for w in tensors_of(model):
        n = w.tensor.numel() * w.tensor.element_size()
        header[w.keys[0]] = {"dtype": "F32", "shape": list(w.tensor.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + offset)
    return offset


CLIENT = textwrap.dedent("""
    import gc, json, sys
    import psutil, torch, transformers, remotorch
    url, token, source = sys.argv[1:4]

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    with remotorch.Session(url, token=token) as s:
        s.health()
        transformers.GPT2LMHeadModel  # (its module imported before: code, not weights)
        gc.collect()
        rss = psutil.Process().memory_info().rss
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident set (VmHWM) starts again from now
        sent = s.stats()["bytes_sent"]
        model = remotorch.from_pretrained(transformers.GPT2LMHeadModel, source, session=s)
        peak = status("VmHWM")
        params = sum(p.numel() for p in model.parameters())
        print(json.dumps({"rss_before": rss, "peak_after": peak, "sent": s.stats()["bytes_sent"] - sent,
                          "params": params, "fetched": s.stats()["values_fetched"],
                          "dtype": str(model.transformer.h[0].mlp.c_fc.weight.dtype)}))
""")


@pytest.fixture(scope="module")
def big(tmp_path_factory, start_module_server):
    root = tmp_path_factory.mktemp("big")
    nbytes = write_sparse_checkpoint(root / "gpt2-big", transformers.GPT2Config(**BIG))
    assert nbytes >= 1 << 30
    return start_module_server(name="big", extra_args=("--weights", f"models={root}")), nbytes


def test_a_fresh_client_loads_a_gigabyte_model_in_flat_memory_sending_under_4_mb(big):
    worker, nbytes = big
    out = subprocess.run([sys.executable, "-c", CLIENT, worker.url, TOKEN, "models/gpt2-big"], env=clean_env(),
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["params"] * 4 >= nbytes and got["dtype"] == "torch.float32"
    growth = got["peak_after"] - got["rss_before"]
    assert growth <= 256 << 20, f"the client's peak grew by {growth / 2**20:.0f} MiB for a {nbytes / 2**30:.2f} GB model"
    assert got["sent"] < 4 << 20 and got["fetched"] == 0, got
