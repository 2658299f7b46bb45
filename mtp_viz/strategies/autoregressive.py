"""Plain autoregressive decoding: one target forward, one token. The baseline of every number."""

from collections.abc import Iterator
from dataclasses import dataclass

from mtp_viz.cache import CachedModel
from mtp_viz.strategies.base import DecodeContext, StrategySpec
from mtp_viz.trace import AUTOREGRESSIVE, EmittedToken, Step

NAME = "autoregressive"


@dataclass(frozen=True)
class AutoregressiveSettings:
    pass


def run(ctx: DecodeContext, settings: AutoregressiveSettings) -> Iterator[Step]:
    target = CachedModel(ctx.target, ctx.vocab_size)
    index = 0
    while not ctx.done:
        start = ctx.clock.now()
        seq = ctx.seq
        fed = len(seq) - target.length
        logits = target.forward(seq)[-1]  # (V,)
        token, p = ctx.next_token(logits)
        end = ctx.clock.now()
        ctx.output.append(token)
        yield Step(
            index=index,
            emitted=[EmittedToken(token, AUTOREGRESSIVE, p)],
            verify_s=end - start,
            step_s=end - start,
            target_forwards=1,
            input_tokens=fed,
            kv_len=target.length,
        )
        index += 1


SPEC = StrategySpec(
    name=NAME,
    settings_cls=AutoregressiveSettings,
    run=run,
    needs_draft=False,
    lossless=True,
    summary="One target forward per token, greedy or sampled.",
)
