"""``import remotorch`` is light, and the parts are joined however a program reaches them.

The package root imports its public names on first use, so the command line
starts without torch (tests/integration/test_cli_startup.py). What the root
joins (the default session captured graphs run on, the training client of a
session, the ``torch.optim`` step hooks, the ``clip_grad_norm_`` wrapper) must
then be in place before any part needs it, whichever way a program came in.
Each way runs in a fresh interpreter: in this one everything is imported already.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import remotorch

JOINED = textwrap.dedent("""
    import sys

    def joined():
        import torch
        import remotorch
        from remotorch.capture import backend
        from remotorch.client.session import Session
        from remotorch.training import clip, writes
        return dict(root=remotorch._wired, default_runner=backend.default_runner is not None,
                    make_trainer=Session.make_trainer is not None, optimizer_hooks=bool(writes._installed),
                    clip=torch.nn.utils.clip_grad_norm_ is clip.clip_grad_norm_)

    def check(when):
        got = joined()
        assert all(got.values()), (when, got)
""")


def run(code: str) -> None:
    done = subprocess.run([sys.executable, "-c", JOINED + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_import_remotorch_imports_no_torch_and_each_public_name_comes_on_first_use():
    run("""
        import remotorch
        assert "torch" not in sys.modules and not remotorch._wired
        assert set(remotorch.__all__) <= set(dir(remotorch))
        for name in remotorch.__all__:
            assert getattr(remotorch, name) is not None, name
        check("after the public names")
        assert remotorch.accelerate.__module__ == "remotorch.profile.accelerate"  # the function, not its module
        assert remotorch.explain.__module__ == "remotorch.profile.explain"
        assert remotorch.optim.RemoteOptimizer.__name__ == "RemoteOptimizer"
    """)


WAYS = {
    # dynamo imports the backend alone through the torch_dynamo_backends entry point
    "the backend module alone": "import remotorch.capture.backend",
    # a module of the package, then a session made from its own module: no public name of the root
    "a module, then a session": """
        from remotorch.optim import RemoteOptimizer
        from remotorch.client.session import Session
        Session("tcp://127.0.0.1:9").close()  # (connects on its first request: none here)
    """,
    "from remotorch import optim": "from remotorch import optim",
}


@pytest.mark.parametrize("way", list(WAYS))
def test_the_parts_are_joined_whichever_way_a_program_comes_in(way):
    run(textwrap.dedent(WAYS[way]) + f"\ncheck({way!r})\n")


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        remotorch.nothing_here  # noqa: B018
