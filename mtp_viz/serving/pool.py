"""vLLM servers kept between interactive runs: one per server configuration (model, dtype, context,
speculative method and its settings: everything `ServerConfig.key` holds), leased to one run at a
time, so that a second run on the same configuration answers in seconds instead of the ~2 minutes
a start takes on a CPU.

- Bounded: at most `max_servers()` at once (MAX_SERVERS_CPU on a CPU machine, MAX_SERVERS_GPU with a
  GPU); a run that needs another configuration stops the least recently used idle server first.
  Memory is bounded per server: on a CPU its KV cache is fixed by VLLM_CPU_KVCACHE_SPACE
  (`mtp_viz.serving.backend.CPU_KV_CACHE_GIB`) and one server fits beside our own engine; on a GPU,
  where vLLM takes a share of the card for weights and KV cache up front, each server is given
  GPU_MEMORY_FRACTION / MAX_SERVERS_GPU (`--gpu-memory-utilization`), the rest left to our engine.
- One run per server at a time: a run that needs a busy server (or a free slot while every server
  is busy) waits its turn, cancellable, and is refused after WAIT_LIMIT_S; a server in use is never
  stopped by another run.
- Stopped after IDLE_LIMIT_S unused ($MTP_VIZ_VLLM_IDLE_S), at interpreter exit, on SIGTERM once
  `stop_on_exit()` has run in the main thread (the app does), and by the guard it runs under
  (mtp_viz.child) if we are killed outright. A server found dead is stopped (its leftover
  processes too) and replaced on the next run.

The one-shot users (the CLI's `run`, the bench's sweeps and peers) start and stop their own servers:
a process that exits after one run gains nothing from keeping one.
"""

import atexit
import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from mtp_viz.serving.server import Progress, ServerConfig, ServerError, StopAsked, VLLMServer

MAX_SERVERS_CPU = 1  # a CPU machine runs one server beside our engine (2 GiB KV cache + weights each)
MAX_SERVERS_GPU = 2  # each takes GPU_MEMORY_FRACTION / MAX_SERVERS_GPU of the card
GPU_MEMORY_FRACTION = 0.8  # of the GPU's memory for all pooled servers together
IDLE_LIMIT_S = 600.0  # a server unused this long is stopped
IDLE_ENV = "MTP_VIZ_VLLM_IDLE_S"  # overrides IDLE_LIMIT_S (tests)
WAIT_LIMIT_S = 900.0  # a run waiting for a busy server gives up after this long
WAIT_POLL_S = 1.0  # how often a waiting run reports and checks for Stop


def max_servers() -> int:
    return MAX_SERVERS_GPU if torch.cuda.is_available() else MAX_SERVERS_CPU


def idle_limit_s() -> float:
    return float(os.environ.get(IDLE_ENV, IDLE_LIMIT_S))


@dataclass(eq=False)
class Lease:
    """One configuration's server; `reused`: it answered a run before this one (no warm-up needed)."""

    key: tuple
    server: VLLMServer | None = None  # None while it starts
    busy: bool = True
    reused: bool = False
    last_used: float = field(default_factory=time.monotonic)


