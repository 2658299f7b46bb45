"""`profile --backend vllm` and `bench --backend vllm --schedule` end to end against the stand-in
server (tests/fake_vllm.py): what is asked of vLLM, what is written, and that every server stops."""

import json

import pandas as pd
from conftest import gone
from fake_vllm import HASHED

from mtp_viz.__main__ import main
from mtp_viz.profile import read_profile
from mtp_viz.serving.engine_profile import DRAFTS
from mtp_viz.serving.sweep import read_sweep, trace_folder
from mtp_viz.trace import Trace


def test_profile_on_vllm_writes_the_engines_step_costs_in_the_profile_format(fake_vllm, use_tiny_registry, tmp_path):
    out = tmp_path / "profile.json"
    assert main(["profile", "--backend", "vllm", "--model", "tiny", "--batch-sizes", "1,2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["engine"] == "vllm" and data["machine"]["engine"] == "vllm" and data["machine"]["vllm"] == "fake"
    forced = data["machine"]["forced_drafts"]
    assert forced["method"] == "custom_class" and forced["num_speculative_tokens"] == max(DRAFTS)
    assert sorted(map(int, data["batch_cost"])) == [1, 2]
    assert sorted(map(int, data["batch_cost"]["1"])) == [d + 1 for d in DRAFTS]
    assert all(v["1"] == 1.0 for v in data["batch_cost"].values()) and set(data["step_fit"]) >= {"fixed_s"}
    view = read_profile(out)
    assert view.engine == "vllm" and view.label.endswith(", vLLM fake steps")
    assert view.batch_cost[2][8] > 0 and view.one_token_s[1] > 0 and sorted(view.curve) == list(range(1, 9))
    assert gone(json.loads(fake_vllm.read_text()))


def test_bench_serves_a_schedule_beside_the_fixed_length_and_plain_decoding(
    fake_vllm, use_tiny_registry, tmp_path, monkeypatch
):
    """The scheduled server is asked what plain decoding was asked: the stand-in answers each prompt
    differently (a hash of the request), so an answer to another request is not identical."""
    monkeypatch.setenv("FAKE_VLLM_TOKENS", HASHED)
    out = tmp_path / "sweep"
    args = ["bench", "--backend", "vllm", "--model", "tiny", "--strategies", "prompt_lookup", "--limit", "2"]
    args += ["--categories", "writing", "--max-new-tokens", "3", "--concurrency", "1,2", "--no-compare-ours"]
    assert main([*args, "--schedule", "1-1:2,2-32:0", "--out", str(out)]) == 0
    table, meta = read_sweep(out)
    label = "prompt_lookup:per_batch=1-1:2,2-32:0"
    assert list(dict.fromkeys(table["strategy"])) == ["autoregressive", "prompt_lookup", label]
    assert meta["schedules"][label] == {
        "from": "prompt_lookup",
        "num_speculative_tokens_per_batch_size": [[1, 1, 2], [2, 32, 0]],
        "crossover": 2,
        "served": True,
    }
    config = json.loads(
        meta["servers"][label]["args"][meta["servers"][label]["args"].index("--speculative-config") + 1]
    )
    assert config["num_speculative_tokens"] == 2 and config["method"] == "ngram"
    assert config["num_speculative_tokens_per_batch_size"] == [[1, 1, 2], [2, 32, 0]]
    plain = [Trace.load(t).output_token_ids for t in sorted(trace_folder(out, "autoregressive", 1).iterdir())]
    assert len(plain) == 2 and plain[0] != plain[1]  # two prompts, two answers: identity can fail
    assert (table.loc[table["strategy"] == label, "identical_to_ar"] == 1.0).all()
    assert gone(json.loads(fake_vllm.read_text()))


def test_a_schedule_that_never_drafts_is_not_served_and_auto_needs_a_profile(
    fake_vllm, use_tiny_registry, tmp_path, capsys
):
    args = ["bench", "--backend", "vllm", "--model", "tiny", "--strategies", "prompt_lookup", "--limit", "1"]
    args += ["--categories", "writing", "--max-new-tokens", "3", "--concurrency", "1", "--no-compare-ours"]
    assert main([*args, "--schedule", "auto", "--out", str(tmp_path / "a")]) == 2
    assert "--schedule auto needs --profile" in capsys.readouterr().err
    assert main([*args, "--schedule", "1-32:0", "--out", str(tmp_path / "b")]) == 0
    table, meta = read_sweep(tmp_path / "b")
    assert meta["schedules"]["prompt_lookup:per_batch=1-32:0"]["served"] is False
    assert set(table["strategy"]) == {"autoregressive", "prompt_lookup"} and isinstance(table, pd.DataFrame)
