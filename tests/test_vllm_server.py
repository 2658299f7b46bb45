"""The real vLLM server on the embedded model with n-gram drafting, started by our code, once for
every test that only reads it: two Explore runs with the same settings through the UI's path start
it in the process's pool and reuse it (the second answers its first token in under 5 s); then two
prompts at concurrency 2 become valid traces whose counts match the responses and vLLM's own
/metrics counters, our prompt lookup writes the same text, the CLI and the bench use it, and the
server is gone afterwards. (`eagle` served as vLLM's EAGLE-3: tests/test_vllm_eagle3.py.)

Needs .venv-vllm (`bash scripts/setup.sh --vllm`, which .ci/run does); skipped without it except
in CI, where a missing install is a failure."""

import socket
import time

import psutil
import pytest
from conftest import running
from optional import require

from mtp_viz.runner import RunRequest, run
from mtp_viz.serving import pool
from mtp_viz.serving.backend import plan, prompt_ids
from mtp_viz.serving.client import ACCEPTED, DRAFTED, PER_POSITION_COUNTER, STEPS
from mtp_viz.serving.engines import after_prefill
from mtp_viz.serving.levels import measure_level
from mtp_viz.serving.server import VLLM_VENV, VLLMServer
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.trace import Trace, depth_counts

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
PROMPTS = [
    "Repeat this list exactly, twice: apples, bananas, cherries, dates, elderberries.",
    "Rename the variable total to sum in this code:\ntotal = 0\nfor x in items:\n    total += x\nprint(total)",
]
SETTINGS = {"num_draft_tokens": 3, "max_ngram_size": 3, "min_ngram_size": 2}
REQUEST = RunRequest(
    model=MODEL,
    strategy="prompt_lookup",
    strategy_settings=SETTINGS,
    generation=GenerationSettings(max_new_tokens=48),
)
SECOND_RUN_FIRST_TOKEN_S = 5.0  # the goal: a second Explore run answers in seconds, not a start's minutes


def processes(server: VLLMServer) -> list[psutil.Process]:
    """The server's process and every process under it (its engine and workers)."""
    top = psutil.Process(server.process.pid)
    return [top, *top.children(recursive=True)]


def assert_gone(processes: list[psutil.Process], url: str) -> None:
    assert not any(running(p) for p in processes), "a vLLM process outlived its server"
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", int(url.rsplit(":", 1)[1]))) != 0, "the server's port is still taken"


def explore_run(request: RunRequest) -> tuple[float, float, bool]:
    """One Explore run on vLLM through the UI's path: (first token, whole run in s, server reused)."""
    from mtp_viz.ui.streaming import stream_vllm

    began = time.perf_counter()
    *_, (_, trace) = list(stream_vllm(request))
    return trace.machine["run_ttft_s"], time.perf_counter() - began, trace.machine["server_reused"]


@pytest.fixture(scope="module")
def explored():
    """The server the tests here read: started by two Explore runs of PROMPTS[0] with REQUEST's
    settings through the UI's path (the first starts it in the process's pool, the second reuses
    it), then leased for the module, so that the pool neither stops it when idle nor hands it to
    another run. Yields (the two runs, REQUEST's plan, the server); afterwards the pool is shut
    down and no process of the server, nor its port, is left."""
    require((VLLM_VENV / "bin" / "python").is_file(), "vLLM (.venv-vllm)", "bash scripts/setup.sh --vllm")
    from mtp_viz.ui.requests import build_request

    request = build_request(PROMPTS[0], MODEL, "prompt_lookup", settings=SETTINGS, max_new_tokens=48)
    p = plan(REQUEST)
    assert plan(request).server.key == p.server.key  # the Explore runs start the server REQUEST asks for
    pool.shutdown()
    try:
        runs = [explore_run(request) for _ in range(2)]
        with pool.shared().lease(p.server) as lease:
            assert lease.reused
            server, kept = lease.server, processes(lease.server)
            yield runs, p, server
    finally:
        pool.shutdown()
    assert_gone(kept, server.url)


@pytest.fixture(scope="module")
def served(explored):
    _, p, server = explored
    return p, server


@pytest.fixture(scope="module")
def level(served):
    p, server = served
    ids = [prompt_ids(p, text) for text in PROMPTS]
    point, order = measure_level(server, p, "prompt_lookup", ids, 2, PROMPTS)
    return p, server, point, order


