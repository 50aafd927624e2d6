"""remotorch workers inside Ray actors (``remotorch.cluster.RayCluster``) on a real local Ray.

One local Ray serves the whole test run (``ray_local`` in conftest.py); each
cluster here reserves a placement group and starts real remotorch workers as
Ray actors (each actor process serves the worker, configured as
``remotorch serve`` configures it) and talks to them over remotorch's own
protocol on loopback. Workers reserve half a CPU each, so two clusters fit
the fixture's two CPUs at once.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import remotorch
from remotorch import errors
from remotorch.cluster import RayCluster
from remotorch.cluster.actor import WorkerActor

from conftest import RAY_TEST_ENV, clean_env, wait_until
from helpers import assert_a_value_moves_worker_to_worker, assert_data_parallel_trains_as_one_process

import transformers  # noqa: E402 (part of the test extra: a missing one fails here rather than skipping)

HALF = dict(num_cpus_per_worker=0.5)


def running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def live_groups(ray) -> set[str]:
    """The placement groups Ray holds (not removed), by id."""
    return {pid for pid, g in ray.util.placement_group_table().items() if g["state"] != "REMOVED"}


def cluster_serve_processes() -> list[int]:
    """Running ``remotorch serve`` processes named ray-N on this machine (a RayCluster starts none)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"remotorch" in argv and b"serve" in argv and any(a.startswith(b"ray-") for a in argv) \
                and running(int(entry)):
            found.append(int(entry))
    return found


def compile_raise(fn, session, **kw):
    return remotorch.compile(fn, session=session, fallback="raise", **kw)


@pytest.fixture(scope="module")
def cluster(ray_local):
    with RayCluster(num_workers=2, **HALF) as c:
        yield c


# ------------------------------------------------------------------ serving
def test_a_compiled_gpt2_on_the_cluster_equals_eager(cluster, ray_local):
    torch.manual_seed(9)
    config = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(7))
    s = cluster.session
    assert s.urls == cluster.urls and len(set(cluster.urls)) == 2
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        for worker in ("ray-0", "ray-1"):
            out = compile_raise(model, s, worker=worker)(input_ids=ids).logits
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert s.stats()["fallbacks"] == 0
    by_name = {c.name: c for c in s.connections()}
    for i, info in enumerate(cluster.workers):  # each worker ran the model and uploaded its weights once
        conn = by_name[f"ray-{i}"]
        assert conn.url == info["url"]
        assert conn.stats.remote_calls >= 1 and conn.stats.tensors_uploaded >= 1, conn.stats
    assert [w["name"] for w in s.workers()] == ["ray-0", "ray-1"]


def test_each_worker_is_its_ray_actor_on_its_bundle_of_one_placement_group(cluster, ray_local):
    node = ray_local.get_runtime_context().get_node_id()
    group = cluster._group
    table = ray_local.util.placement_group_table(group)
    assert table["state"] == "CREATED" and table["strategy"] == "PACK"
    assert list(table["bundles"].values()) == [{"CPU": 0.5}, {"CPU": 0.5}]
    for i, (info, handle) in enumerate(zip(cluster.workers, cluster._actors)):
        assert info["name"] == f"ray-{i}" and info["node_id"] == node
        assert info["url"].startswith("tcp://127.0.0.1:")  # the node's address on a loopback-only Ray
        assert running(info["pid"]) and info["pid"] != os.getpid()
        where = ray_local.get(handle.__ray_call__.remote(lambda self: (
            os.getpid(), ray_local.get_runtime_context().get_placement_group_id())))
        assert where == (info["pid"], group.id.hex())  # the actor's own process serves, inside the group
    assert cluster_serve_processes() == []  # no child process for anyone to supervise beside Ray


def test_a_value_kept_on_worker_0_moves_to_worker_1_inside_the_cluster(cluster):
    assert_a_value_moves_worker_to_worker(cluster.session, 0, "ray-1")  # the same test as on plain workers