class ServerPool:
    def __init__(self, limit: int | None = None, idle_s: float | None = None):
        self.limit = limit if limit is not None else max_servers()
        self.idle_s = idle_s if idle_s is not None else idle_limit_s()
        self.gpu_share = GPU_MEMORY_FRACTION / self.limit if torch.cuda.is_available() else None
        self._cond = threading.Condition()  # guards _leases; notified when one is released
        self._leases: dict[tuple, Lease] = {}
        self._closed = False
        self._reaper = threading.Thread(target=self._reap, name="vllm-pool-reaper", daemon=True)
        self._reaper.start()

    @contextlib.contextmanager
    def lease(
        self, config: ServerConfig, progress: Progress | None = None, cancelled: StopAsked | None = None
    ) -> Iterator[Lease]:
        """The server for `config`, for this run alone: reused, or started (after stopping the
        least recently used idle one when the pool is full)."""
        lease, stale = self._claim(config.key, progress, cancelled)
        try:
            _stop(stale)  # before the start: its memory is what the new server needs
            if lease.server is None:
                started = replace(config, gpu_memory_utilization=self.gpu_share)
                lease.server = VLLMServer.start(started, progress=progress, cancelled=cancelled)
            yield lease
        finally:
            self._release(lease)

    def servers(self) -> list[VLLMServer]:
        with self._cond:
            return [lease.server for lease in self._leases.values() if lease.server is not None]

    def close(self) -> None:
        """Stop every server (busy ones too: the process is ending) and the reaper."""
        with self._cond:
            self._closed = True
            leases, self._leases = list(self._leases.values()), {}
            self._cond.notify_all()
        _stop([lease.server for lease in leases])

    def _claim(self, key: tuple, progress: Progress | None, cancelled: StopAsked | None) -> tuple[Lease, list]:
        """Take `key`'s lease, or a new one when there is room (making it by evicting the least
        recently used idle server); else wait. Returns it with the servers to stop first."""
        deadline = time.monotonic() + WAIT_LIMIT_S
        with self._cond:
            while True:
                if self._closed:
                    raise ServerError("the vLLM servers are shutting down")
                lease = self._leases.get(key)
                if lease is not None and not lease.busy:
                    lease.busy = True
                    if lease.server is not None and lease.server.alive:
                        lease.reused = True
                        return lease, []
                    dead, lease.server, lease.reused = lease.server, None, False  # crashed: replaced
                    return lease, [dead]
                if lease is None and (evicted := self._make_room()) is not None:
                    self._leases[key] = lease = Lease(key)
                    return lease, evicted
                if cancelled is not None and cancelled():
                    raise ServerError("stopped while waiting for a vLLM server")
                if time.monotonic() > deadline:
                    raise ServerError(f"every vLLM server was busy with other runs for {WAIT_LIMIT_S:.0f} s")
                if progress is not None:
                    progress("waiting for another run to finish on the vLLM server")
                self._cond.wait(WAIT_POLL_S)

    def _make_room(self) -> list[VLLMServer] | None:  # under the lock
        """The servers taken out to make room for one more ([]: room already), or None: all busy."""
        if len(self._leases) < self.limit:
            return []
        idle = [lease for lease in self._leases.values() if not lease.busy]
        if not idle:
            return None
        oldest = min(idle, key=lambda lease: lease.last_used)
        del self._leases[oldest.key]
        return [oldest.server]

    def _release(self, lease: Lease) -> None:
        with self._cond:
            lease.busy, lease.last_used = False, time.monotonic()
            failed = lease.server is None or not lease.server.alive  # never started, or died in the run
            if failed and self._leases.get(lease.key) is lease:
                del self._leases[lease.key]
            self._cond.notify_all()
        if failed:
            _stop([lease.server])

    def _reap(self) -> None:
        """Stop servers left idle for idle_s, as they expire."""
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                idle = [lease for lease in self._leases.values() if not lease.busy]
                expired = [lease for lease in idle if now - lease.last_used >= self.idle_s]
                for lease in expired:
                    del self._leases[lease.key]
                if not expired:
                    next_expiry = min((lease.last_used + self.idle_s - now for lease in idle), default=None)
                    self._cond.wait(next_expiry)
                    continue
            _stop([lease.server for lease in expired])


def _stop(servers: list[VLLMServer | None]) -> None:
    for server in servers:
        if server is not None:
            server.stop()


_shared: ServerPool | None = None
_shared_guard = threading.RLock()  # re-entrant: shutdown() may run in a signal handler


def shared() -> ServerPool:
    """The process's pool (the app's runs share it), made on first use."""
    global _shared
    with _shared_guard:
        if _shared is None:
            _shared = ServerPool()
        return _shared


def shutdown() -> None:
    """Stop the process's pool and its servers; a later run makes a new one."""
    global _shared
    with _shared_guard:
        pool, _shared = _shared, None
    if pool is not None:
        pool.close()


atexit.register(shutdown)


def stop_on_exit() -> None:
    """In the main thread: SIGTERM stops the pooled servers before the process ends as it would
    have (runs happen in worker threads, where no signal handler can be set). A handler someone
    else installed is left alone."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_sigterm(signum, frame):
        shutdown()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_sigterm)
