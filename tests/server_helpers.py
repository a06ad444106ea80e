"""Start and stop a real ``sot serve`` subprocess on 127.0.0.1 for the server tests."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``sot serve ARGS`` on a free port; :meth:`wait_ready` blocks until ``/health`` is 200."""

    def __init__(self, *args: str, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "sot.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        seen_503 = False
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sot serve exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                status = httpx.get(f"{self.url}/health", timeout=5).status_code
            except httpx.TransportError:
                status = None
            if status == 200:
                self.saw_loading = seen_503
                return
            seen_503 = seen_503 or status == 503
            time.sleep(0.2)
        raise RuntimeError(f"sot serve was not ready in {timeout} s:\n{self.log.read_text()[-3000:]}")

    def metric(self, name: str) -> float:
        """The value of one sample line of ``/metrics`` (0 when absent)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        return 0.0

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
