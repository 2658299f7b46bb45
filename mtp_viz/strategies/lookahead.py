"""Lookahead decoding (Fu et al. 2024, arXiv 2402.02057): Jacobi iteration over a window, an
n-gram pool harvested from it, and verification of pool hits, all in one forward. Lossless.

State between steps: a 2D window of N−1 levels × W columns of guesses for the positions after
the current token `cur` (level 0 is `cur` and W−1 guesses; the window starts from random prompt
tokens). One forward feeds `cur`, the window, and up to G candidate (N−1)-grams from the pool
that follow `cur`, merged into a token tree:
- window token (level l, column c) sits at cur's position + l + c and sees `cur`, the level-0
  tokens of columns ≤ c and the tokens above it in its column: a causal prefix, so its output is
  a Jacobi update;
- candidate tokens see `cur` and their own prefix in the tree; window and candidates never see
  each other.
Then: the target's outputs at the last level form a new level; each column yields an n-gram
(level-0 token, the column's tokens, the new token) for the pool; the window shifts up one level;
the longest candidate path the target agrees with is accepted, plus the target's own next token.

As in the reference code the window is built greedily; sampling verifies the candidates with the
lossless multi-draft rule. Settings follow Spec-Bench (level N=5, window W=7, guess set G=7).
"""

import random
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from mtp_viz.strategies.base import DecodeContext, StepRecorder, StrategySpec, verify_tree
from mtp_viz.strategies.decision import record
from mtp_viz.strategies.settings import check_settings, setting
from mtp_viz.trace import DraftToken, Step
from mtp_viz.visibility import node_depths, tree_visibility

NAME = "lookahead"
SUMMARY = "Jacobi iterations fill an n-gram pool; pool hits are verified in the same forward."
JACOBI = "jacobi"  # an n-gram the Jacobi window produced
PROMPT = "prompt"  # an n-gram copied from the prompt (pool_from_prompt)
MAX_LEVEL, MAX_WINDOW, MAX_GUESS = 16, 32, 32
SEED = 10  # the window's random start, fixed (as Spec-Bench does)


@dataclass(frozen=True)
class LookaheadSettings:
    # on a 2-core CPU (Zen 1 EPYC, compiled q4, Spec-Bench 13 × 128; docs/BENCHMARKS.md) N=3, W=2, G=3
    # ran at 0.54x AR (1.22 tokens per forward for 6.3 rows); the paper's N=5, W=7, G=7 (the GPU
    # defaults: a wide forward costs about one row there) at 0.18x
    level: int = setting(3, "Level N (n-gram size; the window has N−1 levels)", low=3, high=MAX_LEVEL, gpu=5)
    window: int = setting(2, "Window W (Jacobi columns)", low=1, high=MAX_WINDOW, gpu=7)
    guess: int = setting(3, "Guess set G (candidates per step)", low=0, high=MAX_GUESS, gpu=7)
    pool_from_prompt: bool = setting(False, "Seed the n-gram pool with the prompt")

    def __post_init__(self):
        check_settings(self)


