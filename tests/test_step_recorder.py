"""The step recorder every strategy's loop uses: phases, index, and when the loop ends."""

import pytest

from mtp_viz.strategies.base import DecodeContext, GenerationSettings, StepRecorder
from mtp_viz.strategies.decision import Outcome
from mtp_viz.trace import AUTOREGRESSIVE, EmittedToken


class ScriptedClock:
    def __init__(self, times):
        self.times = iter(times)

    def now(self) -> float:
        return next(self.times)


def context(clock, max_new_tokens=3, eos=()) -> DecodeContext:
    return DecodeContext(
        target=None,
        prompt_ids=[1, 2],
        generation=GenerationSettings(max_new_tokens=max_new_tokens),
        eos_token_ids=frozenset(eos),
        vocab_size=10,
        clock=clock,
    )


def test_phases_get_the_time_since_the_previous_mark():
    # begin 0, drafted 2, verified 7, step closes at 10
    steps = StepRecorder(context(ScriptedClock([0.0, 2.0, 7.0, 10.0])))
    assert steps.begin()
    steps.drafted()
    steps.verified()
    step = steps.step(Outcome([EmittedToken(5, AUTOREGRESSIVE, 0.5)]), input_tokens=3, kv_len=3)
    assert (step.draft_s, step.verify_s, step.step_s) == (2.0, 5.0, 10.0)
    assert step.index == 0 and step.target_forwards == 1 and step.input_tokens == 3


def test_verify_before_draft_and_indices_count_up():
    # mask_spec's order: verify, then draft the next guesses
    steps = StepRecorder(context(ScriptedClock([0.0, 4.0, 5.0, 6.0, 10.0, 11.0, 13.0, 20.0])))
    made = []
    for _ in range(2):
        assert steps.begin()
        steps.verified()
        steps.drafted()
        made.append(steps.step(Outcome([]), target_forwards=2))
    assert [s.index for s in made] == [0, 1]
    assert [(s.verify_s, s.draft_s, s.step_s) for s in made] == [(4.0, 1.0, 6.0), (1.0, 2.0, 10.0)]
    assert made[0].target_forwards == 2


@pytest.mark.parametrize("output, eos, expect", [([4, 4], (), True), ([4, 4, 4], (), False), ([9], (9,), False)])
def test_begin_stops_at_the_budget_or_eos(output, eos, expect):
    ctx = context(ScriptedClock([0.0]), eos=eos)
    ctx.output.extend(output)
    assert StepRecorder(ctx).begin() is expect
