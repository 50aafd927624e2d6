"""octoml-profile's API on remotorch: its users' scripts run with one import line changed.

octoml-profile's service is gone; scripts written for it read::

    from octoml_profile import accelerate, remote_profile, RemoteInferenceSession

and run unchanged with::

    from remotorch.compat.octoml_profile import accelerate, remote_profile, RemoteInferenceSession

* :func:`accelerate` is :func:`remotorch.accelerate` (``torch.compile`` with
  ``local_backend`` outside a profile; every backend inside one).
* :class:`RemoteInferenceSession` ``(backends=None, server_addr=None,
  access_token=None)`` wraps a :class:`remotorch.Session`: ``server_addr``
  (a URL or a list of them) defaults to ``REMOTORCH_URL``, else the embedded
  worker; ``access_token`` to ``REMOTORCH_TOKEN``. Backends are remotorch's
  ``WORKER/ENGINE`` names; octoml-profile's ``HARDWARE/onnxrt-cpu``,
  ``…/onnxrt-cuda`` and ``…/onnxrt-tensorrt`` map to the ``onnxrt`` (or
  ``tensorrt``) engine of a worker of the matching device (see
  :func:`resolve_backends`). Without ``backends``, each worker's ``onnxrt``
  engine is used (its first engine where it has none), as octoml-profile
  used ONNX Runtime on each machine by default.
* ``with remote_profile(session):`` profiles the ``@accelerate`` functions
  called in the block under ``torch.no_grad()`` and prints the report in
  octoml-profile's layout when the block ends (``print_results_to=None``
  prints nothing; ``handle.report()`` gives remotorch's full
  :class:`~remotorch.profile.report.Report`, with percentiles, network time,
  cost and accuracy). Without a session it uses remotorch's process-wide
  default session.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Sequence
from typing import IO

import torch

from .. import errors
from ..client.session import Session, default_session
from ..profile.accelerate import accelerate
from ..profile.context import current_profiler
from ..profile.profiler import Profiler
from ..profile.report import Report

__all__ = ["BackendSubstitutedWarning", "ProfileHandle", "RemoteInferenceSession", "accelerate",
           "remote_profile", "render_octoml", "resolve_backends"]

log = logging.getLogger(__name__)

#: octoml-profile's engine names: remotorch engine, device kind of the worker it must run on
ENGINE_ALIASES = {"onnxrt-cpu": ("onnxrt", "cpu"), "onnxrt-cuda": ("onnxrt", "cuda"),
                  "onnxrt-tensorrt": ("tensorrt", "cuda")}


class BackendSubstitutedWarning(UserWarning):
    """An octoml-profile backend had no worker of its device; the nearest one runs instead."""


# ------------------------------------------------------------------ backends
def _device_kind(worker: dict) -> str:
    return str(worker.get("device", "cpu")).split(":", 1)[0]


def _default_backends(workers: Sequence[dict]) -> list[str]:
    return [f"{w['name']}/{'onnxrt' if 'onnxrt' in w['engines'] else w['engines'][0]}"
            for w in workers if w["engines"]]


def _alias(spec: str, worker: str, engine: str, kind: str, workers: Sequence[dict]) -> str:
    """An octoml-profile backend on the worker that fits it best (the named one first)."""
    ordered = sorted(workers, key=lambda w: w["name"] != worker)
    for w in ordered:
        if _device_kind(w) == kind and engine in w["engines"]:
            if w["name"] != worker:
                log.info("%s runs as %s/%s", spec, w["name"], engine)
            return f"{w['name']}/{engine}"
    for w in ordered:  # no worker of that device: ONNX Runtime wherever it is
        if "onnxrt" in w["engines"]:
            pick = f"{w['name']}/onnxrt"
            warnings.warn(f"{spec}: no {kind} worker in this session offers {engine}; profiling {pick} "
                          f"({w.get('device', '?')}) instead", BackendSubstitutedWarning, stacklevel=4)
            return pick
    wanted = engine if engine == "onnxrt" else f"{engine} or onnxrt"
    raise errors.UnknownBackendError(f"{spec}: no worker of this session offers {wanted}; "
                                     f"they offer {', '.join(_offered(workers)) or 'nothing'}")


def _offered(workers: Sequence[dict]) -> list[str]:
    return [f"{w['name']}/{e}" for w in workers for e in w["engines"]]


def resolve_backends(requested: str | Sequence[str] | None, workers: Sequence[dict]) -> list[str]:
    """remotorch backends (``WORKER/ENGINE``) for what a script asked, given the session's workers.

    ``workers`` are health replies (``name``, ``device``, ``engines``), as
    :meth:`remotorch.Session.workers` gives them. A remotorch backend the
    workers offer is taken as it is. An octoml-profile engine name
    (:data:`ENGINE_ALIASES`) runs on the named worker if it has the engine
    and the device, else on the first worker that has both (its hardware
    name, e.g. ``r6i.large``, usually names no worker); where no worker has
    the device, ONNX Runtime runs on another with a
    :class:`BackendSubstitutedWarning`. Duplicates collapse. Anything else
    is an :class:`~remotorch.errors.UnknownBackendError`.
    """
    if requested is None:
        chosen = _default_backends(workers)
        if not chosen:
            raise errors.UnknownBackendError("the session's workers offer no engine")
        return chosen
    specs = [requested] if isinstance(requested, str) else list(requested)
    by_name = {w["name"]: w for w in workers}
    out: list[str] = []
    for spec in specs:
        if not isinstance(spec, str) or spec.count("/") != 1 or spec.startswith("/") or spec.endswith("/"):
            raise ValueError(f"a backend is 'WORKER/ENGINE' (e.g. local/onnxrt or r6i.large/onnxrt-cpu), "
                             f"got {spec!r}")
        worker, engine = spec.split("/")
        if engine in ENGINE_ALIASES:
            pick = _alias(spec, worker, *ENGINE_ALIASES[engine], workers)
        elif worker in by_name and engine in by_name[worker]["engines"]:
            pick = spec
        else:
            raise errors.UnknownBackendError(
                f"no such backend: {spec}; the session's workers offer {', '.join(_offered(workers))} "
                f"(and octoml-profile's {', '.join(ENGINE_ALIASES)} on any worker name)")
        if pick not in out:
            out.append(pick)
    return out


# ------------------------------------------------------------------ session
class RemoteInferenceSession:
    """octoml-profile's session: the workers and backends a profile runs on.

    ``backends`` is one ``WORKER/ENGINE`` string or a list (see
    :func:`resolve_backends`); ``server_addr`` one URL or a list (default
    ``REMOTORCH_URL``, else the embedded worker); ``access_token`` the
    workers' token (default ``REMOTORCH_TOKEN``). ``session`` wraps an
    existing :class:`remotorch.Session` instead (which this object then does
    not close). ``insecure`` is accepted for old scripts and ignored: a
    ``tls://`` address is what asks for encryption in remotorch.
    Workers are contacted on first use, not here.
    """

    def __init__(self, backends: str | Sequence[str] | None = None, server_addr: str | Sequence[str] | None = None,
                 insecure: bool | None = None, access_token: str | None = None, *,
                 session: Session | None = None) -> None:
        if session is not None and (server_addr is not None or access_token is not None):
            raise ValueError("give either session or server_addr/access_token, not both")
        self._requested = backends
        self._owned = session is None
        self.session = session if session is not None else Session(server_addr, token=access_token)
        self._backends: list[str] | None = None

    @property
    def backends(self) -> list[str]:
        """The remotorch backends this session profiles on (asks the workers the first time)."""
        if self._backends is None:
            self._backends = resolve_backends(self._requested, self.session.workers())
        return list(self._backends)

    def supported_backends(self) -> list[str]:
        """Every ``WORKER/ENGINE`` the session's workers offer."""
        return self.session.backends()

    def print_supported_backends(self, file: IO[str] | None = None) -> None:
        """Print the backends the workers offer and how octoml-profile's engine names map to them."""
        out = file or sys.stdout
        print("Supported backends (WORKER/ENGINE):", file=out)
        for w in self.session.workers():
            for engine in w["engines"]:
                print(f"    {w['name']}/{engine:12s} {w['device']}", file=out)
        print("octoml-profile engine names (any worker name):", file=out)
        for alias, (engine, kind) in ENGINE_ALIASES.items():
            print(f"    */{alias:16s} {engine} on a {kind} worker", file=out)

    def close(self) -> None:
        """Close the session (and stop its embedded worker) unless it wraps one it was given."""
        if self._owned:
            self.session.close()

    def __enter__(self) -> RemoteInferenceSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        shown = self._backends if self._backends is not None else self._requested
        return f"RemoteInferenceSession(backends={shown!r})"


