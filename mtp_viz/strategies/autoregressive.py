"""Plain autoregressive decoding: one target forward, one token. The baseline of every number."""

from collections.abc import Iterator
from dataclasses import dataclass

from mtp_viz.cache import CachedModel
from mtp_viz.strategies.base import VERIFY, DecodeContext, Outcome, StepRecorder, StrategySpec
from mtp_viz.trace import AUTOREGRESSIVE, EmittedToken, Step

NAME = "autoregressive"


@dataclass(frozen=True)
class AutoregressiveSettings:
    pass


def run(ctx: DecodeContext, settings: AutoregressiveSettings) -> Iterator[Step]:
    target = CachedModel(ctx.target, ctx.vocab_size)
    steps = StepRecorder(ctx.clock)
    while not ctx.done:
        steps.start()
        seq = ctx.seq
        fed = len(seq) - target.length
        logits = target.forward(seq)[-1]  # (V,)
        token, p = ctx.next_token(logits)
        steps.mark(VERIFY)
        ctx.output.append(token)
        yield steps.step(Outcome([EmittedToken(token, AUTOREGRESSIVE, p)]), input_tokens=fed, kv_len=target.length)


SPEC = StrategySpec(
    name=NAME,
    settings_cls=AutoregressiveSettings,
    run=run,
    needs_draft=False,
    lossless=True,
    summary="One target forward per token, greedy or sampled.",
)
