"""Speculative decoding with a draft model (Leviathan et al. 2023; Chen et al. 2023).

Each step the draft proposes up to k tokens one by one; the target scores all of them in one
forward; the longest acceptable prefix is kept, then one token from the target (resampled at the
first rejection, or a bonus token when all were accepted). Lossless in greedy and sampling mode.

The draft length can adapt (any rule that looks only at the draft keeps it lossless):
- `constant`: always `num_draft_tokens`;
- `heuristic`: start at `num_draft_tokens`; +2 after a fully accepted block, −1 otherwise (at least
  1), as transformers' assisted generation does;
- `confidence`: draft up to `num_draft_tokens`, but stop as soon as the draft's top probability
  falls below `confidence_threshold` (transformers' assistant_confidence_threshold, default 0.4).
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from mtp_viz.cache import CachedModel
from mtp_viz.drafters.kinds import DrafterKind
from mtp_viz.strategies.base import DecodeContext, StepRecorder, StrategySpec, chain_drafts, draft_tokens, verify_chain
from mtp_viz.strategies.decision import Decision, record
from mtp_viz.strategies.settings import check_settings, setting
from mtp_viz.trace import Step

NAME = "speculative"
SUMMARY = "A small draft model proposes k tokens; the target verifies them in one forward."
MAX_DRAFT_TOKENS = 64
DRAFT_SOURCE = "draft_model"


CONSTANT, HEURISTIC, CONFIDENCE = "constant", "heuristic", "confidence"
SCHEDULES = (CONSTANT, HEURISTIC, CONFIDENCE)


@dataclass(frozen=True)
class SpeculativeSettings:
    # on a 2-core CPU one draft token ran at 1.17x AR, five at 0.76x (docs/BENCHMARKS.md); 5 is the GPU size
    num_draft_tokens: int = setting(
        1, "Draft tokens per step (most, for adaptive schedules)", low=1, high=MAX_DRAFT_TOKENS, gpu=5
    )
    schedule: str = setting(CONSTANT, "Draft length schedule", choices=SCHEDULES)
    confidence_threshold: float = setting(
        0.4, "Stop drafting below this draft probability (confidence schedule)", low=0.0, high=1.0, step=0.05
    )

    def __post_init__(self):
        check_settings(self)


def next_length(settings: SpeculativeSettings, k: int, decision: Decision) -> int:
    """The heuristic schedule: +2 after a fully accepted block, −1 otherwise; others keep k."""
    if settings.schedule != HEURISTIC or decision.drafted == 0:
        return k
    return min(MAX_DRAFT_TOKENS, k + 2) if decision.accepted == decision.drafted else max(1, k - 1)


def propose(
    ctx: DecodeContext, draft: CachedModel, k: int, stop_below: float = 0.0
) -> tuple[list[int], torch.Tensor | None, list]:
    """Draft up to k tokens autoregressively, stopping early once the draft's top probability
    falls below `stop_below`. Returns ids, the warped draft distributions (k, V) when sampling
    (None when greedy), and the probability q of each drafted token."""
    seq = ctx.seq
    ids: list[int] = []
    dists = []
    q: list[float | None] = []
    for _ in range(k):
        logits = draft.forward(seq + ids)[-1:]  # (1, V)
        token, q_draft, q_token = draft_tokens(ctx, logits)
        ids += token
        q += q_token
        if q_draft is not None:
            dists.append(q_draft)
        if stop_below and float((torch.softmax(logits, -1) if q_draft is None else q_draft).max()) < stop_below:
            break
    return ids, (torch.cat(dists) if dists else None), q


def run(ctx: DecodeContext, settings: SpeculativeSettings) -> Iterator[Step]:
    target = ctx.target_cache()
    draft = CachedModel(ctx.draft, ctx.vocab_size)
    length = settings.num_draft_tokens
    stop_below = settings.confidence_threshold if settings.schedule == CONFIDENCE else 0.0
    steps = StepRecorder(ctx)
    while steps.begin():
        draft_forwards = draft.forwards
        k = min(length, ctx.remaining - 1)  # never draft past the budget
        # propose: the draft guesses up to k tokens
        ids, q_draft, q = propose(ctx, draft, k, stop_below)
        k = len(ids)
        steps.drafted()
        # verify: one target forward scores every prefix of the guess
        fed = len(ctx.seq) + k - target.length
        logits = target.forward(ctx.seq + ids, logits_to_keep=k + 1)  # (k+1, V)
        steps.verified()
        # accept: keep the longest acceptable prefix, then the target's own token
        decision = verify_chain(ctx, logits, ids, q_draft)
        length = next_length(settings, length, decision)
        # commit: extend the output, forget the key/values of rejected positions
        ctx.output.extend(decision.tokens)
        target.rollback(len(ctx.seq) - 1)
        draft.rollback(len(ctx.seq) - 1)
        drafted, forwards = chain_drafts(ids, DRAFT_SOURCE, q), draft.forwards - draft_forwards
        extra = {"draft_len": k}
        yield steps.step(
            record(decision),
            drafted=drafted,
            draft_forwards=forwards,
            input_tokens=fed,
            kv_len=target.length,
            extra=extra,
        )


SPEC = StrategySpec(NAME, SpeculativeSettings, run, SUMMARY, drafter=(DrafterKind.DRAFT_MODEL,))
