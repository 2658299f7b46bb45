"""Plain autoregressive decoding: one target forward, one token. The baseline of every number."""

from collections.abc import Iterator
from dataclasses import dataclass

from mtp_viz.strategies.base import DecodeContext, StepRecorder, StrategySpec
from mtp_viz.strategies.decision import Outcome
from mtp_viz.trace import AUTOREGRESSIVE, EmittedToken, Step

NAME = "autoregressive"
SUMMARY = "One target forward per token, greedy or sampled."


@dataclass(frozen=True)
class AutoregressiveSettings:
    pass


def run(ctx: DecodeContext, settings: AutoregressiveSettings) -> Iterator[Step]:
    target = ctx.target_cache()
    steps = StepRecorder(ctx)
    while steps.begin():
        seq = ctx.seq
        fed = len(seq) - target.length
        logits = target.forward(seq)[-1]  # (V,)
        token, p = ctx.next_token(logits)
        steps.verified()
        ctx.output.append(token)
        yield steps.step(Outcome([EmittedToken(token, AUTOREGRESSIVE, p)]), input_tokens=fed, kv_len=target.length)


SPEC = StrategySpec(NAME, AutoregressiveSettings, run, SUMMARY)
