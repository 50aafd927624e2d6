"""``remotorch serve --metrics``: Prometheus text at /metrics, scraped with a real HTTP client while two
tenants' clients work, and counters that add up to what the clients did."""

from __future__ import annotations

import re
import threading
import time
import urllib.request

import pytest
import torch

import remotorch
from remotorch import errors
from remotorch.codec import messages as m

from conftest import wait_until
from test_tenants import ALICE, BOB, mlp, table

import prometheus_client  # noqa: F401,E402 (part of the test extra: a missing one fails here rather than skipping)


def metrics_url(srv) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with open(srv.stderr_path, encoding="utf-8") as f:
            found = re.search(r"metrics at (http://[^\s\"]+/metrics)", f.read())
        if found:
            return found.group(1)
        time.sleep(0.05)
    raise AssertionError("the worker did not say where its metrics are")


def scrape(url: str) -> dict[str, float]:
    """Every sample of the page: ``name{labels}`` -> value (labels in the page's order)."""
    with urllib.request.urlopen(url, timeout=10) as page:
        assert page.status == 200 and page.headers["Content-Type"].startswith("text/plain")
        text = page.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


def total(samples: dict[str, float], name: str, **labels) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in samples.items()
               if (k == name or k.startswith(name + "{")) and all(w in k for w in want))


def test_metrics_count_what_two_tenants_clients_did_while_being_scraped(start_server, tmp_path):
    path = tmp_path / "tokens.toml"
    path.write_text(table("alice", ALICE) + table("bob", BOB))
    srv = start_server(token=None, name="metered", extra_args=("--tokens", str(path), "--metrics", "0"))
    url = metrics_url(srv)
    assert url.startswith("http://127.0.0.1:")  # a port alone: loopback
    torch._dynamo.reset()
    sessions = {name: [remotorch.Session(srv.url, token=tok) for _ in range(2)]
                for name, tok in (("alice", ALICE), ("bob", BOB))}
    work, weights = [], 0
    for name, group in sessions.items():
        for i, s in enumerate(group):
            model, x = mlp(20 + len(work)), torch.randn(4, 16)
            weights += sum(p.nbytes for p in model.parameters())
            compiled = remotorch.compile(model, session=s, fallback="raise")
            with torch.no_grad():
                assert torch.equal(compiled(x), model(x))
            work.append((compiled, x, model(x).detach()))
    stop, wrong, scrapes = threading.Event(), [], []

    def client(compiled, x, want):
        with torch.no_grad():
            while not stop.is_set():
                wrong.append(not torch.equal(compiled(x), want))

    def scraper():
        while not stop.is_set():
            scrapes.append(scrape(url))
            time.sleep(0.1)

    threads = [threading.Thread(target=client, args=w) for w in work] + [threading.Thread(target=scraper)]
    for t in threads:
        t.start()
    assert wait_until(lambda: len(scrapes) >= 5 and len(wrong) > 20, timeout=120)  # scraped while they work
    stop.set()
    for t in threads:
        t.join(timeout=60)
    assert not any(wrong)
    during = scrape(url)  # all four sessions open, nothing in flight
    assert total(during, "remotorch_sessions", tenant="alice") == 2
    assert total(during, "remotorch_sessions", tenant="bob") == 2
    assert during["remotorch_connections"] == 4
    assert during["remotorch_resident_bytes"] >= weights  # each session's weights (and graphs)
    assert 1 <= during["remotorch_unacknowledged_requests"] <= 4  # each session's last reply, at most
    assert during["remotorch_device_memory_bytes"] == 0  # a CPU worker
    assert during["remotorch_disk_cache_bytes"] == 0 and total(during, "remotorch_disk_cache_hits_total") == 0
    # an error of alice's, counted by its kind
    with pytest.raises(errors.MissingObjectsError):
        sessions["alice"][0].connection.request(m.Fetch([m.HandleArg(987654)]))
    sent = {}
    for name, group in sessions.items():
        for s in group:
            s.close()
        sent[name] = sum(s.stats()["messages_sent"] for s in group)
    closed = lambda page: page["remotorch_connections"] == 0 and page["remotorch_resident_bytes"] == 0  # noqa: E731
    assert wait_until(lambda: closed(scrape(url)), timeout=60)  # every session closed: nothing left
    after = scrape(url)
    for name in ("alice", "bob"):
        assert total(after, "remotorch_requests_total", tenant=name) == sent[name], name
        assert total(after, "remotorch_received_bytes_total", tenant=name) > 0
    assert total(after, "remotorch_errors_total", tenant="alice", type="fetch", kind="missing") == 1
    assert total(after, "remotorch_errors_total", tenant="bob") == 0
    runs = total(after, "remotorch_requests_total", type="run")
    assert runs > 20 and total(after, "remotorch_run_seconds_count", engine="eager") == runs
    assert total(after, "remotorch_sessions", tenant="alice") == 0
    assert after["remotorch_values"] == 0 and after["remotorch_unacknowledged_requests"] == 0
    assert after["remotorch_host_memory_bytes"] > 10 << 20
    torch._dynamo.reset()


