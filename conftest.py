"""The Python examples of README.md and docs/*.md run as tests (Sybil), as a reader would run them.

* The blocks of one file run in order, in one namespace: a block may use
  what an earlier block of the same file defined.
* ``<!-- skip: next "reason" -->`` right above a block: it needs what CI does
  not have (a remote worker, Modal, a GPU, a Ray cluster, or minutes). It is
  reported as skipped with that reason (``pytest -ra`` lists them), and
  ``tests/unit/test_docs.py`` still checks that it parses.
* ``<!-- invisible-code-block: python ... -->``: what a reader brings along
  (a model, a few batches), run before the blocks below it but not shown.
* Each file runs in its own temporary working directory, so checkpoints and
  reports the examples write land there.

pytest collects README.md and docs/ because ``testpaths`` in pyproject.toml
names them; ``pytest README.md`` runs one file's examples.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

_HOME, _COMPILE = "_docs_previous_cwd", "_docs_torch_compile"


def _enter(namespace: dict) -> None:
    import torch

    namespace[_HOME] = os.getcwd()
    namespace[_COMPILE] = torch.compile  # an example importing Lightning replaces it (see _leave)
    os.chdir(tempfile.mkdtemp(prefix="remotorch-docs-"))


def _leave(namespace: dict) -> None:
    import torch

    torch.compile = namespace.pop(_COMPILE)  # the rest of the run compiles without Lightning's wrapper
    here = os.getcwd()
    os.chdir(namespace.pop(_HOME))
    shutil.rmtree(here, ignore_errors=True)


pytest_collect_file = Sybil(
    parsers=[PythonCodeBlockParser(), SkipParser()],
    patterns=["README.md", "docs/*.md"],
    setup=_enter,
    teardown=_leave,
).pytest()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A skipped example is reported at its place in the file (``README.md:110``), not inside pytest."""
    outcome = yield
    report = outcome.get_result()
    example = getattr(item, "example", None)
    if example is not None and report.skipped and isinstance(report.longrepr, tuple):
        report.longrepr = (str(item.path.relative_to(item.config.rootpath)), example.line, report.longrepr[2])
