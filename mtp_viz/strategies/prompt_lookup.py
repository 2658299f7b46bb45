"""Prompt lookup decoding (Saxena 2023): draft by n-gram match against the text so far.

The last n tokens (n from `max_ngram_size` down to `min_ngram_size`) are looked up in the prompt
and the output; the tokens that followed the first earlier occurrence become the draft, which the
target verifies in one forward. When nothing matches the step is a plain autoregressive forward,
so a prompt with nothing to copy costs what autoregressive decoding costs.

Why `min_ngram_size` defaults to 2 (transformers goes down to 1): measured on a laptop CPU with
`F.linear`, a forward over a draft cost ~2x a one-token forward, and a draft found from a single
matching token keeps only 0.37 tokens on average (SmolLM2-135M, five Spec-Bench-style prompts;
2-gram matches keep 0.98, 3-grams 2.36; experiments/prompt_lookup_stats.py), so drafting from it
lost time. With `fast_linear` a 2-4 token verify costs 1.0-1.3x, which lowers that break-even;
min_ngram_size=1 has not been re-measured on it. On a GPU, where verifying a few tokens costs
about one forward, `min_ngram_size=1` pays.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from mtp_viz.errors import InvalidSettingsError
from mtp_viz.strategies.base import DecodeContext, StepRecorder, StrategySpec, chain_drafts, verify_chain
from mtp_viz.strategies.decision import record
from mtp_viz.strategies.settings import check_settings, setting
from mtp_viz.trace import Step

NAME = "prompt_lookup"
SUMMARY = "Drafts by copying what followed the last n-gram earlier in the prompt or output."
MAX_DRAFT_TOKENS = 64
MAX_NGRAM_SIZE = 16
NGRAM_SOURCE = "ngram"
# Most drafts per step. 3 on a CPU, where verifying 2-4 tokens costs 1.0-1.3x a one-token forward
# and more cost 1.25-2.6x (docs/BENCHMARKS.md: 1.18x with 3 against 1.02x with 10 on Spec-Bench); where
# verifying costs little more, as on a GPU, 10 (transformers' and Spec-Bench's choice) pays.
DEFAULT_DRAFT_TOKENS = 3  # on a CPU (docs/BENCHMARKS.md: 10 was slower there)
GPU_DRAFT_TOKENS = 10  # transformers' prompt_lookup_num_tokens default


@dataclass(frozen=True)
class PromptLookupSettings:
    num_draft_tokens: int = setting(
        DEFAULT_DRAFT_TOKENS, "Draft tokens per step (most)", low=1, high=MAX_DRAFT_TOKENS, gpu=GPU_DRAFT_TOKENS
    )
    max_ngram_size: int = setting(3, "Longest n-gram matched", low=1, high=MAX_NGRAM_SIZE)
    min_ngram_size: int = setting(2, "Shortest n-gram matched", low=1, high=MAX_NGRAM_SIZE)

    def __post_init__(self):
        check_settings(self)
        if self.min_ngram_size > self.max_ngram_size:
            raise InvalidSettingsError(
                f"min_ngram_size ({self.min_ngram_size}) must not exceed max_ngram_size ({self.max_ngram_size})"
            )


def find_draft(seq: np.ndarray, max_ngram_size: int, min_ngram_size: int, k: int) -> tuple[list[int], int, int]:
    """Tokens following the first earlier occurrence of the longest matching suffix n-gram.

    Returns (draft ids, n-gram size matched, start of the match); ([], 0, -1) when nothing matches.
    """
    length = len(seq)
    for n in range(min(max_ngram_size, length - 1), min_ngram_size - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[: length - 1], n)  # (L-n, n)
        hits = np.flatnonzero((windows == seq[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[0])
            return seq[start + n : start + n + k].tolist(), n, start
    return [], 0, -1


def run(ctx: DecodeContext, settings: PromptLookupSettings) -> Iterator[Step]:
    target = ctx.target_cache()
    steps = StepRecorder(ctx)
    while steps.begin():
        seq = ctx.seq
        k = min(settings.num_draft_tokens, ctx.remaining - 1)
        # propose: copy what followed the same n-gram earlier
        ids, n, match = (
            find_draft(np.asarray(seq), settings.max_ngram_size, settings.min_ngram_size, k) if k else ([], 0, -1)
        )
        steps.drafted()
        # verify: one target forward (a plain autoregressive one when nothing matched)
        fed = len(seq) + len(ids) - target.length
        logits = target.forward(seq + ids, logits_to_keep=len(ids) + 1)  # (len(ids)+1, V)
        steps.verified()
        # accept: the longest prefix the target agrees with, then its own token
        decision = verify_chain(ctx, logits, ids, None)
        # commit
        ctx.output.extend(decision.tokens)
        target.rollback(len(ctx.seq) - 1)
        drafted = chain_drafts(ids, NGRAM_SOURCE, [1.0] * len(ids))
        extra = {"ngram_size": n, "match_start": match}
        yield steps.step(record(decision), drafted=drafted, input_tokens=fed, kv_len=target.length, extra=extra)


SPEC = StrategySpec(NAME, PromptLookupSettings, run, SUMMARY)