class NGramPool:
    """key token → up to `capacity` (N−1)-grams that followed it, most recently seen last."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: dict[int, OrderedDict[tuple[int, ...], str]] = {}

    def add(self, key: int, gram: tuple[int, ...], origin: str) -> None:
        grams = self.entries.setdefault(key, OrderedDict())
        if gram in grams:
            grams.move_to_end(gram)
            return
        if len(grams) >= self.capacity:
            grams.popitem(last=False)
        grams[gram] = origin

    def candidates(self, key: int) -> list[tuple[tuple[int, ...], str]]:
        return list(self.entries.get(key, {}).items())

    def __len__(self) -> int:
        return sum(len(g) for g in self.entries.values())


def trie(candidates: list[tuple[tuple[int, ...], str]], depth: int) -> tuple[list[int], list[int], list[str]]:
    """Candidates (cut to `depth`) merged on shared prefixes: node tokens, parents, origins."""
    tokens, parents, origins, index = [], [], [], {}
    for gram, origin in candidates:
        parent = -1
        for i in range(min(depth, len(gram))):
            key = gram[: i + 1]
            if key not in index:
                index[key] = len(tokens)
                tokens.append(gram[i])
                parents.append(parent)
                origins.append(origin)
            parent = index[key]
    return tokens, parents, origins


def window_layout(levels: int, width: int) -> tuple[list[tuple[int, int]], list[int], torch.Tensor]:
    """The window's (level, column) slots in input order, their position offsets from `cur`, and
    which slots each slot sees (level-0 columns ≤ its own, and its own column above it)."""
    slots = [(0, c) for c in range(1, width)] + [(lv, c) for lv in range(1, levels) for c in range(width)]
    offsets = [lv + c for lv, c in slots]
    seen = torch.zeros(len(slots), len(slots), dtype=torch.bool)
    for i, (lv, c) in enumerate(slots):
        for j, (lv2, c2) in enumerate(slots):
            seen[i, j] = (lv2 == 0 and c2 <= c) or (c2 == c and 1 <= lv2 <= lv)
    return slots, offsets, seen


def harvest(pool: NGramPool, cur: int, window: list[list[int]], new: list[int]) -> None:
    """One n-gram per column: (level-0 token, the column's tokens in levels 1.., the new token)."""
    row0 = [cur] + window[0]
    for c in range(len(new)):
        pool.add(row0[c], tuple(level[c] for level in window[1:]) + (new[c],), JACOBI)


def run(ctx: DecodeContext, settings: LookaheadSettings) -> Iterator[Step]:
    target = ctx.target_cache()
    n_levels, width = settings.level - 1, settings.window
    rng = random.Random(SEED)
    window = [[rng.choice(ctx.prompt_ids) for _ in range(width - (lv == 0))] for lv in range(n_levels)]
    slots, slot_offsets, slot_seen = window_layout(n_levels, width)
    pool = NGramPool(max(1, settings.guess))
    if settings.pool_from_prompt:
        p = ctx.prompt_ids
        for i in range(len(p) - settings.level + 1):
            pool.add(p[i], tuple(p[i + 1 : i + settings.level]), PROMPT)
    steps = StepRecorder(ctx)
    while steps.begin():
        seq = ctx.seq
        cur = seq[-1]
        # propose: pool n-grams that follow the current token, merged into a tree
        hits = pool.candidates(cur)[: settings.guess] if steps.index > 0 else []
        tokens, parents, origins = trie(hits, ctx.remaining - 1)
        extra = [t for level in window for t in level] + tokens
        offsets = slot_offsets + node_depths(parents)
        seen = torch.block_diag(slot_seen, tree_visibility(parents))
        steps.drafted()
        # verify: one forward over cur, the Jacobi window and the candidate tree
        fed = len(seq) - target.length + len(extra)
        # the window's rows only guess (no token is accepted from them): they need not be exact
        logits, _ = target.forward_hidden(seq, extra, offsets, seen, loose=tuple(range(len(slots))))
        steps.verified()
        # accept: the longest candidate path the target agrees with (rows: root, then nodes)
        decision = verify_tree(ctx, torch.cat([logits[:1], logits[1 + len(slots) :]]), tokens, parents)
        # Jacobi: the last level's outputs are the new level; harvest n-grams; shift the window
        new = logits[[1 + i for i, (lv, _) in enumerate(slots) if lv == n_levels - 1]].argmax(-1).tolist()
        if steps.index >= n_levels - 1:  # by now every level holds Jacobi outputs, not the random start
            harvest(pool, cur, window, new)
        window = [window[1][1:], *window[2:], new]
        # commit: the accepted candidates' key/values stay, the window's go
        ctx.output.extend(decision.tokens)
        target.keep(len(seq), [len(slots) + i for i in decision.cached_path])
        drafted = [DraftToken(t, o, 1.0, parent=par) for t, o, par in zip(tokens, origins, parents, strict=True)]
        extra = {"window": [list(level) for level in window], "pool_size": len(pool), "hits": len(hits)}
        yield steps.step(record(decision), drafted=drafted, input_tokens=fed, kv_len=target.length, extra=extra)


SPEC = StrategySpec(NAME, LookaheadSettings, run, SUMMARY)
