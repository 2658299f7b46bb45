"""vLLM responses recorded from a real server (tests/data/vllm, made by record.py there) become
traces: token ids, per-step drafted/accepted counts, origins, what vLLM does not report left null;
/metrics text parsed into the counters the load bench cross-checks; views say what is missing."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from mtp_viz.serving.client import ACCEPTED, DRAFTED, PER_POSITION_COUNTER, STEPS, parse_counters, parse_stream
from mtp_viz.serving.traces import Served, StepMismatch, trace_from_completion
from mtp_viz.trace import BONUS, RESAMPLED, VERDICT_ACCEPTED, VERDICT_REJECTED, Trace, depth_counts

DATA = Path(__file__).parent / "data" / "vllm"
EOS = frozenset({2})  # SmolLM2-Instruct's <|im_end|>
VLLM_DRAFTS = DATA / "prompt_lookup-ngram-drafts.json"  # vLLM's own n-gram proposals along the recorded output


def recorded(strategy: str):
    lines = (DATA / f"{strategy}-greedy.sse").read_text().splitlines()
    request = json.loads((DATA / f"{strategy}-request.json").read_text())
    args = request["server_args"]
    spec = json.loads(args[args.index("--speculative-config") + 1]) if "--speculative-config" in args else None
    completion = parse_stream([(line, 1.0 + 0.01 * i) for i, line in enumerate(lines)], 1.0, 2.0)
    served = Served(strategy, "smollm2-135m", None, (spec or {}).get("method"), spec, {}, EOS, {"engine": "vllm"})
    return completion, served, request


@pytest.mark.parametrize("strategy", ["autoregressive", "prompt_lookup", "speculative"])
def test_recorded_response_becomes_a_valid_trace(strategy):
    c, served, request = recorded(strategy)
    trace = trace_from_completion(c, served)
    again = Trace.from_json(trace.to_json())  # validates, survives JSON
    assert again.output_token_ids == c.token_ids and len(c.token_ids) == c.usage["completion_tokens"]
    assert c.prompt_token_ids == request["body"]["prompt"]
    assert sum(c.chunk_tokens) == len(c.token_ids)
    assert trace.steps[0].drafted == [] and trace.steps[0].input_tokens == len(c.prompt_token_ids)  # the prefill
    assert all(s.step_s is None and s.verify_s is None and s.draft_s is None for s in again.steps)
    assert again.summary["draft_time_s"] is None
    if c.spec is None:  # autoregressive: one token a forward
        assert strategy == "autoregressive" and trace.summary["target_forwards"] == len(c.token_ids)
        return
    spec_steps = [s for s in trace.steps if s.drafted]
    assert [len(s.drafted) for s in spec_steps] == c.spec["per_step_drafted"]
    assert [s.accepted for s in spec_steps] == c.spec["per_step_accepted"]
    assert trace.summary["drafted_tokens"] == c.spec["num_draft_tokens"]
    assert trace.summary["accepted_tokens"] == c.spec["num_accepted_draft_tokens"]
    for s in spec_steps:  # after the accepted drafts: the target's own token, bonus or resampled
        finisher = s.emitted[-1] if len(s.emitted) > s.accepted else None
        if finisher is not None:
            assert finisher.origin == (BONUS if s.accepted == len(s.drafted) else RESAMPLED)
        assert s.verdicts.count(VERDICT_REJECTED) == (s.accepted < len(s.drafted))


def test_ngram_steps_carry_the_replayed_draft_ids():
    c, served, _ = recorded("prompt_lookup")
    trace = trace_from_completion(c, served)
    assert all(d.token_id is not None for s in trace.steps for d in s.drafted)
    assert any(s.verdicts and VERDICT_ACCEPTED in s.verdicts for s in trace.steps)


def test_draft_model_rejected_ids_are_absent_not_invented():
    c, served, _ = recorded("speculative")
    trace = trace_from_completion(c, served)
    rejected = [d for s in trace.steps for d, v in zip(s.drafted, s.verdicts, strict=True) if v != VERDICT_ACCEPTED]
    accepted = [d for s in trace.steps for d, v in zip(s.drafted, s.verdicts, strict=True) if v == VERDICT_ACCEPTED]
    assert rejected and all(d.token_id is None for d in rejected)
    assert all(d.token_id is not None for d in accepted)


def test_counts_that_do_not_fit_the_output_are_refused():
    c, served, _ = recorded("prompt_lookup")
    spec = dict(c.spec)
    spec["per_step_drafted"] = [spec["per_step_drafted"][0] + 1, *spec["per_step_drafted"][1:]]
    with pytest.raises(StepMismatch, match="vLLM reported"):
        trace_from_completion(replace(c, metrics={**c.metrics, "speculative_decoding": spec}), served)
    other = {**served.speculative_config, "prompt_lookup_min": 1}  # a server whose matching rule differs
    with pytest.raises(StepMismatch):
        trace_from_completion(c, replace(served, speculative_config=other))


def test_metrics_text_parses_into_counters_that_grow_by_the_request():
    c, _, _ = recorded("prompt_lookup")
    before = parse_counters((DATA / "prompt_lookup-metrics-before.txt").read_text())
    after = parse_counters((DATA / "prompt_lookup-metrics-after.txt").read_text())
    grew = {k: after[k] - before.get(k, 0.0) for k in after}
    assert grew[DRAFTED] == c.spec["num_draft_tokens"] and grew[ACCEPTED] == c.spec["num_accepted_draft_tokens"]
    assert grew[STEPS] == c.spec["num_spec_steps"]
    trace = trace_from_completion(c, recorded("prompt_lookup")[1])
    _, kept = depth_counts(trace.steps)
    assert [grew.get(f"{PER_POSITION_COUNTER}:{i}", 0) for i in range(len(kept))] == kept


def test_views_say_what_vllm_does_not_report():
    from mtp_viz.viz.figures import step_probabilities, step_timeline
    from mtp_viz.viz.tokens import UNKNOWN_MARK, step_detail_html, tokens_html

    c, served, _ = recorded("speculative")
    trace = trace_from_completion(c, served)
    timeline = step_timeline(trace)
    assert not [t for t in timeline.data if t.type == "bar"]  # no zero-height timing bars
    assert "not reported by vLLM" in timeline.layout.annotations[0].text
    index = next(s.index for s in trace.steps if s.drafted)
    assert "not reported by vLLM" in step_probabilities(trace, index).layout.annotations[0].text
    assert "time not reported" in step_detail_html(trace, index)
    assert f">{UNKNOWN_MARK}<" in tokens_html(trace.steps)  # a rejected draft vLLM did not name


# EAGLE-3 (`eagle` → vLLM's `eagle3`): the config, the server arguments, the served chain, the trace.


def test_eagle_becomes_vllms_eagle3_with_the_checkpoint_as_it_is():
    from types import SimpleNamespace

    from mtp_viz.errors import UserError
    from mtp_viz.serving.methods import EAGLE3, served, server_args

    eagle = served("eagle")
    spec = eagle.speculative_config(SimpleNamespace(depth=4, draft_tree="chain"), "/ckpt/eagle3")
    assert spec == {"method": EAGLE3, "model": "/ckpt/eagle3", "num_speculative_tokens": 4}
    args = server_args(spec)
    assert json.loads(args[args.index("--speculative-config") + 1]) == spec
    assert args[args.index("--per-request-spec-decode-metrics") + 1] == "detailed"
    with pytest.raises(UserError, match="EAGLE-3 checkpoint directory"):
        eagle.speculative_config(SimpleNamespace(depth=4, draft_tree="chain"))


def test_eagle_is_served_as_a_chain_and_a_dynamic_tree_is_refused():
    from mtp_viz.errors import UserError
    from mtp_viz.serving.methods import CHAIN, served

    eagle = served("eagle")
    assert eagle.served_values({}) == {"draft_tree": CHAIN}  # the device default (maybe a tree) is not what vLLM runs
    assert eagle.served_values({"depth": 5, "draft_tree": CHAIN}) == {"depth": 5, "draft_tree": CHAIN}
    with pytest.raises(UserError, match="eagle on vLLM runs with draft_tree=chain only .*no counterpart"):
        eagle.served_values({"draft_tree": "dynamic"})
    assert served("speculative").served_values({"num_draft_tokens": 3}) == {"num_draft_tokens": 3}


def test_an_eagle3_completion_becomes_a_trace_with_eagle3_drafts():
    c, served, _ = recorded("speculative")  # vLLM reports every drafting method's steps alike
    spec = {
        "method": "eagle3",
        "model": "/ckpt",
        "num_speculative_tokens": served.speculative_config["num_speculative_tokens"],
    }
    trace = trace_from_completion(c, replace(served, strategy="eagle", method="eagle3", speculative_config=spec))
    drafted = [d for s in trace.steps for d in s.drafted]
    assert drafted and {d.source for d in drafted} == {"eagle3"}
    assert trace.summary["accepted_tokens"] == c.spec["num_accepted_draft_tokens"]
    assert trace.machine["steps_placed_by"] == "in order"


def test_the_load_model_counts_the_eagle_drafters_cost():
    from mtp_viz.serving.prediction import uses_draft

    assert uses_draft("eagle") and uses_draft("eagle:depth=3") and uses_draft("speculative")
    assert not uses_draft("prompt_lookup") and not uses_draft("autoregressive")


def scheduled_reports(c, served, lengths, report_plain=False):
    """What vLLM reports for the recorded output when its schedule gives each successive step the
    draft length in `lengths` (0: a plain step): a step drafts what vLLM's own n-gram proposer
    proposes there at that length (VLLM_DRAFTS), never what our replay computes."""
    record = json.loads(VLLM_DRAFTS.read_text())
    out, drafts = c.token_ids, record["drafts"]
    assert all(len(d) == len(out) + 1 for d in drafts.values())  # recorded along this very output
    assert record["config"].items() <= served.speculative_config.items()  # by the server's n-gram settings
    drafted, accepted, placed, pos, i = [], [], [], 1, 0
    while pos < len(out):
        k = lengths[i % len(lengths)]
        kept = drafts[str(k)][pos] if k else []
        i += 1
        if not kept:  # a plain step: a length of 0, or no match here
            placed.append((pos, 0))
            if report_plain:  # counted by the engine with nothing drafted
                drafted.append(0)
                accepted.append(0)
            pos += 1
            continue
        a = next((j for j, t in enumerate(kept) if pos + j >= len(out) or t != out[pos + j]), len(kept))
        drafted.append(len(kept))
        accepted.append(a)
        placed.append((pos, len(kept)))
        pos += a + 1
    return {**c.spec, "per_step_drafted": drafted, "per_step_accepted": accepted}, placed


@pytest.mark.parametrize("lengths", [[3], [3, 1, 2], [1, 0, 3, 0], [2, 0]])
def test_ngram_steps_under_a_schedule_are_placed_where_the_counts_fit(lengths):
    """A schedule changes the draft length with the batch, which vLLM does not report: the steps are
    placed where every reported count fits the output, and they are the steps vLLM ran."""
    c, served, _ = recorded("prompt_lookup")
    table = [[1, 4, max(lengths)], [5, 8, 0]]
    served = replace(
        served, speculative_config={**served.speculative_config, "num_speculative_tokens_per_batch_size": table}
    )
    spec, placed = scheduled_reports(c, served, lengths)
    completion = replace(c, metrics={**c.metrics, "speculative_decoding": spec})
    trace = trace_from_completion(completion, served)
    assert trace.output_token_ids == c.token_ids
    spec_steps = [s for s in trace.steps if s.drafted]
    assert [len(s.drafted) for s in spec_steps] == spec["per_step_drafted"]
    assert [s.accepted for s in spec_steps] == spec["per_step_accepted"]
    assert all(d.token_id is not None for s in spec_steps for d in s.drafted)
    starts = [sum(len(s.emitted) for s in trace.steps[:i]) for i in range(1, len(trace.steps))]
    where = [(p, len(s.drafted)) for p, s in zip(starts, trace.steps[1:], strict=True)]
    if 0 not in lengths:  # no plain step where a match was found: one placement fits, vLLM's
        assert where == placed
    else:  # a plain step and a drafting one may both fit: the earliest drafting placement is taken
        assert len(where) <= len(placed) and sum(d for _, d in where) == sum(d for _, d in placed)


def test_a_step_whose_accepted_drafts_the_budget_cut_is_placed_under_a_schedule():
    """vLLM reports what a step accepted even where max_tokens cuts the output inside it (found on
    the first real --schedule auto sweep: 2 of 44 requests)."""
    c, served, _ = recorded("prompt_lookup")
    served = replace(
        served,
        speculative_config={**served.speculative_config, "num_speculative_tokens_per_batch_size": [[1, 4, 3]]},
    )
    spec, placed = scheduled_reports(c, served, [3])
    drafting = [p for p, d in placed if d]
    r = next(i for i, a in enumerate(spec["per_step_accepted"]) if a >= 2)  # a step that kept 2 or more
    end = drafting[r] + 1  # the budget ends the output after its first accepted draft
    cut = replace(c, token_ids=c.token_ids[:end])
    spec = {
        **spec,
        "per_step_drafted": spec["per_step_drafted"][: r + 1],
        "per_step_accepted": spec["per_step_accepted"][: r + 1],
    }
    trace = trace_from_completion(replace(cut, metrics={**c.metrics, "speculative_decoding": spec}), served)
    assert trace.machine["steps_placed_by"] == "ngram replay under a schedule, checked"
    assert trace.output_token_ids == c.token_ids[:end] and len(trace.steps[-1].emitted) == 1


def test_steps_the_engine_counted_with_nothing_drafted_are_placed_as_plain_steps():
    c, served, _ = recorded("prompt_lookup")
    served = replace(
        served,
        speculative_config={**served.speculative_config, "num_speculative_tokens_per_batch_size": [[1, 4, 3]]},
    )
    spec, placed = scheduled_reports(c, served, [3, 0], report_plain=True)
    assert 0 in spec["per_step_drafted"]
    trace = trace_from_completion(replace(c, metrics={**c.metrics, "speculative_decoding": spec}), served)
    assert trace.machine["steps_placed_by"] == "ngram replay under a schedule, checked"
    assert len(trace.steps) == 1 + len(placed) and trace.output_token_ids == c.token_ids


def test_counts_that_fit_no_placement_under_a_schedule_are_kept_in_order_and_said_so():
    """A sweep does not stop where the replay cannot place the steps: their counts stay exact, in
    order, and the trace says how they were placed; counts that contradict themselves are refused."""
    c, served, _ = recorded("prompt_lookup")
    table = [[1, 32, 3]]
    served = replace(
        served, speculative_config={**served.speculative_config, "num_speculative_tokens_per_batch_size": table}
    )
    spec, _ = scheduled_reports(c, served, [3])
    first = next(i for i, a in enumerate(spec["per_step_accepted"]) if a >= 1)
    spec["per_step_accepted"][first] -= 1  # the refused draft would equal the output: no placement
    trace = trace_from_completion(replace(c, metrics={**c.metrics, "speculative_decoding": spec}), served)
    assert trace.machine["steps_placed_by"].startswith("in order, the n-gram replay not fitting (no placement")
    spec_steps = [s for s in trace.steps if s.drafted]
    assert [len(s.drafted) for s in spec_steps] == spec["per_step_drafted"]
    assert [s.accepted for s in spec_steps] == spec["per_step_accepted"]
    spec["per_step_accepted"][first] = spec["per_step_drafted"][first] + 1  # more accepted than drafted
    with pytest.raises(StepMismatch):
        trace_from_completion(replace(c, metrics={**c.metrics, "speculative_decoding": spec}), served)
