"""A vLLM OpenAI-compatible server as a child process, always stopped; or one the user already runs.

The server runs in `.venv-vllm` (`bash scripts/setup.sh --vllm`): its pins differ from ours, so it
never shares our environment, and we only talk to it over HTTP. It is started in its own process
group, so stopping it stops its engine and worker processes too: at the end of a `with` block,
on an error, on Ctrl-C (KeyboardInterrupt unwinds the block), on SIGTERM (turned into SystemExit
while a server runs), and at interpreter exit as a last resort. When we are killed with SIGKILL
none of that runs: the server runs under mtp_viz.child's guard, which stops the group once we are gone.
"""

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

import httpx
import psutil

from mtp_viz.child import exit_reason, guarded
from mtp_viz.errors import UserError
from mtp_viz.paths import REPO

Progress = Callable[[str], None]  # told what the server is doing, as it happens
StopAsked = Callable[[], bool]  # asked now and then whether to give up
VLLM_VENV = REPO / ".venv-vllm"
PYTHON_ENV = "MTP_VIZ_VLLM_PYTHON"  # another interpreter with vLLM installed
READY_TIMEOUT_S = 900.0  # a 2-core CPU needs ~2 minutes (model load + warm-up compilation)
STOP_GRACE_S = 15.0
LOG_TAIL_LINES = 12
HOST = "127.0.0.1"


class ServerError(UserError):
    """The server could not be started, died, or is not the one asked for."""


def vllm_python() -> Path:
    given = os.environ.get(PYTHON_ENV)
    python = Path(given) if given else VLLM_VENV / "bin" / "python"
    if not python.is_file():
        raise ServerError(f"vLLM is not installed ({python} missing): run  bash scripts/setup.sh --vllm")
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((HOST, port)) == 0


@dataclass(frozen=True)
class ServerConfig:
    model_dir: str  # a Hugging Face model directory (the embedded model's converted copy)
    served_name: str  # the name requests use
    extra_args: tuple[str, ...] = ()  # speculation (mtp_viz.serving.methods.server_args)
    dtype: str = "float32"
    max_model_len: int = 4096
    port: int | None = None  # None: a free one
    env: dict[str, str] = field(default_factory=dict)
    gpu_memory_utilization: float | None = None  # the share of the GPU's memory it takes (None: vLLM's default)

    @property
    def key(self) -> tuple:
        """What makes two servers different (hashable: the environment as sorted pairs)."""
        return (*(getattr(self, f.name) for f in fields(self) if f.name != "env"), tuple(sorted(self.env.items())))

    def args(self, port: int) -> list[str]:
        share = self.gpu_memory_utilization
        return [
            "-m",
            "vllm.entrypoints.openai.api_server",  # the `vllm` console script wants a dist named vllm
            "--model",
            self.model_dir,
            "--served-model-name",
            self.served_name,
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--host",
            HOST,
            "--port",
            str(port),
            "--enable-per-request-metrics",
            "--disable-uvicorn-access-log",
            "--no-enable-prefix-caching",  # as our engine: no request reuses another's prefill
            *(["--gpu-memory-utilization", f"{share:.3f}"] if share is not None else []),
            *self.extra_args,
        ]


_RUNNING: set["VLLMServer"] = set()


def _stop_all() -> None:
    for server in list(_RUNNING):
        server.stop()


atexit.register(_stop_all)