def test_a_second_explore_run_on_vllm_answers_its_first_token_within_5_s(explored):
    """Two Explore runs with the same settings, one server start; the figures are printed (run
    with -s to see them)."""
    runs, _, _ = explored
    for i, (first_token, whole, reused) in enumerate(runs, 1):
        print(f"Explore run {i} on vLLM: first token {first_token:.2f} s, whole run {whole:.2f} s, reused={reused}")
    (_, _, reused_first), (second, _, reused_second) = runs
    assert not reused_first and reused_second, "the second run should reuse the first run's server"
    assert second < SECOND_RUN_FIRST_TOKEN_S, f"the second run's first token came after {second:.1f} s"


def test_traces_validate_and_match_the_responses(level):
    _, _, point, order = level
    assert order == [0, 1, 0, 1] and len(point.traces) == 4  # two rounds per client
    for trace, completion in zip(point.traces, point.completions, strict=True):
        again = Trace.from_json(trace.to_json())  # validates
        assert again.output_token_ids == completion.token_ids
        assert len(completion.token_ids) == completion.usage["completion_tokens"]
        assert trace.machine["engine"] == "vllm" and trace.machine["steps_placed_by"] == "ngram replay, checked"
        spec = completion.spec
        steps = [s for s in trace.steps if s.drafted]
        assert [len(s.drafted) for s in steps] == spec["per_step_drafted"]
        assert [s.accepted for s in steps] == spec["per_step_accepted"]
        assert all(s.step_s is None and s.draft_s is None for s in trace.steps)  # not reported: absent, not zero
    assert sum(t.summary["drafted_tokens"] for t in point.traces) > 0, "the prompts should make n-gram drafts"


def test_metrics_counter_deltas_equal_the_per_request_sums(level):
    _, _, point, _ = level
    counters = point.counters  # /metrics growth over the level, read by measure_level
    assert counters[DRAFTED] == sum(c.spec["num_draft_tokens"] for c in point.completions)
    assert counters[ACCEPTED] == sum(c.spec["num_accepted_draft_tokens"] for c in point.completions)
    assert counters[STEPS] == sum(c.spec["num_spec_steps"] for c in point.completions)
    assert counters[DRAFTED] == sum(t.summary["drafted_tokens"] for t in point.traces)
    judged, kept = depth_counts([s for t in point.traces for s in t.steps])
    for position, n in enumerate(kept):  # accepted at depth d+1 = vLLM's per-position counter d
        assert counters.get(f"{PER_POSITION_COUNTER}:{position}", 0) == n


def test_our_prompt_lookup_writes_the_same_text(level):
    _, _, point, order = level
    for trace, i in zip(point.traces[:2], order[:2], strict=True):  # each prompt once
        ours = run(RunRequest(**{**REQUEST.__dict__, "prompt": PROMPTS[i]}))
        assert ours.output_text == trace.output_text
        # the two count tokens per forward alike once vLLM's draft-free prefill is set aside
        assert after_prefill(ours) == pytest.approx(after_prefill(trace), abs=0.35)


def test_cli_run_against_the_running_server_writes_a_trace(served, tmp_path, capsys):
    from mtp_viz.__main__ import main

    _, server = served
    out = tmp_path / "t.json"
    argv = ["run", "--backend", "vllm", "--vllm-url", server.url, "--strategy", "prompt_lookup"]
    argv += ["--prompt", PROMPTS[0], "--max-new-tokens", "24", "--trace-out", str(out)]
    assert main(argv) == 0
    trace = Trace.load(out)
    assert trace.machine["engine"] == "vllm" and trace.machine["server_args"] is None  # a server it did not start
    assert "vLLM" in capsys.readouterr().out


def test_vllm_is_a_peer_in_our_benchmark(served, monkeypatch):
    """`bench --peers vllm_prompt_lookup`: vLLM answers the same prompts interleaved with our runs,
    and its rows sit in the table as a peer (its greedy output identical to our autoregressive)."""
    from mtp_viz.bench import results_table, run_bench
    from mtp_viz.prompts import BenchPrompt
    from mtp_viz.serving import peers

    _, server = served
    monkeypatch.setattr(peers, "open_server", lambda p, progress=None: VLLMServer.connect(server.url, p.target.name))
    prompts = [BenchPrompt("1", "writing", PROMPTS[0])]
    base = RunRequest(model=MODEL, generation=GenerationSettings(max_new_tokens=24))
    traces, peer_runs = run_bench(
        prompts,
        ["prompt_lookup"],
        base,
        lambda s: dict(SETTINGS) if s == "prompt_lookup" else {},
        peers=["vllm_prompt_lookup"],
    )
    table = results_table(prompts, traces, peer_runs).set_index("strategy")
    row = table.loc["vllm_prompt_lookup"]
    assert row["identical"] and row["new_tokens"] == len(traces["autoregressive"][0].output_token_ids)
