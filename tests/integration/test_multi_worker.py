"""Sessions with several workers: names, backends, prices, tokens; ordinary calls stay on the first."""

from __future__ import annotations

import pytest
import torch

import remotorch
from remotorch import errors

from conftest import TOKEN

OTHER_TOKEN = "another-token-9876543210"


@pytest.fixture(scope="module")
def gpu0(start_module_server):
    """A second worker, named gpu0, with a price and its own token."""
    return start_module_server(token=OTHER_TOKEN, name="gpu0", extra_args=("--price-per-hour", "3.6"))


@pytest.fixture
def two(session_for, server, gpu0):
    return session_for(server, gpu0, tokens={gpu0.url: OTHER_TOKEN})


def test_workers_are_named_and_offer_backends(two, server, gpu0):
    workers = two.workers()
    assert [w["name"] for w in workers] == ["test", "gpu0"]
    assert [w["url"] for w in workers] == [server.url, gpu0.url]
    assert two.urls == [server.url, gpu0.url]
    backends = two.backends()
    for b in ("test/eager", "test/onnxrt", "gpu0/eager", "gpu0/onnxrt"):
        assert b in backends
    assert backends.index("test/eager") < backends.index("gpu0/eager")


def test_prices_come_from_the_workers_unless_the_session_overrides(server, gpu0, two):
    assert two.price_per_hour("gpu0") == 3.6
    assert two.price_per_hour("test") == 0.0
    with remotorch.Session([server.url, gpu0.url], token=TOKEN, tokens={gpu0.url: OTHER_TOKEN},
                           prices={"test": 1.25}) as s:
        assert s.price_per_hour("test") == 1.25
        assert {w["name"]: w["price_per_hour"] for w in s.workers()} == {"test": 1.25, "gpu0": 3.6}
    with pytest.raises(KeyError):
        two.price_per_hour("nobody")


def test_ordinary_calls_run_on_the_first_worker_only(two, gpu0):
    model = torch.nn.Linear(64, 64).eval()
    fn = remotorch.compile(model, session=two, fallback="raise")
    x = torch.randn(8, 64)
    with torch.no_grad():
        assert torch.equal(fn(x), model(x))
    assert two.stats()["remote_calls"] == 1 and two.stats()["tensors_uploaded"] == 2
    assert two.health()["name"] == "test"
    resident = {w["name"]: w["resident_bytes"] for w in two.workers()}  # asked now, not remembered
    assert resident["test"] >= 64 * 64 * 4
    assert resident["gpu0"] == 0


def test_a_worker_listed_under_two_addresses_gets_two_names(server, make_session):
    alias = server.url.replace("127.0.0.1", "localhost")
    s = make_session([server.url, alias])
    assert [w["name"] for w in s.workers()] == ["test", "test-2"]


def test_a_wrong_token_for_one_worker_is_an_authentication_error(server, gpu0, make_session):
    s = make_session([server.url, gpu0.url])  # gpu0 wants another token
    with pytest.raises(errors.AuthenticationError):
        s.workers()


def test_single_url_and_embedded_sessions_are_unchanged(server, monkeypatch):
    monkeypatch.delenv("REMOTORCH_URL", raising=False)
    with remotorch.Session(server.url, token=TOKEN) as s:
        assert s.url == server.url and s.urls == [server.url]
        assert not s.embedded
    with remotorch.Session() as s:
        assert s.url is None and s.urls == [None] and s.embedded
        assert [w["name"] for w in s.workers()] == ["local"]  # starts the embedded worker
        assert s.backends()[0] == "local/eager"


@pytest.mark.parametrize("bad", [[], ["tcp://127.0.0.1:1", "tcp://127.0.0.1:1"], [None]])
def test_bad_url_lists_are_refused(bad):
    with pytest.raises(ValueError):
        remotorch.Session(bad)
