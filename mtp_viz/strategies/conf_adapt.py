"""Multi-token prediction without verification, with confidence-adaptive emission (ConfAdapt, from
"Multi-Token Prediction via Self-Distillation", Kirchenbauer et al., arXiv 2602.06019). Lossy.

Each step predicts k tokens in one target forward and emits the longest prefix whose top-1
probabilities are all ≥ τ, at least one token (the first is ordinary next-token prediction).
Emitted tokens are fed back as real inputs in the next forward. Two predictors:
- mask tokens (the paper's models): the tokens emitted last step, then k−1 mask tokens at the next
  positions, plain causal attention; the predictions are the logits at the last real token and at
  each mask; the masks' key/values are cropped after the step. The paper's inference repeats one
  mask id; its training code can also write mask_id + j for the j-th mask (`mask_layout`).
  On a registered model with a `mask_model` (the embedded one: a mask-only LoRA adapter trained
  here, mtp_viz.drafters.mask), the runner runs it on that model; the first token of every step
  is then exactly the original model's.
- MTP heads (mtp_viz.drafters.heads), the embedded model's other predictor: the target's own next token,
  then a greedy chain of k−1 head guesses, each with the heads' top-1 probability as confidence.
`fixed` mode emits all k predictions, to show what the confidence rule buys.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from mtp_viz.cache import CachedModel
from mtp_viz.drafters.kinds import DrafterKind
from mtp_viz.errors import UserError
from mtp_viz.strategies.base import DecodeContext, StepRecorder, StrategySpec
from mtp_viz.strategies.decision import Outcome
from mtp_viz.strategies.mtp_heads import propose
from mtp_viz.strategies.settings import check_settings, setting
from mtp_viz.trace import AUTOREGRESSIVE, UNVERIFIED, EmittedToken, Step

NAME = "conf_adapt"
SUMMARY = "Predicts k tokens per forward and emits the confident prefix, without verification (lossy)."
MAX_K = 16
ADAPTIVE, FIXED = "adaptive", "fixed"
AUTO, MASK_TOKENS, HEADS = "auto", "mask_tokens", "heads"
REPEAT, OFFSET = "repeat", "offset"


@dataclass(frozen=True)
class ConfAdaptSettings:
    k: int = setting(4, "Predictions per forward k", low=1, high=MAX_K)
    tau: float = setting(0.9, "Confidence threshold τ", low=0.0, high=1.0, step=0.01)
    mode: str = setting(ADAPTIVE, "Emit the confident prefix (adaptive) or all k (fixed)", choices=(ADAPTIVE, FIXED))
    predictor: str = setting(
        AUTO, "Predictor (auto: mask tokens if the model has them)", choices=(AUTO, MASK_TOKENS, HEADS)
    )
    mask_layout: str = setting(REPEAT, "Mask ids: one repeated, or mask_id + j", choices=(REPEAT, OFFSET))

    def __post_init__(self):
        check_settings(self)


def uses_heads(settings: ConfAdaptSettings, mask_token_id: int | None) -> bool:
    return settings.predictor == HEADS or (settings.predictor == AUTO and mask_token_id is None)


def drafters(settings: ConfAdaptSettings) -> tuple[DrafterKind, ...]:
    """Heads, mask tokens, or (auto) the model's mask tokens where it has them, else its heads."""
    return {
        HEADS: (DrafterKind.HEADS,),
        MASK_TOKENS: (DrafterKind.MASKS,),
        AUTO: (DrafterKind.MASKS, DrafterKind.HEADS),
    }[settings.predictor]


def emit_count(confidences: list[float], tau: float, fixed: bool = False) -> int:
    """How many of the k predictions to emit: the longest prefix with every confidence ≥ τ,
    at least one (all of them in fixed mode)."""
    if fixed:
        return len(confidences)
    n = 0
    while n < len(confidences) and confidences[n] >= tau:
        n += 1
    return max(1, n)


def mask_ids(mask_token_id: int, count: int, layout: str) -> list[int]:
    return [mask_token_id + j if layout == OFFSET else mask_token_id for j in range(count)]


def predict_with_masks(ctx: DecodeContext, target: CachedModel, k: int, layout: str):
    """(k predictions, their confidences) from one forward over the unseen tokens + k−1 masks."""
    seq = ctx.seq
    masks = mask_ids(ctx.mask_token_id, k - 1, layout)
    logits = target.forward(seq + masks, logits_to_keep=k)  # (k, V): last real token, then each mask
    target.rollback(len(seq))  # the masks' key/values go
    first, _ = ctx.next_token(logits[0])
    probs = torch.softmax(logits, -1)  # confidence: top-1 of the raw (untempered) distribution
    tokens = [first] + probs[1:].argmax(-1).tolist()
    return tokens, probs.max(-1).values.tolist()


def predict_with_heads(ctx: DecodeContext, target: CachedModel, k: int):
    """(k predictions, their confidences): the target's own next token, then k−1 chained head guesses."""
    seq = ctx.seq
    logits, hidden = target.forward_hidden(seq)  # (1, V), (1, H)
    first, _ = ctx.next_token(logits[0])
    confidence = float(torch.softmax(logits[0], -1).max())
    guesses, _, q = propose(ctx.heads, hidden[0], first, [(0,) * d for d in range(1, k)]) if k > 1 else ([], [], [])
    return [first] + guesses, [confidence] + q


def run(ctx: DecodeContext, settings: ConfAdaptSettings) -> Iterator[Step]:
    heads = uses_heads(settings, ctx.mask_token_id)
    if not heads and ctx.mask_token_id is None:
        raise UserError("predictor mask_tokens needs a model with a mask token (models.yaml mask_token_id)")
    if not heads and settings.mask_layout == OFFSET and hasattr(ctx.target, "mtp_mask_spec"):
        raise UserError("this mask-token adapter has one mask id: use mask_layout=repeat")
    target = ctx.target_cache()
    steps = StepRecorder(ctx)
    while steps.begin():
        k = min(settings.k, ctx.remaining)
        fed = len(ctx.seq) - target.length + (0 if heads else k - 1)
        # predict: k tokens from one target forward (the first is ordinary next-token prediction)
        if heads:
            tokens, confidence = predict_with_heads(ctx, target, k)
        else:
            tokens, confidence = predict_with_masks(ctx, target, k, settings.mask_layout)
        steps.verified()
        # emit: the confident prefix (or all k), cut after EOS and at the budget; no verification
        emitted_ids = ctx.clip(tokens[: emit_count(confidence, settings.tau, settings.mode == FIXED)])
        ctx.output.extend(emitted_ids)
        emitted = [
            EmittedToken(t, AUTOREGRESSIVE if i == 0 else UNVERIFIED, confidence=None if i == 0 else confidence[i])
            for i, t in enumerate(emitted_ids)
        ]
        extra = {"predicted": tokens, "confidence": confidence, "tau": settings.tau, "heads": heads}
        yield steps.step(Outcome(emitted), input_tokens=fed, kv_len=target.length, extra=extra)


SPEC = StrategySpec(
    NAME,
    ConfAdaptSettings,
    run,
    SUMMARY,
    drafter=drafters,
    lossless=False,
)