# ------------------------------------------------------------------ profiling
class ProfileHandle:
    """What ``with remote_profile(...) as handle`` gives: ``handle.report()`` after (or during) the block."""

    def __init__(self, session: RemoteInferenceSession, owned: bool, num_repeats: int, num_warmups: int,
                 print_results_to: IO[str] | None) -> None:
        self.session = session
        self._owned = owned
        self._num_repeats = num_repeats
        self._num_warmups = num_warmups
        self._print_to = print_results_to
        self._profiler: Profiler | None = None
        self._no_grad: torch.no_grad | None = None

    def __enter__(self) -> ProfileHandle:
        if current_profiler() is not None:
            raise RuntimeError("Nested remote_profile() contexts are not allowed")
        try:
            profiler = Profiler(self.session.session, backends=self.session.backends,
                                num_repeats=self._num_repeats, num_warmups=self._num_warmups)
            profiler.__enter__()
        except BaseException:
            if self._owned:
                self.session.close()
            raise
        self._profiler = profiler
        self._no_grad = torch.no_grad()
        self._no_grad.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._no_grad.__exit__(*exc)
            self._profiler.__exit__(*exc)
            if self._print_to is not None:
                print(render_octoml(self.report()), file=self._print_to, flush=True)
        finally:
            if self._owned:
                self.session.close()

    def report(self) -> Report:
        """remotorch's report of what was profiled (``.print()``, ``.save(dir)``, ``.totals``)."""
        if self._profiler is None:
            raise RuntimeError("the profile has not started")
        return self._profiler.report()


