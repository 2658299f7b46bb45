"""llama.cpp peers run in processes of their own (mtp_viz.llama_worker): a peer that dies by a
signal or hangs is one line naming the peer and the cause, the benchmark keeps what it measured
and goes on, and no worker outlives us, even when we are killed with SIGKILL. A stand-in worker
(tests/fake_llama_worker.py) plays llama.cpp here; tests/test_llama_peer.py runs the real one."""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import gone

from mtp_viz import bench, llama_peers
from mtp_viz.bench import results_table, run_bench
from mtp_viz.child import exit_reason
from mtp_viz.llama_peers import LLAMA_CPP_AUTOREGRESSIVE, LLAMA_CPP_PROMPT_LOOKUP, PeerFailed, Worker
from mtp_viz.prompts import BenchPrompt
from mtp_viz.runner import RunRequest
from mtp_viz.strategies.base import GenerationSettings

FAKE = Path(__file__).with_name("fake_llama_worker.py")
PROMPTS = [BenchPrompt("1", "writing", "the cat sat"), BenchPrompt("2", "writing", "the dog ran")]


@pytest.fixture
def fake_llama(monkeypatch, tmp_path):
    """llama.cpp peers on the tiny model, each in a stand-in worker; returns its pid file."""
    pids = tmp_path / "pids"
    monkeypatch.setattr(llama_peers, "WORKER", [sys.executable, str(FAKE)])
    monkeypatch.setattr(llama_peers, "unavailable", lambda model: None)
    monkeypatch.setattr(bench, "unavailable", lambda model: None)
    monkeypatch.setattr(llama_peers, "shipped_gguf", lambda model: tmp_path / "model.gguf")
    monkeypatch.setattr(llama_peers, "version", lambda dist: "fake")
    monkeypatch.setenv("FAKE_LLAMA_PIDS", str(pids))
    return pids


def started(pids: Path) -> list[int]:
    return [int(p) for p in pids.read_text().split()]


def test_how_a_child_ended_in_words():
    assert exit_reason(1) == "exited with status 1"
    assert exit_reason(-signal.SIGILL) == "was killed by SIGILL (illegal instruction)"
    assert exit_reason(-signal.SIGSEGV) == "was killed by SIGSEGV (segmentation fault)"


def test_a_peer_killed_by_a_signal_is_one_line_and_the_bench_keeps_what_it_measured(
    fake_llama, use_tiny_registry, monkeypatch, caplog
):
    monkeypatch.setenv("FAKE_LLAMA_MODE", "crash-after:1")  # answers the first prompt, dies on the second
    base = RunRequest(model="tiny", generation=GenerationSettings(max_new_tokens=3))
    peers = [LLAMA_CPP_AUTOREGRESSIVE, LLAMA_CPP_PROMPT_LOOKUP]
    with caplog.at_level(logging.WARNING):
        traces, peer_runs = run_bench(PROMPTS, ["autoregressive"], base, peers=peers)
    said = [r.getMessage() for r in caplog.records if "llama.cpp" in r.getMessage()]
    assert said == [
        f"llama.cpp {name} was killed by SIGILL (illegal instruction) while decoding: "
        f"ggml_backend_amx_mul_mat: about to run tilezero; llama_cpp_{name} left out from here on"
        for name in ("autoregressive", "prompt_lookup")
    ]
    assert [len(r) for r in peer_runs.values()] == [1, 1] and peer_runs[LLAMA_CPP_AUTOREGRESSIVE][0].output_token_ids
    assert len(traces["autoregressive"]) == 2  # our own runs went on
    table = results_table(PROMPTS, traces, peer_runs)
    assert list(table[table.strategy == LLAMA_CPP_AUTOREGRESSIVE].prompt_id) == ["1"]
    assert gone(started(fake_llama))


def test_a_peer_that_hangs_is_stopped_after_its_timeout(fake_llama, use_tiny_registry, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_MODE", "hang-after:0")
    monkeypatch.setattr(llama_peers, "ANSWER_TIMEOUT_S", 1.0)
    monkeypatch.setattr(llama_peers, "SECONDS_PER_TOKEN", 0.0)
    from mtp_viz.loading import load_model

    with llama_peers.LlamaCppPeers([LLAMA_CPP_AUTOREGRESSIVE], load_model("tiny"), 1) as peers:
        with pytest.raises(
            PeerFailed, match="^llama.cpp autoregressive gave no answer in 1 s while decoding, and was stopped$"
        ):
            peers.run(LLAMA_CPP_AUTOREGRESSIVE, [4, 5], 3)
        assert peers.machine()["cpu_features"] == "AVX AMX_INT8"
    assert gone(started(fake_llama), timeout=2)


def test_a_worker_that_dies_while_starting_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(
        llama_peers,
        "WORKER",
        [sys.executable, "-c", "import sys; print('llama_model_load: bad magic', file=sys.stderr); sys.exit(3)"],
    )
    with pytest.raises(
        PeerFailed, match="^llama.cpp ar exited with status 3 while starting: llama_model_load: bad magic$"
    ):
        Worker("llama.cpp ar", {"n_ctx": 64})


def test_a_worker_ends_when_its_parent_is_killed_with_sigkill(tmp_path):
    """The parent is mid-request (the worker busy, deaf to its input) when it is killed."""
    pids = tmp_path / "pids"
    parent = textwrap.dedent(
        f"""
        import subprocess, sys, time
        pipe = subprocess.PIPE
        worker = subprocess.Popen([sys.executable, {str(FAKE)!r}], stdin=pipe, stdout=pipe, text=True)
        worker.stdout.readline()
        worker.stdin.write('{{"max_new_tokens": 3}}\\n'); worker.stdin.flush()
        print("asked", flush=True)
        time.sleep(600)
        """
    )
    env = {**os.environ, "FAKE_LLAMA_MODE": "hang-after:0", "FAKE_LLAMA_PIDS": str(pids)}
    process = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True, env=env)
    assert process.stdout.readline().strip() == "asked"
    process.kill()
    process.wait()
    assert gone(started(pids), timeout=10), "the worker outlived its parent"


def test_the_peer_processes_are_stopped_at_the_end_of_the_block(fake_llama, use_tiny_registry):
    from mtp_viz.loading import load_model

    with llama_peers.LlamaCppPeers([LLAMA_CPP_AUTOREGRESSIVE, LLAMA_CPP_PROMPT_LOOKUP], load_model("tiny"), 1) as peers:
        for name in peers.names:
            assert peers.run(name, [4, 5], 2).output_token_ids == [5, 6]
        assert len(started(fake_llama)) == 2
    assert gone(started(fake_llama), timeout=2)
    assert json.loads(json.dumps(peers.machine()))["threads"] == 1
