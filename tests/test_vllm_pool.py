"""The servers Explore keeps between runs (mtp_viz.serving.pool), with the stand-in server
(tests/fake_vllm.py): reused per configuration, the least recently used one stopped when the
bound is reached, stopped when idle and at exit, replaced when dead, one run at a time on each.
And the plan reads the target's tokenizer without loading its weights."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
from conftest import gone, until

from mtp_viz.serving import pool as pool_module
from mtp_viz.serving.pool import ServerPool
from mtp_viz.serving.server import ServerConfig, ServerError


def config(tmp_path, *extra: str) -> ServerConfig:
    return ServerConfig(model_dir=str(tmp_path), served_name="tiny", extra_args=extra)


def port_free(url: str) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", int(url.rsplit(":", 1)[1]))) != 0


def server_pids(server) -> list[int]:
    """The server's processes: its guard, the server and the engine child it started."""
    return [server.process.pid] + [c.pid for c in psutil.Process(server.process.pid).children(recursive=True)]


@pytest.fixture
def pool():
    p = ServerPool(limit=1, idle_s=60)
    yield p
    p.close()


def test_a_second_run_on_the_same_configuration_reuses_the_server(fake_vllm, tmp_path, pool):
    with pool.lease(config(tmp_path)) as first:
        server, pids = first.server, server_pids(first.server)
        assert not first.reused
    assert server.alive and not gone(pids, timeout=0.5), "released, not stopped"
    with pool.lease(config(tmp_path)) as second:
        assert second.server is server and second.reused
    assert pool.servers() == [server]


def test_another_configuration_evicts_the_least_recently_used_server(fake_vllm, tmp_path):
    pool = ServerPool(limit=2, idle_s=60)
    try:
        started = {}
        for name in ("a", "b", "a", "c"):  # "a" used again after "b": "b" is the least recent when "c" comes
            with pool.lease(config(tmp_path, "--tag", name)) as lease:
                started.setdefault(name, (lease.server, server_pids(lease.server)))
                assert lease.reused == (name == "a" and len(started) == 2)
        (a, _), (b, b_pids), (c, _) = started["a"], started["b"], started["c"]
        assert gone(b_pids) and port_free(b.url), "the evicted server's processes or port outlived it"
        assert set(pool.servers()) == {a, c} and a.alive and c.alive
    finally:
        pool.close()


def test_with_room_for_one_the_other_configuration_stops_it_first(fake_vllm, tmp_path, pool):
    with pool.lease(config(tmp_path, "--tag", "a")) as lease:
        a, a_pids = lease.server, server_pids(lease.server)
    with pool.lease(config(tmp_path, "--tag", "b")) as lease:
        assert gone(a_pids, timeout=0.1) and port_free(a.url)  # stopped before b started
        assert pool.servers() == [lease.server]


def test_an_idle_server_is_stopped_after_the_limit(fake_vllm, tmp_path, monkeypatch):
    monkeypatch.setenv(pool_module.IDLE_ENV, "0.5")
    pool = ServerPool(limit=1)
    try:
        assert pool.idle_s == 0.5
        with pool.lease(config(tmp_path)) as lease:
            time.sleep(1.0)  # busy past the limit: a server in use is never stopped
            assert lease.server.alive
            server, pids = lease.server, server_pids(lease.server)
        assert gone(pids, timeout=5) and port_free(server.url)
        assert pool.servers() == []
    finally:
        pool.close()


def test_a_dead_server_is_replaced_on_the_next_run(fake_vllm, tmp_path, pool):
    with pool.lease(config(tmp_path)) as lease:
        dead, dead_pids = lease.server, server_pids(lease.server)
    os.kill(json.loads(fake_vllm.read_text())[0], signal.SIGKILL)  # the server crashes, its engine left behind
    until(lambda: not dead.alive)  # its guard follows within a poll
    with pool.lease(config(tmp_path)) as lease:
        assert lease.server is not dead and lease.server.alive and not lease.reused
        assert gone(dead_pids), "the crashed server's leftover processes were not stopped"
    assert pool.servers() == [lease.server]


def test_a_run_waits_for_a_busy_server_and_never_stops_it(fake_vllm, tmp_path, pool):
    """Room for one: a run on the same configuration and one on another both wait their turn."""
    heard: dict[str, list[str]] = {"same": [], "other": []}
    got: dict[str, tuple] = {}
    order: list[str] = []
    with pool.lease(config(tmp_path)) as held:

        def run(name, *extra):
            with pool.lease(config(tmp_path, *extra), progress=heard[name].append) as lease:
                order.append(name)
                got[name] = (lease.server, lease.reused)

        waiting = [
            threading.Thread(target=run, args=("same",)),
            threading.Thread(target=run, args=("other", "--tag", "b")),
        ]
        for thread in waiting:
            thread.start()
        told = until(lambda: all(any("waiting for another run" in m for m in h) for h in heard.values()))
        assert told, f"both runs should say they wait: {heard}"
        assert all(t.is_alive() for t in waiting) and not got and held.server.alive
    for thread in waiting:
        thread.join(30)
    assert sorted(order) == ["other", "same"], "both runs should get their turn once the held one ends"
    other_server, other_reused = got["other"]
    assert other_server is not held.server and not other_reused  # its own configuration: a server of its own
    if order[0] == "same":  # the held server was still there for it
        assert got["same"] == (held.server, True)
    else:  # "other" took the only room first, stopping the idle held server; "same" started anew
        assert got["same"][0] is not held.server and not got["same"][1]


