"""The benchmark's network in a process of its own: ``DelayProxy`` relays, driven over a pipe.

``DelayProxy`` relays in Python threads; inside the benchmark's process those
threads would take turns with the client's own Python code for the
interpreter lock, so the network would slow down (and be slowed down by) the
systems being measured, unequally: remotorch's client runs Python between
requests, the peers' clients mostly wait in C. Here every proxy of a phase
lives in one child process (``python -m _wan.netproc``) that takes one JSON
command per line on standard input and answers one JSON line. It exits when
its standard input closes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Network:
    """The child process and its proxies; :meth:`proxy` makes one, :meth:`set_rtt` sets them all."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([BENCH_DIR, os.environ.get("PYTHONPATH", "")]))
        self._proc = subprocess.Popen([sys.executable, "-m", "_wan.netproc"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env=env)
        self._lock = threading.Lock()  # one command at a time (torch RPC's store asks from its own thread)
        self.proxies: list[Proxy] = []

    def ask(self, **command) -> dict:
        with self._lock:
            self._proc.stdin.write(json.dumps(command) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the network process exited (code {self._proc.poll()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"the network process refused {command}: {answer['error']}")
        return answer

    def proxy(self, target) -> Proxy:
        """A new relay to ``target`` (a ``tcp://host:port`` URL or ``(host, port)``), no delay yet."""
        if isinstance(target, str):
            host, port = target.split("://", 1)[1].rsplit(":", 1)
            target = (host, int(port))
        p = Proxy(self, len(self.proxies), self.ask(op="open", target=list(target))["port"])
        self.proxies.append(p)
        return p

    def set_rtt(self, rtt_ms: float) -> None:
        self.ask(op="delay", ms=rtt_ms / 2)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


class Proxy:
    """One relay in the network process: ``url`` to connect to; what crossed it, each way."""

    def __init__(self, net: Network, index: int, port: int) -> None:
        self._net, self._index, self.port = net, index, port

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def aim(self, host: str, port: int) -> None:
        """Relay new connections to ``(host, port)`` from now on."""
        self._net.ask(op="aim", id=self._index, target=[host, port])

    def reset_log(self) -> None:
        self._net.ask(op="reset", id=self._index)

    def cpu_s(self) -> float:
        """CPU seconds the network process has used so far (all its relays: a real network takes none)."""
        return self._net.ask(op="cpu")["s"]

    def totals(self) -> tuple[int, int]:
        """Bytes relayed up (to the server) and down since the last :meth:`reset_log`."""
        answer = self._net.ask(op="totals", id=self._index)
        return answer["up"], answer["down"]


def serve() -> None:
    """Answer commands on standard input until it closes."""
    from remotorch.devtools.netem import DelayProxy

    proxies: list[DelayProxy] = []
    delay = 0.0
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        try:
            if op == "open":
                proxies.append(DelayProxy(tuple(command["target"]), delay_ms=delay))
                answer = {"port": proxies[-1].port}
            elif op == "delay":
                delay = command["ms"]
                for p in proxies:
                    p.set_delay(delay)
                answer = {}
            elif op == "aim":
                proxies[command["id"]].target = tuple(command["target"])
                answer = {}
            elif op == "reset":
                proxies[command["id"]].reset_log()
                answer = {}
            elif op == "cpu":
                answer = {"s": time.process_time()}
            elif op == "totals":
                ex = proxies[command["id"]].exchanges()
                answer = {"up": sum(e.up for e in ex), "down": sum(e.down for e in ex)}
            else:
                answer = {"error": f"unknown op {op!r}"}
        except Exception as exc:  # answered, so that the benchmark raises it
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    for p in proxies:
        p.close()


if __name__ == "__main__":
    serve()