def test_serve_refuses_a_metrics_address_it_cannot_read():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "remotorch", "serve", "--port", "0", "--metrics", "here"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--metrics takes HOST:PORT or PORT" in done.stderr


def test_json_logs_have_a_record_per_request_and_nothing_secret(start_server, tmp_path):
    import json

    path = tmp_path / "tokens.toml"
    path.write_text(table("alice", ALICE) + table("bob", BOB))
    srv = start_server(token=None, name="logged", extra_args=("--tokens", str(path), "--log-format", "json"))
    model, x = mlp(30), torch.randn(4, 16)
    torch._dynamo.reset()
    with remotorch.Session(srv.url, token=ALICE) as s, torch.no_grad():
        compiled = remotorch.compile(model, session=s, fallback="raise")
        for _ in range(3):
            assert torch.equal(compiled(x), model(x))
        with pytest.raises(errors.MissingObjectsError):
            s.connection.request(m.Fetch([m.HandleArg(987654)]))
        session_id = s.connection.session_id
    sent = s.stats()["messages_sent"]
    with pytest.raises(errors.AuthenticationError):
        with remotorch.Session(srv.url, token="rmt_mallory-0123456789", retry_after=0) as bad:
            bad.health()

    def records() -> list[dict]:
        return [json.loads(line) for line in srv.stderr_text().splitlines() if line.startswith("{")]

    def logged() -> bool:  # every request of alice's session, and the refusal
        got = records()
        return (sum(r["logger"] == "remotorch.requests" and r["tenant"] == "alice" for r in got) >= sent
                and any(r["level"] == "WARNING" and "refused" in r["msg"] for r in got))

    assert wait_until(logged, timeout=60)
    text = srv.stderr_text()
    records = records()
    requests = [r for r in records if r["logger"] == "remotorch.requests"]
    assert len(requests) == sent and all(r["tenant"] == "alice" for r in requests)  # one each, none twice
    runs = [r for r in requests if r["type"] == "run"]
    assert len(runs) == 3 and all(r["tenant"] == "alice" and r["outcome"] == "ok" and r["engine"] == "eager"
                                  and r["ms"] >= r["run_ms"] >= 0 for r in runs)
    assert [r["outcome"] for r in requests if r["type"] == "fetch"] == ["missing"]
    assert len({r["session"] for r in runs}) == 1 and runs[0]["session"].startswith("s-")
    assert any(r["level"] == "WARNING" and "refused" in r["msg"] for r in records)  # the bad token, as JSON
    for secret in (ALICE, session_id, "rmt_mallory"):
        assert secret not in text
    assert all(line.startswith("{") for line in text.splitlines() if line.strip()), text[:2000]
    assert any(r["logger"] == "remotorch.serve" and "worker 'logged'" in r["msg"] for r in records)
    torch._dynamo.reset()