def test_a_waiting_run_can_be_stopped(fake_vllm, tmp_path, pool):
    with pool.lease(config(tmp_path, "--tag", "a")) as held:
        waiting = pool.lease(config(tmp_path, "--tag", "b"), cancelled=lambda: True)
        with pytest.raises(ServerError, match="stopped while waiting"), waiting:
            pass
        assert held.server.alive and pool.servers() == [held.server]


def test_a_failed_start_is_not_kept(fake_vllm, tmp_path, pool, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_MODE", "die")
    with pytest.raises(ServerError, match="exited with status 1"), pool.lease(config(tmp_path)):
        pass
    monkeypatch.setenv("FAKE_VLLM_MODE", "ok")
    with pool.lease(config(tmp_path)) as lease:
        assert lease.server.alive and not lease.reused


EXIT_SCRIPT = """
import sys, threading, time
from mtp_viz.serving import pool
from mtp_viz.serving.server import ServerConfig

pool.stop_on_exit()
def run():  # as the app runs it: in a worker thread, where no signal handler can be set
    with pool.shared().lease(ServerConfig(model_dir={dir!r}, served_name="tiny")) as lease:
        print(lease.server.url, flush=True)
worker = threading.Thread(target=run)
worker.start()
worker.join()
if sys.argv[1] == "wait":
    time.sleep(600)
"""


@pytest.mark.parametrize(("how", "status"), [("end", 0), ("wait", -signal.SIGTERM)])
def test_exit_stops_every_kept_server(fake_vllm, tmp_path, how, status):
    """At the end of the process (atexit), and on SIGTERM while the app waits for runs."""
    script = textwrap.dedent(EXIT_SCRIPT.format(dir=str(tmp_path)))
    parent = subprocess.Popen([sys.executable, "-c", script, how], stdout=subprocess.PIPE, text=True, env=os.environ)
    url = parent.stdout.readline().strip()
    pids = json.loads(fake_vllm.read_text())
    if how == "wait":
        assert not gone(pids, timeout=0.5), "the server should be kept while the app runs"
        parent.send_signal(signal.SIGTERM)
    assert parent.wait(30) == status
    # stopped by the process itself before it ended, not later by the guard noticing it gone
    assert gone(pids, timeout=0.2), f"a kept server outlived its process ({how})"
    assert port_free(url)


def test_the_plan_reads_the_tokenizer_without_loading_the_weights(use_tiny_registry, monkeypatch):
    from mtp_viz.loading import load_model, pipeline
    from mtp_viz.runner import RunRequest
    from mtp_viz.serving import backend
    from mtp_viz.serving.export import model_dir

    pipeline.forget()
    backend.served_target.cache_clear()

    def no_load(spec):
        raise AssertionError(f"the plan loaded {spec.name}'s weights")

    with monkeypatch.context() as m:
        m.setattr(pipeline, "load", no_load)
        p = backend.plan(RunRequest(model="tiny", prompt="the cat"))
        ids = backend.prompt_ids(p)
    assert not pipeline._loaded
    loaded = load_model("tiny", "cpu", "float32")  # the same answers the full load gives
    assert (p.target.name, p.target.chat, p.target.eos_token_ids) == (loaded.name, loaded.chat, loaded.eos_token_ids)
    assert p.server.model_dir == model_dir(loaded)
    assert ids == backend.encode_prompt(loaded, "the cat")


def test_on_a_gpu_two_servers_split_the_cards_memory(fake_vllm, tmp_path, monkeypatch):
    monkeypatch.setattr(pool_module.torch.cuda, "is_available", lambda: True)
    pool = ServerPool(idle_s=60)
    try:
        assert pool.limit == pool_module.MAX_SERVERS_GPU == 2
        with pool.lease(config(tmp_path)) as lease:
            args = lease.server.args
        share = args[args.index("--gpu-memory-utilization") + 1]
        assert float(share) == pytest.approx(pool_module.GPU_MEMORY_FRACTION / 2)
    finally:
        pool.close()
    assert "--gpu-memory-utilization" not in config(tmp_path).args(8000)  # the one-shot servers: vLLM's default
