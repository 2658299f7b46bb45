"""The app in its own process, as users meet it, for the benchmarks that drive it over HTTP."""

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from gradio_client import Client

ROOT = Path(__file__).resolve().parent.parent


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) a process has used: work done, whatever the noise."""
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def rss_mb(pid: int) -> float:
    """Resident memory of a process, MiB."""
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


def connect(url: str, timeout_s: float = 180.0) -> Client:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client(url, verbose=False)
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


@contextmanager
def served_app(port: int = 7861):
    """Launch app.py on `port`; yields (server process, its URL, a connected client)."""
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "app.py")],
        cwd=ROOT,
        env={**os.environ, "GRADIO_SERVER_PORT": str(port)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/"
    try:
        yield server, url, connect(url)
    finally:
        server.terminate()
        server.wait(timeout=30)