def test_data_parallel_on_the_cluster_trains_as_one_process(cluster):
    """A RayCluster session works unchanged: the workers' groups meet on their node address (--group-host)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    dp, pulled = assert_data_parallel_trains_as_one_process(cluster.session, model, x, y)
    assert dp.replicas == 2 and pulled == 4


def test_a_sigkilled_worker_is_noticed_through_ray_and_comes_back(cluster):
    """(The module's cluster, last: it leaves with fresh workers.)"""
    c = cluster
    old, s = c.workers[0], c.session
    os.kill(old["pid"], signal.SIGKILL)
    # the cluster notices by itself: Ray fails the watch call, so the next .session is a new one
    assert wait_until(lambda: c.session is not s, timeout=120)
    assert c.refresh() is False  # already up to date
    assert c.workers[0]["pid"] != old["pid"] and running(c.workers[0]["pid"])
    assert c.workers[0]["incarnation"] != old["incarnation"]
    x = torch.randn(4, 4)
    with torch.no_grad():
        torch.testing.assert_close(compile_raise(torch.exp, c.session, worker=0)(x), torch.exp(x))
    replaced = c.restart(1)  # a fresh actor in place of worker 1, on the same bundle
    assert replaced["url"] == c.urls[1] and running(replaced["pid"])
    with torch.no_grad():
        torch.testing.assert_close(compile_raise(torch.exp, c.session, worker=1)(x), torch.exp(x))
    assert all(running(w["pid"]) for w in c.workers)


# ------------------------------------------------------------------ boundaries
def test_a_wrong_token_is_refused_and_the_workers_keep_serving(cluster):
    for url in cluster.urls:
        with remotorch.Session(url, token="not-" + cluster.token, retry_after=0.0) as intruder:
            with pytest.raises(errors.AuthenticationError):
                intruder.health()
        with remotorch.Session(url, retry_after=0.0) as no_token:
            with pytest.raises(errors.AuthenticationError):
                no_token.health()
    assert all(h["healthy"] for h in cluster.health()), cluster.health()


def test_a_non_loopback_bind_without_token_is_refused_inside_an_actor(ray_local):
    """The actor configures its worker as ``remotorch serve`` does, whose rule holds: no token, no public bind.
    The refusal comes back typed, from ``RayTaskError.cause``."""
    handle = ray_local.remote(WorkerActor).options(num_cpus=0.1, max_restarts=0).remote(
        0, None, name="ray-0", host="0.0.0.0", device="cpu", threads=1, serve_args=[])
    try:
        with pytest.raises(errors.WorkerUnavailableError, match="refusing to listen on 0.0.0.0 without a token"):
            ray_local.get(handle.info.remote(), timeout=120)
    finally:
        ray_local.kill(handle)
    with pytest.raises(ValueError, match="token"):
        RayCluster(1, token="")
    with pytest.raises(ValueError, match="placement_strategy"):
        RayCluster(1, placement_strategy="ANYWHERE")


def test_a_worker_that_cannot_start_is_a_typed_error_and_leaves_nothing(ray_local):
    groups = live_groups(ray_local)
    with pytest.raises(errors.WorkerUnavailableError, match="ray-0: .*nonsense"):
        with RayCluster(1, device="nonsense", **HALF):
            pass
    assert ray_local.is_initialized()
    assert live_groups(ray_local) == groups  # its reservation released


def test_a_cluster_larger_than_ray_fails_at_once_naming_what_is_missing(ray_local):
    groups = live_groups(ray_local)
    started = time.monotonic()
    with pytest.raises(errors.PlacementError, match=r"CPU 3 wanted, 2 in the cluster") as raised:
        RayCluster(3, num_cpus_per_worker=1).start()
    assert time.monotonic() - started < 5.0, "it waited instead of failing at once"
    assert "3 x {CPU: 1}" in str(raised.value)
    with pytest.raises(errors.PlacementError, match=r"GPU 1 wanted, 0 in the cluster"):
        RayCluster(1, num_gpus_per_worker=1, **HALF).start()
    assert live_groups(ray_local) == groups


def test_a_cluster_that_fits_only_later_fails_after_its_placement_timeout(cluster, ray_local):
    """The module's cluster holds 1 of Ray's 2 CPUs: 2 x 0.75 fits Ray in total, not now."""
    assert cluster.workers  # holds its bundles
    groups = live_groups(ray_local)
    started = time.monotonic()
    with pytest.raises(errors.PlacementError, match=r"could not be placed within 2s; free now: \{CPU: 1\}"):
        RayCluster(2, num_cpus_per_worker=0.75, placement_timeout=2.0).start()
    assert 2.0 <= time.monotonic() - started < 15.0
    assert live_groups(ray_local) == groups  # the pending group was removed
    assert all(h["healthy"] for h in cluster.health())


# ------------------------------------------------------------------ failures and restarts
def test_a_killed_worker_is_a_typed_error_then_ray_restarts_it_and_the_session_is_renewed(ray_local):
    groups = live_groups(ray_local)
    with RayCluster(num_workers=2, max_restarts=2, **HALF) as c:
        s = c.session
        assert c.session is s  # nothing changed: the same session
        x = torch.randn(8, 8)
        with torch.no_grad():
            torch.testing.assert_close(compile_raise(torch.tanh, s, worker=1)(x), torch.tanh(x))
            old, first = c.workers[1], c.workers[0]
            os.kill(old["pid"], signal.SIGKILL)
            with pytest.raises(errors.WorkerUnavailableError) as raised:
                compile_raise(lambda t: t * 3, s, worker=1)(x)
            changed = c.refresh()  # waits for Ray to restart the actor; re-reads the URLs
            assert changed is True, (old, c.workers[1], running(old["pid"]), str(raised.value))
            fresh = c.session  # a session over the new set
            assert fresh is not s and s.closed
            new = c.workers[1]
            assert new["incarnation"] != old["incarnation"] and new["pid"] != old["pid"]
            assert new["url"] != old["url"] and fresh.urls == c.urls
            assert c.workers[0] == first and running(first["pid"])  # worker 0 untouched
            torch.testing.assert_close(compile_raise(lambda t: t * 3, fresh, worker=1)(x), x * 3)
            torch.testing.assert_close(compile_raise(lambda t: t - 1, fresh, worker=0)(x), x - 1)
        seen = [new["pid"], c.workers[0]["pid"]]
        urls = list(c.urls)
    for url in urls:  # every worker stopped serving before __exit__ returned
        with remotorch.Session(url, token=c.token, connect_timeout=2.0, retry_after=0.0) as late:
            with pytest.raises(errors.WorkerUnavailableError):
                late.health()
    assert wait_until(lambda: not any(running(p) for p in seen), timeout=30)  # and their actors ended
    assert live_groups(ray_local) == groups  # the reservation released
    assert ray_local.is_initialized()  # the fixture's Ray: used, not shut down


# ------------------------------------------------------------------ as a user runs it
def test_a_fresh_process_starts_its_own_ray_and_leaves_nothing_behind():
    """No ray.init of one's own: the cluster starts a local Ray and shuts it down on exit."""
    script = textwrap.dedent("""
        import os, torch, ray, remotorch
        from remotorch.cluster import RayCluster
        with RayCluster(1, num_cpus_per_worker=0.5, ray_init_kwargs=dict(num_cpus=1)) as c:
            f = remotorch.compile(lambda a: a @ a, session=c.session, fallback="raise")
            x = torch.randn(16, 16)
            with torch.no_grad():
                assert torch.allclose(f(x), x @ x)
            assert c.session.stats()["remote_calls"] == 1
            print("PIDS", c.workers[0]["pid"])
        assert not ray.is_initialized()
        print("DONE")
    """)
    env = {k: v for k, v in clean_env(**RAY_TEST_ENV).items() if not k.startswith("RAY_ADDRESS")}
    env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)  # token auth on, nothing written to ~/.ray
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and "DONE" in done.stdout, done.stdout + done.stderr[-4000:]
    pids = [int(p) for p in done.stdout.split("PIDS", 1)[1].split()[:1]]
    assert wait_until(lambda: not any(running(p) for p in pids), timeout=30)
