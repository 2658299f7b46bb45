"""Trace invariants, derived summaries and the JSON round trip, for every strategy."""

import json

import pytest
from conftest import decode, perturbed, tiny_model

from mtp_viz import clock
from mtp_viz.cache import CachedModel
from mtp_viz.errors import InvalidTraceError
from mtp_viz.runner import Run, RunRequest, run
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.trace import ORIGINS, SCHEMA_VERSION, Trace, summarize

REQUIRED_TOP = {
    "schema_version",
    "strategy",
    "model",
    "draft_model",
    "settings",
    "prompt_token_ids",
    "output_token_ids",
    "output_text",
    "steps",
    "summary",
}
REQUIRED_STEP = {
    "drafted",
    "verdicts",
    "target_p",
    "emitted",
    "draft_s",
    "verify_s",
    "target_forwards",
    "draft_forwards",
}
REQUIRED_SUMMARY = {
    "new_tokens",
    "wall_time_s",
    "tokens_per_s",
    "target_forwards",
    "drafted_tokens",
    "accepted_tokens",
    "acceptance_rate",
    "mean_accepted_tokens",
    "per_position_acceptance",
}

STRATEGY_RUNS = [
    ("autoregressive", {}, GenerationSettings(max_new_tokens=24)),
    ("speculative", {"num_draft_tokens": 4}, GenerationSettings(max_new_tokens=24)),
    ("speculative", {"num_draft_tokens": 3}, GenerationSettings(max_new_tokens=24, temperature=0.9, seed=4)),
    ("prompt_lookup", {"num_draft_tokens": 5}, GenerationSettings(max_new_tokens=24)),
    ("prompt_lookup", {}, GenerationSettings(max_new_tokens=24, temperature=1.2, top_k=20, seed=1)),
]


@pytest.fixture(scope="module")
def traces(tiny_registry):
    import os

    os.environ["MTP_VIZ_MODELS"] = str(tiny_registry)
    try:
        return [
            run(
                RunRequest(
                    prompt="the cat sat on the mat and the cat",
                    model="tiny",
                    strategy=s,
                    generation=g,
                    strategy_settings=kw,
                )
            )
            for s, kw, g in STRATEGY_RUNS
        ]
    finally:
        del os.environ["MTP_VIZ_MODELS"]


def test_field_names_outside_tools_rely_on(traces):
    for trace in traces:
        d = json.loads(trace.to_json())
        assert set(d) >= REQUIRED_TOP and d["schema_version"] == SCHEMA_VERSION
        assert set(d["summary"]) >= REQUIRED_SUMMARY
        for step in d["steps"]:
            assert set(step) >= REQUIRED_STEP
            assert all({"token_id", "text", "source", "q"} <= set(t) for t in step["drafted"])
            assert all({"token_id", "text", "origin"} <= set(t) and t["origin"] in ORIGINS for t in step["emitted"])


def test_emitted_tokens_concatenate_to_the_output(traces, tiny_registry):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_registry.parent / "target")
    for trace in traces:
        trace.check()
        assert [t.token_id for s in trace.steps for t in s.emitted] == trace.output_token_ids
        assert trace.output_text == tok.decode(trace.output_token_ids)
        # Each token's text is what it adds to the decoded text after the prompt.
        prompt_text = tok.decode(trace.prompt_token_ids)
        added = tok.decode(trace.prompt_token_ids + trace.output_token_ids)[len(prompt_text) :]
        assert "".join(t.text for s in trace.steps for t in s.emitted) == added


def test_summary_agrees_with_the_steps(traces):
    for trace in traces:
        s = trace.summary
        assert s["new_tokens"] == len(trace.output_token_ids)
        assert s["target_forwards"] == len(trace.steps)  # one target forward per step, prefill included
        assert s["drafted_tokens"] == sum(len(st.drafted) for st in trace.steps)
        accepted_emitted = sum(t.origin == "accepted" for st in trace.steps for t in st.emitted)
        assert s["accepted_tokens"] == accepted_emitted
        if trace.strategy == "autoregressive":
            assert s["mean_accepted_tokens"] == 1.0 and s["drafted_tokens"] == 0
        assert s["tokens_per_s"] == pytest.approx(s["new_tokens"] / s["wall_time_s"])


def test_json_round_trip_is_lossless(traces):
    for trace in traces:
        again = Trace.from_json(trace.to_json())
        assert again == trace
        assert again.to_json() == trace.to_json()


