"""Speculative decoding with mask-token drafts, verified in the same forward (lossless).

A mask-token MTP model (mtp_viz.drafters.mask, or any model with a `mask_token_id`) writes k−1
guesses per forward at k−1 mask tokens appended after the real ones. ConfAdapt emits confident
guesses unverified; here they are verified, by the next forward, which does both jobs at once:

    [the new real token(s), the previous step's guesses g_1 … g_m, k−1 masks]

The real positions verify the guesses (greedy: the longest prefix the model agrees with; sampling:
accept with min(1, p/q), q from the masks' distributions, resample at the first rejection, a
bonus token after the last guess). The masks draft the next step's guesses. Chained
(`branches` off), one block of masks follows the guesses: its guesses only stand if every guess
was accepted (the masks assumed them), so a rejection leaves the next step without guesses.
Branched (the default), a block of k−1 masks hangs off every real position the step could end at
(the last real token and each guess, each block seeing its own prefix only): whichever guess is
rejected, the block after the last accepted token assumed exactly what was committed up to there,
and its predictions for the tokens after the step's own token become the next guesses, so every
step has guesses, at the price of a wider forward. Measured on a 2-core CPU (docs/training.md),
the defaults are the best: k = 2 branched, a 4-token forward, 1.38 tokens per forward and
1.07-1.09x on Spec-Bench, where k = 2 chained reads 1.00x, k = 3 chained 0.95x and k = 3
branched (9 tokens a forward) 0.68x; where a wide forward is nearly free (a GPU) a larger k is
the one to try. The masks' key/values are cropped from the cache after every step.

Lossless when the real positions run the unchanged model: a mask-only adapter (the default for
adapters trained here) leaves them untouched, so no second model is needed.
"""

from collections.abc import Iterator
from dataclasses import dataclass

from mtp_viz.drafters.kinds import DrafterKind
from mtp_viz.drafters.mask import MASK_ONLY
from mtp_viz.errors import UserError
from mtp_viz.strategies.base import DecodeContext, StepRecorder, StrategySpec, chain_drafts, draft_tokens, verify_chain
from mtp_viz.strategies.decision import record
from mtp_viz.strategies.settings import check_settings, setting
from mtp_viz.trace import BONUS, Step

NAME = "mask_spec"
SUMMARY = "Mask tokens draft k−1 guesses; the next forward verifies them while its masks draft the next ones."
MAX_K = 16
MASK_SOURCE = "mask_token"


@dataclass(frozen=True)
class MaskSpecSettings:
    k: int = setting(2, "Predictions per forward k (1 real + k−1 masks)", low=2, high=MAX_K, gpu=4)
    branches: bool = setting(True, "A mask block after every guess (a rejection still leaves guesses)")

    def __post_init__(self):
        check_settings(self)


def check_model(ctx: DecodeContext) -> None:
    if ctx.mask_token_id is None:
        raise UserError("mask_spec needs a model with a mask token (models.yaml mask_token_id or mask_model)")
    spec = getattr(ctx.target, "mtp_mask_spec", None)
    if spec is not None and spec.gating != MASK_ONLY:
        raise UserError(
            "mask_spec needs a mask-only adapter: this one changes the real positions too, so it would "
            "verify against another model than the original"
        )


def run(ctx: DecodeContext, settings: MaskSpecSettings) -> Iterator[Step]:
    check_model(ctx)
    target = ctx.target_cache()
    guesses: list[int] = []  # drafted by the last step's masks, verified by this step
    q_draft, q = None, []
    steps = StepRecorder(ctx)
    while steps.begin():
        keep = max(0, min(len(guesses), ctx.remaining - 1))  # never verify past the budget
        guesses, q = guesses[:keep], q[:keep]
        q_draft = None if q_draft is None else q_draft[:keep]
        block = [ctx.mask_token_id] * (settings.k - 1)
        # verify + draft: one forward scores the guesses and fills the masks, one block after the
        # guesses (chained) or one after each position the step can end at (branched)
        anchors = range(len(ctx.seq) - 1, len(ctx.seq) + len(guesses)) if settings.branches else [-1]
        fed = len(ctx.seq) + len(guesses) + len(anchors) * len(block) - target.length
        if settings.branches:
            branches = [(a, block) for a in anchors]
            logits = target.forward_branches(ctx.seq + guesses, branches, logits_to_keep=1 + len(guesses))
        else:
            logits = target.forward(ctx.seq + guesses + block, logits_to_keep=1 + len(guesses) + len(block))
        steps.verified()
        # accept: the longest acceptable prefix of the guesses, then the model's own token
        decision = verify_chain(ctx, logits[: len(guesses) + 1], guesses, q_draft)
        drafted = chain_drafts(guesses, MASK_SOURCE, q)
        # commit: extend the output; the rejected guesses' and the masks' key/values go
        ctx.output.extend(decision.tokens)
        cropped = list(range(len(ctx.seq) - 1, target.length))
        target.rollback(len(ctx.seq) - 1)
        # draft: from the block that assumed what was committed (chained: only if every guess was)
        first = len(guesses) + 1 + (decision.accepted * len(block) if settings.branches else 0)
        all_taken = decision.origins[-1:] == (BONUS,) or not guesses
        next_guesses, q_draft, q = (
            draft_tokens(ctx, logits[first : first + len(block)]) if settings.branches or all_taken else ([], None, [])
        )
        steps.drafted()
        extra = {"masks": len(anchors) * len(block), "cropped_positions": cropped, "next_guesses": next_guesses}
        yield steps.step(record(decision), drafted=drafted, input_tokens=fed, kv_len=target.length, extra=extra)
        guesses = next_guesses


SPEC = StrategySpec(NAME, MaskSpecSettings, run, SUMMARY, drafter=(DrafterKind.MASKS,))