class VLLMServer:
    """`with VLLMServer.start(config) as server:` … `server.url`; or `VLLMServer.connect(url, name)`."""

    def __init__(self, url: str, served_name: str, process: subprocess.Popen | None = None, log: Path | None = None):
        self.url = url.rstrip("/")
        self.served_name = served_name
        self.process = process
        self.log = log
        self.args: list[str] = []
        self.version: str | None = None
        self._previous_sigterm = None

    @classmethod
    def start(
        cls,
        config: ServerConfig,
        progress: Progress | None = None,
        timeout_s: float = READY_TIMEOUT_S,
        cancelled: StopAsked | None = None,
    ) -> "VLLMServer":
        python = vllm_python()
        if not Path(config.model_dir).is_dir():
            raise ServerError(f"no model directory at {config.model_dir}")
        port = config.port or free_port()
        if port_in_use(port):
            raise ServerError(f"port {port} is in use; pick another or leave the port unset")
        log = Path(tempfile.mkdtemp(prefix="mtp-viz-vllm-")) / "server.log"
        args = config.args(port)
        with open(log, "wb") as out:
            process = subprocess.Popen(
                guarded([str(python), *args]),  # stopped by the guard if we die without stopping it
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: stopped as one
                env={**os.environ, **config.env},
            )
        server = cls(f"http://{HOST}:{port}", config.served_name, process, log)
        server.args = args
        _RUNNING.add(server)
        server._trap_sigterm()
        try:
            server.wait_ready(progress, timeout_s, cancelled)
        except BaseException:
            server.stop(keep_log=True)  # the error names the log
            raise
        return server

    @classmethod
    def connect(cls, url: str, served_name: str | None = None) -> "VLLMServer":
        """A server the user runs; its model must be `served_name` (None: whatever it serves)."""
        server = cls(url, served_name or "")
        try:
            models = server.models()
        except httpx.HTTPError as e:
            raise ServerError(f"no vLLM server answers at {url}: {e}") from None
        if served_name is None and models:
            server.served_name = models[0]
        server.check_model()
        server.version = server._version()
        return server

    def models(self) -> list[str]:
        r = httpx.get(f"{self.url}/v1/models", timeout=10)
        r.raise_for_status()
        return [m["id"] for m in r.json().get("data", [])]

    def check_model(self) -> None:
        models = self.models()
        if self.served_name not in models:
            raise ServerError(
                f"the server at {self.url} serves {', '.join(models) or 'nothing'}, not {self.served_name}"
            )

    def _version(self) -> str | None:
        try:
            return httpx.get(f"{self.url}/version", timeout=10).json().get("version")
        except (httpx.HTTPError, ValueError):
            return None

    def wait_ready(
        self,
        progress: Progress | None = None,
        timeout_s: float = READY_TIMEOUT_S,
        cancelled: StopAsked | None = None,
    ) -> None:
        start = time.monotonic()
        while True:
            elapsed = time.monotonic() - start
            if self.process is not None and self.process.poll() is not None:
                raise ServerError(f"the vLLM server {exit_reason(self.process.returncode)}: {self.last_error()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            if elapsed > timeout_s:
                raise ServerError(f"the vLLM server was not ready after {timeout_s:.0f} s: {self.last_error()}")
            if cancelled is not None and cancelled():
                raise ServerError("stopped while the vLLM server was starting")
            if progress is not None:
                progress(f"starting vLLM ({elapsed:.0f} s): {self.last_line()}")
            time.sleep(1.0)
        self.check_model()
        self.version = self._version()
        if progress is not None:
            progress(f"vLLM {self.version} ready after {time.monotonic() - start:.0f} s")

    def log_lines(self) -> list[str]:
        if self.log is None or not self.log.is_file():
            return []
        return self.log.read_text(errors="replace").splitlines()

    def last_line(self) -> str:
        lines = [line for line in self.log_lines() if line.strip()]
        return lines[-1][-160:] if lines else ""

    def last_error(self) -> str:
        """The most telling line of the log: the last error, else the last line."""
        lines = [line.strip() for line in self.log_lines()[-200:] if line.strip()]
        errors = [line for line in lines if "Error" in line or "error:" in line]
        return (errors or lines or ["(no output)"])[-1][-300:] + f" (log: {self.log})"

    @property
    def alive(self) -> bool:
        return self.process is None or self.process.poll() is None

    def stop(self, keep_log: bool = False) -> None:
        """Stop the server and every process it started (its process group and descendants); its
        log folder goes too unless asked to keep it (a failed start's error names the log)."""
        process, self.process = self.process, None
        _RUNNING.discard(self)
        self._restore_sigterm()
        if process is None:
            return
        self._stop_processes(process)
        if self.log is not None and not keep_log:
            shutil.rmtree(self.log.parent, ignore_errors=True)

    @staticmethod
    def _stop_processes(process: subprocess.Popen) -> None:
        try:
            children = psutil.Process(process.pid).children(recursive=True)
        except psutil.Error:
            children = []
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(STOP_GRACE_S)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        for child in children:  # any that left the group
            with contextlib.suppress(psutil.Error):
                child.kill()
        process.wait()
        psutil.wait_procs(children, timeout=STOP_GRACE_S)

    def _trap_sigterm(self) -> None:
        """While the server runs, SIGTERM to us unwinds like Ctrl-C, so the server is stopped."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._previous_sigterm = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum, frame):
            sys.exit(128 + signum)

        signal.signal(signal.SIGTERM, on_sigterm)

    def _restore_sigterm(self) -> None:
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    def __enter__(self) -> "VLLMServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
