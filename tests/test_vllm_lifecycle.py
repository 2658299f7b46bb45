"""The vLLM server's life as mtp-viz runs it: started in its own process group, always stopped
(normal end, error, Ctrl-C, SIGTERM), a clear error for each way it can fail to start; the UI's
runs keep theirs in a pool (tests/test_vllm_pool.py). A stand-in server (tests/fake_vllm.py)
plays vLLM here; tests/test_vllm_server.py runs the real one."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from conftest import gone

from mtp_viz.serving import server as srv
from mtp_viz.serving.server import ServerConfig, ServerError, VLLMServer


def config(tmp_path, **kw) -> ServerConfig:
    return ServerConfig(model_dir=str(tmp_path), served_name="tiny", **kw)


def port_free(url: str) -> bool:
    port = int(url.rsplit(":", 1)[1])
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_started_server_answers_and_is_stopped_with_its_children(fake_vllm, tmp_path):
    with VLLMServer.start(config(tmp_path)) as server:
        pids = json.loads(fake_vllm.read_text())
        assert server.version == "fake" and server.alive
        assert all(psutil.pid_exists(p) for p in pids)
        url, log = server.url, server.log
        assert log.is_file()
    assert gone(pids), "the server or its engine process outlived the with block"
    assert port_free(url)
    assert not log.parent.exists(), "a cleanly stopped server's log folder was left behind"


def test_an_error_inside_the_block_still_stops_the_server(fake_vllm, tmp_path):
    with pytest.raises(KeyboardInterrupt), VLLMServer.start(config(tmp_path)):
        pids = json.loads(fake_vllm.read_text())
        raise KeyboardInterrupt  # what Ctrl-C raises
    assert gone(pids)


def test_a_server_that_dies_at_start_is_one_clear_error(fake_vllm, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_MODE", "die")
    with pytest.raises(ServerError, match="exited with status 1: ValueError: the model directory holds no config") as e:
        VLLMServer.start(config(tmp_path))
    assert Path(str(e.value).rsplit("(log: ", 1)[1].rstrip(")")).is_file()  # kept: the error names it
    assert gone(json.loads(fake_vllm.read_text()))  # its engine child too
    assert not srv._RUNNING


def test_a_server_that_never_gets_ready_times_out_and_is_stopped(fake_vllm, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_MODE", "hang")
    with pytest.raises(ServerError, match="not ready after 3 s"):
        VLLMServer.start(config(tmp_path), timeout_s=3)
    assert gone(json.loads(fake_vllm.read_text()))


def test_cancel_while_starting_stops_the_server(fake_vllm, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_MODE", "hang")
    with pytest.raises(ServerError, match="stopped while the vLLM server was starting"):
        VLLMServer.start(config(tmp_path), cancelled=fake_vllm.is_file)  # the UI's Stop, once it runs
    assert gone(json.loads(fake_vllm.read_text()))


def test_port_in_use_missing_install_and_bad_model_dir_are_clear_errors(fake_vllm, tmp_path, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ServerError, match=f"port {port} is in use"):
            VLLMServer.start(config(tmp_path, port=port))
    with pytest.raises(ServerError, match="no model directory"):
        VLLMServer.start(ServerConfig(model_dir=str(tmp_path / "missing"), served_name="tiny"))
    monkeypatch.setenv(srv.PYTHON_ENV, str(tmp_path / "no-python"))
    with pytest.raises(ServerError, match="setup.sh --vllm"):
        VLLMServer.start(config(tmp_path))


def test_connecting_to_a_server_of_another_model_is_refused(fake_vllm, tmp_path):
    with VLLMServer.start(config(tmp_path)) as server:
        with pytest.raises(ServerError, match="serves tiny, not other"):
            VLLMServer.connect(server.url, "other")
        assert VLLMServer.connect(server.url, "tiny").served_name == "tiny"
    with pytest.raises(ServerError, match="no vLLM server answers"):
        VLLMServer.connect(server.url, "tiny")


@pytest.mark.parametrize(
    ("sig", "parent_status"), [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGKILL, -signal.SIGKILL)]
)
def test_a_parent_told_to_terminate_or_killed_leaves_no_server(fake_vllm, tmp_path, sig, parent_status):
    """SIGTERM: the parent stops the server on its way out. SIGKILL: the parent runs no code at
    all; the guard the server runs under (mtp_viz.child) sees it gone and stops the server's group."""
    script = textwrap.dedent(
        f"""
        import time
        from mtp_viz.serving.server import ServerConfig, VLLMServer
        with VLLMServer.start(ServerConfig(model_dir={str(tmp_path)!r}, served_name="tiny")):
            print("ready", flush=True)
            time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=os.environ)
    assert parent.stdout.readline().strip() == "ready"
    pids = json.loads(fake_vllm.read_text()) + [g.pid for g in psutil.Process(parent.pid).children()]
    parent.send_signal(sig)
    assert parent.wait(30) == parent_status
    assert gone(pids, timeout=30), f"the server outlived a parent sent {sig.name}"


def test_a_server_killed_by_a_signal_says_which(fake_vllm, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_MODE", "segfault")
    with pytest.raises(ServerError, match="was killed by SIGSEGV \\(segmentation fault\\): "):
        VLLMServer.start(config(tmp_path))
    assert gone(json.loads(fake_vllm.read_text()))


def test_cli_without_vllm_installed_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, use_tiny_registry):
    from mtp_viz.__main__ import main

    monkeypatch.setenv(srv.PYTHON_ENV, str(tmp_path / "no-python"))
    code = main(["run", "--backend", "vllm", "--model", "tiny", "--strategy", "prompt_lookup", "--prompt", "hi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: vLLM is not installed")


def test_strategies_vllm_cannot_run_say_why(use_tiny_registry, capsys):
    from mtp_viz.__main__ import main

    code = main(["run", "--backend", "vllm", "--model", "tiny", "--strategy", "conf_adapt", "--prompt", "hi"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "cannot run on vLLM: unverified (lossy)" in err


@pytest.fixture
def shared_pool():
    """The process's pool of kept servers, emptied after the test."""
    from mtp_viz.serving import pool

    pool.shutdown()
    yield pool
    pool.shutdown()


def test_the_ui_stream_on_vllm_reports_progress_then_a_trace_and_keeps_the_server(
    fake_vllm, use_tiny_registry, monkeypatch, shared_pool
):
    from mtp_viz.ui import jobs
    from mtp_viz.ui.requests import build_request
    from mtp_viz.ui.streaming import stream_vllm

    monkeypatch.setattr(jobs, "STREAM_INTERVAL_S", 0.01)
    request = build_request("the cat", "tiny", "autoregressive", max_new_tokens=3)
    *progress, (_, trace) = list(stream_vllm(request))
    assert progress and all(trace_so_far is None and message for message, trace_so_far in progress)
    assert trace.output_token_ids == [5, 6, 7] and trace.machine["engine"] == "vllm"
    assert [len(s.emitted) for s in trace.steps] == [1, 1, 1] and trace.summary["draft_time_s"] is None
    pids = json.loads(fake_vllm.read_text())
    assert not gone(pids, timeout=0.5), "the server should be kept for the next run"
    shared_pool.shutdown()
    assert gone(pids)


def test_stop_in_the_ui_while_vllm_starts_stops_the_server(fake_vllm, use_tiny_registry, monkeypatch, shared_pool):
    from mtp_viz.ui import jobs
    from mtp_viz.ui.requests import build_request
    from mtp_viz.ui.streaming import stream_vllm

    monkeypatch.setattr(jobs, "STREAM_INTERVAL_S", 0.01)
    monkeypatch.setenv("FAKE_VLLM_MODE", "hang")
    updates = stream_vllm(build_request("the cat", "tiny", "autoregressive", max_new_tokens=3))
    message, _ = next(updates)
    while not fake_vllm.is_file():
        message, _ = next(updates)
    updates.close()  # what Gradio does on Stop
    assert "vLLM" in message and gone(json.loads(fake_vllm.read_text()))
    assert not shared_pool.shared().servers(), "a server stopped while starting is not kept"


def test_a_server_that_dies_mid_sweep_keeps_the_results_so_far(fake_vllm, use_tiny_registry, monkeypatch, tmp_path):
    from mtp_viz.prompts import BenchPrompt
    from mtp_viz.runner import RunRequest
    from mtp_viz.serving.sweep import read_sweep, sweep
    from mtp_viz.strategies.base import GenerationSettings

    monkeypatch.setenv("FAKE_VLLM_DIE_AFTER", "4")  # two warm-up requests, the first level's one, one more
    prompts = [BenchPrompt("1", "writing", "the cat")]
    base = RunRequest(model="tiny", generation=GenerationSettings(max_new_tokens=3))
    with pytest.raises(ServerError, match="results so far in"):
        sweep(prompts, ["autoregressive"], [1, 2], base, tmp_path / "out")
    table, meta = read_sweep(tmp_path / "out")
    assert table["concurrency"].tolist() == [1] and table["tokens_per_s"].iloc[0] > 0
    assert meta["errors"] and meta["errors"][0].startswith("autoregressive")
    assert gone(json.loads(fake_vllm.read_text()))  # the dead server's engine child too
