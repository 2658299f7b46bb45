"""The acceptance rule's decision, apart from its record: the loop and the draft-length schedule
read the decision; `record` alone turns it into the trace's verdicts, probabilities and origins."""

from dataclasses import asdict

import torch
from test_step_recorder import ScriptedClock, context

from mtp_viz.strategies.base import StepRecorder, verify_chain, verify_tree
from mtp_viz.strategies.decision import Decision, Outcome, record
from mtp_viz.strategies.speculative import HEURISTIC, SpeculativeSettings, next_length
from mtp_viz.trace import ACCEPTED, BONUS, RESAMPLED, EmittedToken, Step

V = 10


def scripted_logits(argmax: list[int]) -> torch.Tensor:
    """(len(argmax), V) logits whose row i peaks at argmax[i]."""
    logits = torch.zeros(len(argmax), V)
    logits[torch.arange(len(argmax)), argmax] = 5.0
    return logits


def decision(drafted: int, path: tuple[int, ...], **fields) -> Decision:
    tokens = fields.pop("tokens", tuple(range(len(path) + 1)))
    return Decision(
        drafted=drafted,
        path=path,
        rejected=fields.pop("rejected", ()),
        tokens=tokens,
        origins=fields.pop("origins", (ACCEPTED,) * len(path) + (BONUS,)),
        p_target=(None,) * drafted,
        p_tokens=(None,) * len(tokens),
        draws=(None,) * drafted,
    )


def test_record_of_a_hand_made_decision_is_the_step_the_trace_keeps():
    made = Decision(
        drafted=3,
        path=(0,),
        rejected=(1,),
        tokens=(7, 9),
        origins=(ACCEPTED, RESAMPLED),
        p_target=(0.5, 0.125, 0.25),
        p_tokens=(0.5, 0.375),
        draws=(0.25, 0.875, None),
    )
    outcome = record(made)
    assert outcome == Outcome(
        [EmittedToken(7, ACCEPTED, 0.5), EmittedToken(9, RESAMPLED, 0.375)],
        ["accepted", "rejected", "skipped"],
        [0.5, 0.125, 0.25],
        [0.25, 0.875, None],
    )
    steps = StepRecorder(context(ScriptedClock([0.0, 1.0, 3.0, 4.0])))
    steps.begin()
    steps.drafted()
    steps.verified()
    step = steps.step(outcome, input_tokens=4, kv_len=9)
    expected = Step(
        index=0,
        emitted=outcome.emitted,
        verdicts=outcome.verdicts,
        target_p=outcome.target_p,
        draws=outcome.draws,
        draft_s=1.0,
        verify_s=2.0,
        step_s=4.0,
        target_forwards=1,
        input_tokens=4,
        kv_len=9,
    )
    assert list(asdict(step).items()) == list(asdict(expected).items())  # same values, same field order


def test_verify_chain_decides_accepted_length_tokens_and_origins():
    ctx = context(ScriptedClock([]), max_new_tokens=10)
    made = verify_chain(ctx, scripted_logits([4, 5, 6, 7]), [4, 5, 1], None)
    assert (made.accepted, made.drafted, made.path, made.rejected) == (2, 3, (0, 1), (2,))
    assert made.tokens == (4, 5, 6) and made.origins == (ACCEPTED, ACCEPTED, RESAMPLED)
    assert made.cached_path == (0, 1)
    assert record(made).verdicts == ["accepted", "accepted", "rejected"]


def test_an_eos_among_accepted_tokens_cuts_the_decision():
    ctx = context(ScriptedClock([]), max_new_tokens=10, eos=(4,))
    chain = verify_chain(ctx, scripted_logits([4, 5, 6, 7]), [4, 5, 1], None)
    assert (chain.tokens, chain.path, chain.rejected, chain.cached_path) == ((4,), (0,), (), ())
    assert record(chain).verdicts == ["accepted", "skipped", "skipped"]
    # a tree keeps its rejections past the cut, as its traces always have
    tree = verify_tree(ctx, scripted_logits([4, 5, 6, 7]), [4, 5, 1], [-1, 0, 1])
    assert (tree.tokens, tree.path, tree.rejected) == ((4,), (0,), (2,))
    assert record(tree).verdicts == ["accepted", "skipped", "rejected"]


def test_with_nothing_drafted_the_targets_token_is_autoregressive():
    ctx = context(ScriptedClock([]))
    made = verify_chain(ctx, scripted_logits([3]), [], None)
    assert (made.tokens, made.origins, made.drafted, made.accepted) == ((3,), ("autoregressive",), 0, 0)


def test_the_heuristic_schedule_reads_the_decisions_accepted_length():
    settings = SpeculativeSettings(num_draft_tokens=3, schedule=HEURISTIC)
    assert next_length(settings, 3, decision(3, (0, 1, 2))) == 5
    assert next_length(settings, 3, decision(3, (0,), rejected=(1,))) == 2
    assert next_length(settings, 1, decision(3, ())) == 1
    assert next_length(settings, 3, decision(0, ())) == 3
    assert next_length(SpeculativeSettings(num_draft_tokens=3), 3, decision(3, (0, 1, 2))) == 3
