"""Starts `python -m jaxserve.serve --port 0 FLAGS` for a benchmark, waits until it is ready, stops it.

The server prints one line, `jaxserve ready in T s: http://HOST:PORT/v1 (model ...)`, once every
step shape is compiled; we read the URL from it (with `--port 0` only the server knows the
port), then check that /health answers 200. Its stdout and stderr go to a log file, so a server
that fails to start can be explained with the file's last lines.
"""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

READY_LINE = re.compile(r"jaxserve ready in [\d.]+ s: (http://\S+)/v1\b")


class ServerFailedError(RuntimeError):
    pass


class LaunchedServer:
    """`with LaunchedServer(flags, log_path) as server:` runs a server for the block's duration;
    `server.url` is its base URL and `server.startup_s` the time it took to become ready."""

    def __init__(self, flags: str, log_path: Path, startup_timeout_s: float = 1800, stop_timeout_s: float = 60):
        self.command = [sys.executable, "-m", "jaxserve.serve", "--port", "0", *shlex.split(flags)]
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.process: subprocess.Popen | None = None
        self.url: str | None = None
        self.startup_s: float | None = None
        self.returncode: int | None = None

    def __enter__(self) -> "LaunchedServer":
        started = time.perf_counter()
        with open(self.log_path, "wb") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
        try:
            self.url = self._wait_ready(started)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - started
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _wait_ready(self, started: float) -> str:
        while time.perf_counter() - started < self.startup_timeout_s:
            if self.process.poll() is not None:
                raise ServerFailedError(f"the server exited with status {self.process.returncode} before it "
                                        f"was ready; the end of {self.log_path}:\n{self.log_tail()}")
            match = READY_LINE.search(self.log_path.read_text(errors="replace"))
            if match and _healthy(match.group(1)):
                return match.group(1)
            time.sleep(0.5)
        raise ServerFailedError(f"the server was not ready after {self.startup_timeout_s:.0f} s; the end of "
                                f"{self.log_path}:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM (the server drains and exits), then SIGKILL if it takes over `stop_timeout_s`."""
        if self.process is None or self.returncode is not None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.returncode = self.process.returncode

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace").replace("\r", "\n")  # progress bars redraw with \r
        return "\n".join([line for line in text.splitlines() if line.strip()][-lines:])


def _healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=5) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):  # 503 (HTTPError) while compiling, or not listening yet
        return False
