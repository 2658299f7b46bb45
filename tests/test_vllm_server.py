"""The real vLLM server on the embedded model with n-gram drafting, started by our code: two
prompts at concurrency 2 become valid traces whose counts match the responses and vLLM's own
/metrics counters, our prompt lookup writes the same text, and the server is gone afterwards.
And `eagle` served as vLLM's EAGLE-3 with a random checkpoint we write: the output is vLLM's plain
greedy output, and its drafts and acceptances come back in the traces.

Needs .venv-vllm (`bash scripts/setup.sh --vllm`, which .ci/run does); skipped without it except
in CI, where a missing install is a failure."""

import json
import socket
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from conftest import running
from optional import require

from mtp_viz.drafters.eagle3 import Eagle3Config, Eagle3Drafter, save_eagle3
from mtp_viz.runner import RunRequest, run
from mtp_viz.serving.backend import open_server, plan, prompt_ids, request_body, to_trace
from mtp_viz.serving.client import ACCEPTED, DRAFTED, PER_POSITION_COUNTER, STEPS, complete
from mtp_viz.serving.engines import after_prefill
from mtp_viz.serving.export import model_dir
from mtp_viz.serving.levels import measure_level
from mtp_viz.serving.server import VLLM_VENV, VLLMServer
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.trace import Trace, depth_counts

pytestmark = pytest.mark.slow

PROMPTS = [
    "Repeat this list exactly, twice: apples, bananas, cherries, dates, elderberries.",
    "Rename the variable total to sum in this code:\ntotal = 0\nfor x in items:\n    total += x\nprint(total)",
]
SETTINGS = {"num_draft_tokens": 3, "max_ngram_size": 3, "min_ngram_size": 2}
REQUEST = RunRequest(
    model="smollm2-135m",
    strategy="prompt_lookup",
    strategy_settings=SETTINGS,
    generation=GenerationSettings(max_new_tokens=48),
)


@pytest.fixture(scope="module")
def served():
    require((VLLM_VENV / "bin" / "python").is_file(), "vLLM (.venv-vllm)", "bash scripts/setup.sh --vllm")
    p = plan(REQUEST)
    with open_server(p) as server:
        pids = [server.process.pid] + [c.pid for c in psutil.Process(server.process.pid).children(recursive=True)]
        yield p, server
        url = server.url
    port = int(url.rsplit(":", 1)[1])
    assert not any(running(pid) for pid in pids), "a vLLM process outlived its server"
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "the server's port is still taken"


@pytest.fixture(scope="module")
def level(served):
    p, server = served
    ids = [prompt_ids(p, text) for text in PROMPTS]
    point, order = measure_level(server, p, "prompt_lookup", ids, 2, PROMPTS)
    return p, server, point, order


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
    base = RunRequest(model="smollm2-135m", generation=GenerationSettings(max_new_tokens=24))
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


def random_eagle3(target_dir: str, draft_vocab: int = 2048) -> Eagle3Drafter:
    """Seeded random EAGLE-3 weights in the target's shapes (SmolLM2-135M: hidden 576, 9 heads,
    3 kv heads), its draft vocabulary every (V / draft_vocab)-th target id, aux layers (2, 15, 27)."""
    c = json.loads((Path(target_dir) / "config.json").read_text())
    heads = c["num_attention_heads"]
    config = Eagle3Config(
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=c["num_key_value_heads"],
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        rms_norm_eps=c["rms_norm_eps"],
        rope_theta=(c.get("rope_parameters") or {}).get("rope_theta") or c.get("rope_theta", 10000.0),
        max_position_embeddings=c["max_position_embeddings"],
        vocab_size=c["vocab_size"],
        draft_vocab_size=draft_vocab,
        aux_layer_ids=(2, 15, 27),
    )
    torch.manual_seed(0)
    drafter = Eagle3Drafter(config)
    targets = torch.arange(draft_vocab) * (c["vocab_size"] // draft_vocab)
    drafter.d2t.copy_(targets - torch.arange(draft_vocab))  # target id = draft id + d2t[draft id]
    drafter.t2d.zero_()[targets] = True
    return drafter


def test_eagle3_on_vllm_writes_vllms_plain_output_and_reports_its_drafts(tmp_path):
    require((VLLM_VENV / "bin" / "python").is_file(), "vLLM (.venv-vllm)", "bash scripts/setup.sh --vllm")
    generation = GenerationSettings(max_new_tokens=24)
    ar = plan(RunRequest(model="smollm2-135m", generation=generation))
    save_eagle3(random_eagle3(model_dir(ar.target)), tmp_path / "eagle3")
    eagle = plan(
        RunRequest(
            model="smollm2-135m",
            strategy="eagle",
            eagle3=str(tmp_path / "eagle3"),
            strategy_settings={"depth": 3},
            generation=generation,
        )
    )
    spec = {"method": "eagle3", "model": str(tmp_path / "eagle3"), "num_speculative_tokens": 3}
    assert eagle.speculative_config == spec
    runs = {}
    for name, p in (("ar", ar), ("eagle", eagle)):
        with open_server(p) as server, httpx.Client() as client:
            done = [complete(client, server.url, request_body(p, prompt_ids(p, text))) for text in PROMPTS]
            runs[name] = [(c, to_trace(p, server, c)) for c in done]
    for (_, plain), (c, trace) in zip(runs["ar"], runs["eagle"], strict=True):
        assert trace.output_token_ids == plain.output_token_ids  # lossless: vLLM's own greedy output
        steps = [s for s in trace.steps if s.drafted]
        assert steps and all(len(s.drafted) == 3 for s in steps)
        assert {d.source for s in steps for d in s.drafted} == {"eagle3"}
        assert [s.accepted for s in steps] == c.spec["per_step_accepted"]  # a random drafter: mostly 0
        assert trace.summary["drafted_tokens"] == c.spec["num_draft_tokens"]
        assert trace.machine["speculative_config"]["method"] == "eagle3" and "chain" in trace.machine["served_note"]
        assert trace.machine["vllm_mean_acceptance_length"] is not None