def remote_profile(session: RemoteInferenceSession | None = None, *,
                   backends: str | Sequence[str] | None = None, server_addr: str | Sequence[str] | None = None,
                   insecure: bool | None = None, access_token: str | None = None,
                   num_repeats: int = 10, num_warmups: int = 1,
                   print_results_to: IO[str] | None = sys.stdout) -> ProfileHandle:
    """Profile ``@accelerate`` functions called in the ``with`` block; print the report when it ends.

    Give a :class:`RemoteInferenceSession`, or the arguments of a new one
    (closed when the block ends), not both; with neither, remotorch's
    process-wide session is used. Each graph runs ``num_warmups`` times,
    then ``num_repeats`` timed times per call on every backend; calls in
    which something compiled are discarded and counted.
    """
    given = dict(backends=backends, server_addr=server_addr, access_token=access_token)
    if session is not None:
        named = [k for k, v in given.items() if v is not None]
        if named:
            raise ValueError(f"`session` cannot be set at the same time as `{named[0]}`: give an existing "
                             f"session or the parameters of a new one, not both")
        return ProfileHandle(session, False, num_repeats, num_warmups, print_results_to)
    if server_addr is None and access_token is None:
        wrapped = RemoteInferenceSession(backends, session=default_session())
        return ProfileHandle(wrapped, True, num_repeats, num_warmups, print_results_to)
    return ProfileHandle(RemoteInferenceSession(backends, server_addr, insecure, access_token), True,
                         num_repeats, num_warmups, print_results_to)


# ------------------------------------------------------------------ the report, octoml-profile's layout
def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _segment_rows(report: Report, seq, numbers: dict[str, int]) -> list[tuple]:
    """(index, name, runs, mean, failures) rows of one sequence; None marks a blank line."""
    rows: list = []
    for i, seg in enumerate(seq.segments):
        if i:
            rows.append(None)
        if seg.kind == "local":
            st = next(iter(seg.stats.values()))
            rows.append((str(i), "Uncompiled", str(st.runs), _ms(st.mean_ms), ""))
            continue
        numbers.setdefault(seg.graph_id, len(numbers) + 1)
        rows.append((str(i), f"Graph #{numbers[seg.graph_id]}", "", "", ""))
        for backend in report.backends:
            st = seg.stats[backend]
            rows.append(("", f"  {backend}", str(st.runs), _ms(st.mean_ms), str(sum(st.failures.values()))))
    return rows


def _table(rows: list) -> list[str]:
    head = ("", "Segment", "Runs", "Mean ms", "Failures")
    real = [r for r in rows if r is not None]
    widths = [max(len(r[c]) for r in [head, *real]) for c in range(5)]

    def line(r) -> str:
        return (f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}  "
                f"{r[4]:>{widths[4]}}").rstrip()

    width = sum(widths) + 8
    body = ["" if r is None else line(r) for r in rows]
    return [line(head).ljust(width), "=" * width, *body, "-" * width]


def render_octoml(report: Report) -> str:
    """The report in octoml-profile's layout: segments per profile, then totals per backend."""
    lines = [f"Runs discarded because compilation occurred: {report.compile_calls}"]
    numbers: dict[str, int] = {}
    for n, seq in enumerate(report.sequences, 1):
        lines += [f"Profile {n}/{len(report.sequences)}:", *_table(_segment_rows(report, seq, numbers))]
    summaries = list(report.summaries.values())
    local = summaries[0].local_ms if summaries else None
    lines.append(f"Total uncompiled code run time: {_ms(local)} ms")
    lines.append("Total times (compiled + uncompiled) per backend, ms:")
    width = max((len(s.backend) for s in summaries), default=0)
    lines += [f"    {s.backend:<{width}}  {_ms(s.total_ms)}" for s in summaries]
    if not report.timed_calls:
        lines.append("NOTE: no call was timed (each one compiled something); call the function more often")
    failed = [(s.backend, msg, k) for s in summaries for msg, k in s.failures.items()]
    if failed:
        lines.append("Failures:")
        lines += [f"    {b}: {k}x {msg}" for b, msg, k in failed]
    return "\n".join(lines)