def test_per_position_acceptance_definition():
    model = tiny_model("llama-2l", seed=0)
    _, steps = decode(
        model,
        "speculative",
        [5, 6, 7, 5, 6],
        GenerationSettings(max_new_tokens=30),
        draft=perturbed(model, 0.2),
        num_draft_tokens=4,
    )
    s = summarize(steps, 1.0)
    for i, rate in enumerate(s["per_position_acceptance"]):
        judged = [st for st in steps if len(st.drafted) > i]
        assert rate == sum(st.verdicts[i] == "accepted" for st in judged) / len(judged)
    assert s["acceptance_rate"] == s["accepted_tokens"] / s["drafted_tokens"]


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda d: d.update(schema_version=99), "schema_version"),
        (lambda d: d.pop("steps"), "malformed"),
        (lambda d: d["steps"][0]["emitted"].append({"token_id": 1, "origin": "autoregressive"}), "output_token_ids"),
        (lambda d: d["steps"][0]["emitted"][0].update(origin="magic"), "origin"),
        (lambda d: d["steps"][1].update(verdicts=["accepted"] * 99), "length"),
        (lambda d: d["summary"].update(wall_time_s="soon"), "malformed"),
        (lambda d: d["steps"][0]["emitted"][0].update(surprise=1), "malformed"),
    ],
)
def test_invalid_traces_are_refused_with_a_reason(traces, mutate, message):
    d = json.loads(traces[1].to_json())
    mutate(d)
    with pytest.raises(InvalidTraceError, match=message):
        Trace.from_dict(d)


@pytest.mark.parametrize("text", ["", "{", "[1, 2]", "null", '{"schema_version": 1}'])
def test_garbage_json_is_refused(text):
    with pytest.raises(InvalidTraceError):
        Trace.from_json(text)


def test_minimal_recording_keeps_ids_and_drops_texts(use_tiny_registry):
    full = run(RunRequest(prompt="the cat sat", model="tiny", strategy="speculative"))
    minimal = run(RunRequest(prompt="the cat sat", model="tiny", strategy="speculative", record="minimal"))
    assert minimal.output_token_ids == full.output_token_ids
    assert all(t.text == "" and t.p is None for s in minimal.steps for t in s.emitted)


@pytest.mark.parametrize("strategy,settings,generation", STRATEGY_RUNS)
def test_wall_time_is_the_steps_time_on_a_clock_that_moves_only_in_forwards(
    use_tiny_registry, monkeypatch, strategy, settings, generation
):
    """On a scripted clock that moves one second per model forward (target or draft) and never
    otherwise: every forward falls inside a step, so each step's time is its forwards, the run's
    wall time is the sum of its steps' and tokens/s is new tokens over that."""
    now = [1000.0]
    monkeypatch.setattr(clock.time, "perf_counter", lambda: now[0])

    def ticking(forward):
        def one_second_later(self, *args, **kwargs):
            now[0] += 1.0
            return forward(self, *args, **kwargs)

        return one_second_later

    for name in ("forward", "forward_hidden", "forward_branches"):
        monkeypatch.setattr(CachedModel, name, ticking(getattr(CachedModel, name)))
    request = RunRequest(
        prompt="the cat sat on the mat and the cat",
        model="tiny",
        strategy=strategy,
        generation=generation,
        strategy_settings=settings,
    )
    trace = run(request)
    forwards = [float(st.target_forwards + st.draft_forwards) for st in trace.steps]
    assert [st.step_s for st in trace.steps] == forwards
    assert trace.wall_time_s == sum(forwards) > 0
    s = trace.summary
    assert s["tokens_per_s"] == s["new_tokens"] / sum(forwards)


def test_wall_time_excludes_time_the_consumer_holds_the_stream(use_tiny_registry, monkeypatch):
    """On a scripted clock that moves only while the consumer holds each step (100 s a step),
    the run's wall time is its decoding time, not the consumer's."""
    now = [1000.0]
    monkeypatch.setattr(clock.time, "perf_counter", lambda: now[0])
    r = Run(RunRequest(prompt="the cat sat", model="tiny", generation=GenerationSettings(max_new_tokens=4)))
    for _ in r.steps():
        now[0] += 100.0
    assert len(r.trace.steps) >= 2
    assert r.trace.wall_time_s == sum(s.step_s for s in r.trace.steps) == 0.0
