"""The real vLLM server behind the Explore tab: two runs with the same settings through the UI's
path, one server start; the second answers its first token in under 5 s (the figures are printed:
run with -s to see them). The server is gone afterwards.

Needs .venv-vllm (`bash scripts/setup.sh --vllm`); skipped without it except in CI."""

import socket
import time

import psutil
import pytest
from conftest import running
from optional import require

from mtp_viz.serving import pool
from mtp_viz.serving.server import VLLM_VENV

pytestmark = pytest.mark.slow

SECOND_RUN_FIRST_TOKEN_S = 5.0  # the goal: a second Explore run answers in seconds, not a start's minutes
PROMPT = "Repeat this list exactly, twice: apples, bananas, cherries, dates, elderberries."


def test_a_second_explore_run_on_vllm_answers_its_first_token_within_5_s():
    require((VLLM_VENV / "bin" / "python").is_file(), "vLLM (.venv-vllm)", "bash scripts/setup.sh --vllm")
    from mtp_viz.ui.requests import build_request
    from mtp_viz.ui.streaming import stream_vllm

    request = build_request(PROMPT, "smollm2-135m", "prompt_lookup", max_new_tokens=48)
    pool.shutdown()
    runs = []
    try:
        for _ in range(2):
            began = time.perf_counter()
            *_, (_, trace) = list(stream_vllm(request))
            runs.append((trace.machine["run_ttft_s"], time.perf_counter() - began, trace.machine["server_reused"]))
        (server,) = pool.shared().servers()
        pids = [server.process.pid] + [c.pid for c in psutil.Process(server.process.pid).children(recursive=True)]
        url = server.url
    finally:
        pool.shutdown()
    for i, (first_token, whole, reused) in enumerate(runs, 1):
        print(f"Explore run {i} on vLLM: first token {first_token:.2f} s, whole run {whole:.2f} s, reused={reused}")
    (first, _, reused_first), (second, _, reused_second) = runs
    assert not reused_first and reused_second, "the second run should reuse the first run's server"
    assert second < SECOND_RUN_FIRST_TOKEN_S, f"the second run's first token came after {second:.1f} s"
    assert not any(running(p) for p in pids), "a vLLM process outlived the pool"
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", int(url.rsplit(":", 1)[1]))) != 0, "the server's port is still taken"
