"""What every strategy shares: generation settings, the decoding context, drafting a token,
chain and tree verification, and the step recorder.

A strategy is a generator `run(ctx, settings) -> Iterator[Step]` that yields one Step per target
forward, as it happens. It knows its algorithm and nothing about the UI. Every loop has one shape:

    steps = StepRecorder(ctx)
    while steps.begin():
        ...propose...;  steps.drafted()
        ...verify...;   steps.verified()
        ...accept, commit...
        yield steps.step(outcome, drafted=..., input_tokens=..., kv_len=...)
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from mtp_viz.cache import CachedModel
from mtp_viz.clock import Clock
from mtp_viz.drafters.kinds import DrafterKind
from mtp_viz.errors import InvalidSettingsError
from mtp_viz.sampling import (
    TreeVerdict,
    Warp,
    probs_from_logits,
    sample,
    verify_greedy,
    verify_sampling,
    verify_tree_greedy,
    verify_tree_sampling,
)
from mtp_viz.strategies.settings import MAX_TEMPERATURE, MAX_TOP_K, check_float, check_int
from mtp_viz.trace import (
    ACCEPTED,
    AUTOREGRESSIVE,
    VERDICT_ACCEPTED,
    VERDICT_REJECTED,
    VERDICT_SKIPPED,
    DraftToken,
    EmittedToken,
    Step,
)

MAX_NEW_TOKENS_LIMIT = 4096


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    seed: int = 0

    def __post_init__(self):
        check_int("max_new_tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS_LIMIT)
        check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        check_int("top_k", self.top_k, 0, MAX_TOP_K)
        check_float("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise InvalidSettingsError("top_p must be in (0, 1]; use temperature 0 for greedy decoding")
        check_int("seed", self.seed, 0, 2**63 - 1)

    @property
    def warp(self) -> Warp:
        return Warp(self.temperature, self.top_k, self.top_p)


@dataclass
class DecodeContext:
    """Everything a strategy needs for one run. Batch size 1 by design."""

    target: PreTrainedModel
    prompt_ids: list[int]
    generation: GenerationSettings
    eos_token_ids: frozenset[int]
    vocab_size: int  # shared by target and draft; wider logits (padding) are cut to this
    clock: Clock
    generator: torch.Generator | None = None
    draft: PreTrainedModel | None = None
    heads: Any = None  # MTPHeads (mtp_viz.drafters.heads) for strategies that need them
    eagle3: Any = None  # Eagle3Drafter (mtp_viz.drafters.eagle3) for strategies that need one
    mask_token_id: int | None = None  # for mask-token MTP models (models.yaml `mask_token_id`)
    record_probs: bool = True  # False: minimal recording, for measuring what tracing costs
    output: list[int] = field(default_factory=list)

    @property
    def warp(self) -> Warp:
        return self.generation.warp

    @property
    def remaining(self) -> int:
        return self.generation.max_new_tokens - len(self.output)

    @property
    def done(self) -> bool:
        return self.remaining <= 0 or (bool(self.output) and self.output[-1] in self.eos_token_ids)

    @property
    def seq(self) -> list[int]:
        return self.prompt_ids + self.output

    def target_cache(self) -> CachedModel:
        """The target with a KV cache, its rows after the prompt computed as one-token forwards
        compute them (CachedModel's prompt_length): what makes a verify exactly autoregressive."""
        return CachedModel(self.target, self.vocab_size, len(self.prompt_ids))

    def clip(self, tokens: list[int]) -> list[int]:
        """Cut a block of new tokens exactly where autoregressive decoding would stop: after the
        first EOS, or at the token budget."""
        tokens = tokens[: self.remaining]
        for i, t in enumerate(tokens):
            if t in self.eos_token_ids:
                return tokens[: i + 1]
        return tokens

    def next_token(self, logits: torch.Tensor) -> tuple[int, float | None]:
        """The target's own next token from logits (V,): argmax, or a draw from the warped probs."""
        ids, _, p = draft_tokens(self, logits[None])
        return ids[0], p[0]


def draft_tokens(ctx: DecodeContext, logits: torch.Tensor) -> tuple[list[int], torch.Tensor | None, list]:
    """One token per row of a drafter's logits (n, V): the argmax, or a draw from the warped
    distribution. Returns the ids, the distributions q_draft (n, V) when sampling (verification
    needs them; None when greedy) and each token's q (None when greedy and not recording)."""
    if ctx.warp.greedy:
        ids = logits.argmax(-1).tolist()
        if not ctx.record_probs:
            return ids, None, [None] * len(ids)
        return ids, None, torch.softmax(logits, -1)[torch.arange(len(ids)), ids].tolist()
    q_draft = probs_from_logits(logits, ctx.warp)  # (n, V)
    ids = [sample(row, ctx.generator) for row in q_draft]
    return ids, q_draft, [float(q_draft[i, t]) for i, t in enumerate(ids)]


@dataclass(frozen=True)
class StrategySpec:
    name: str
    settings_cls: type
    run: Callable[[DecodeContext, Any], Iterator[Step]]
    summary: str
    lossless: bool = True
    # the drafter kinds it drafts with, the first the target has (or f(settings) → kinds)
    drafter: tuple[DrafterKind, ...] | Callable[[Any], tuple[DrafterKind, ...]] = ()
    lossy_when: Callable[[dict], bool] | None = None  # settings (as in a trace) that make it lossy

    def drafters(self, settings: Any) -> tuple[DrafterKind, ...]:
        return self.drafter(settings) if callable(self.drafter) else self.drafter

    @property
    def needs_draft(self) -> bool:
        return self.drafter == (DrafterKind.DRAFT_MODEL,)

    def is_lossless(self, settings: dict) -> bool:
        """Whether a run with these settings (a trace's `settings`) is lossless."""
        return self.lossless and not (self.lossy_when and self.lossy_when(settings))


@dataclass
class Outcome:
    """A step's result as the trace records it: what was emitted, and per drafted token its
    verdict, p_target and the uniform draw that decided it."""

    emitted: list[EmittedToken]
    verdicts: list[str] = field(default_factory=list)
    target_p: list[float | None] = field(default_factory=list)
    draws: list[float | None] = field(default_factory=list)


@dataclass
class ChainResult(Outcome):
    """A verified chain draft, ready to commit."""

    tokens: list[int] = field(default_factory=list)  # what to emit, already clipped at EOS / budget


def verify_chain(
    ctx: DecodeContext,
    target_logits: torch.Tensor,
    draft_ids: list[int],
    q_draft: torch.Tensor | None,
) -> ChainResult:
    """Verify a chain of drafted tokens against the target's logits after each prefix.

    target_logits: (k+1, V). q_draft: (k, V) drafter distributions, or None for a deterministic
    drafter (n-gram lookup), which is a point mass on each drafted token.
    """
    k = len(draft_ids)
    if ctx.warp.greedy:
        verdict = verify_greedy(target_logits.argmax(-1).tolist(), draft_ids)
        p_target = torch.softmax(target_logits, -1) if ctx.record_probs else None
    else:
        p_target = probs_from_logits(target_logits, ctx.warp)  # (k+1, V)
        if q_draft is None:
            q_draft = torch.zeros_like(p_target[:k]).scatter_(
                -1, torch.tensor(draft_ids, dtype=torch.long, device=p_target.device)[:, None], 1.0
            )
        verdict = verify_sampling(p_target, q_draft, draft_ids, ctx.generator)
    tokens = ctx.clip(draft_ids[: verdict.accepted] + [verdict.next_token])
    kept = min(verdict.accepted, len(tokens))
    verdicts = [VERDICT_ACCEPTED] * kept + [VERDICT_SKIPPED] * (k - kept)
    if kept == verdict.accepted < k:
        verdicts[kept] = VERDICT_REJECTED
    p_list: list[float | None] = [None] * k
    p_next = None
    if p_target is not None:
        p_list = p_target[torch.arange(k, device=p_target.device), draft_ids].tolist() if k else []
        p_next = float(p_target[verdict.accepted, verdict.next_token])
    emitted = [EmittedToken(t, ACCEPTED, p_list[i]) for i, t in enumerate(tokens[:kept])]
    if len(tokens) > kept:
        emitted.append(EmittedToken(tokens[kept], verdict.next_origin if k else AUTOREGRESSIVE, p_next))
    draws = verdict.draws + [None] * (k - len(verdict.draws))
    return ChainResult(emitted, verdicts, p_list, draws, tokens)


def verify_tree(ctx: DecodeContext, logits: torch.Tensor, tokens: list[int], parents: list[int]):
    """Exact (lossless) verification of a token tree: (TreeVerdict, p_target (1+n, V) or None).

    logits: (1+n, V), the target's at the root then after each node."""
    if ctx.warp.greedy:
        p_target = torch.softmax(logits, -1) if ctx.record_probs else None
        return verify_tree_greedy(logits.argmax(-1).tolist(), tokens, parents), p_target
    p_target = probs_from_logits(logits, ctx.warp)
    return verify_tree_sampling(p_target, tokens, parents, ctx.generator), p_target


def record_tree(
    verdict: TreeVerdict, p_target, tokens: list[int], parents: list[int], emitted_ids: list[int]
) -> Outcome:
    """Verdicts, p and draws per node, and the emitted tokens (accepted path, then the target's
    own token), for a tree verdict whose emission `emitted_ids` may have been cut at EOS/budget."""
    kept = verdict.path[: len(emitted_ids)]
    verdicts = [VERDICT_SKIPPED] * len(tokens)
    for i in verdict.rejected:
        verdicts[i] = VERDICT_REJECTED
    for i in kept:
        verdicts[i] = VERDICT_ACCEPTED
    target_p: list[float | None] = [None] * len(tokens)
    if p_target is not None and tokens:
        rows = torch.tensor([par + 1 for par in parents], dtype=torch.long, device=p_target.device)
        target_p = p_target[rows, tokens].tolist()
    emitted = [EmittedToken(tokens[i], ACCEPTED, target_p[i]) for i in kept]
    if len(emitted_ids) > len(kept):
        row = kept[-1] + 1 if kept else 0
        p_next = None if p_target is None else float(p_target[row, verdict.next_token])
        emitted.append(EmittedToken(verdict.next_token, verdict.next_origin if tokens else AUTOREGRESSIVE, p_next))
    draws = [verdict.draws.get(i) for i in range(len(tokens))]
    return Outcome(emitted, verdicts, target_p, draws)


def chain_drafts(ids: list[int], source: str, q: list[float | None]) -> list[DraftToken]:
    return [DraftToken(t, source, qi) for t, qi in zip(ids, q, strict=True)]


DRAFT, VERIFY = "draft", "verify"


class StepRecorder:
    """A strategy's steps as they happen: owns the clock readings and the step index, and builds
    each Step. `drafted()` / `verified()` end a phase: the time since the previous one ended (or
    the step began) is the phase's."""

    def __init__(self, ctx: DecodeContext):
        self.ctx, self.clock = ctx, ctx.clock
        self.index = 0  # of the step being recorded

    def begin(self) -> bool:
        """Start the next step's clock; False once decoding is done (EOS or the token budget)."""
        if self.ctx.done:
            return False
        self._start = self._last = self.clock.now()
        self._phases = {DRAFT: 0.0, VERIFY: 0.0}
        return True

    def drafted(self) -> None:
        self._end_phase(DRAFT)

    def verified(self) -> None:
        self._end_phase(VERIFY)

    def _end_phase(self, phase: str) -> None:
        now = self.clock.now()
        self._phases[phase] += now - self._last
        self._last = now

    def step(self, outcome: Outcome, **fields: Any) -> Step:
        """Close the step: its Step, with the outcome, the phases' times and `fields` (counts,
        drafted tokens, extra). One target forward unless `target_forwards` says otherwise."""
        end = self.clock.now()
        fields.setdefault("target_forwards", 1)
        step = Step(
            index=self.index,
            emitted=outcome.emitted,
            verdicts=outcome.verdicts,
            target_p=outcome.target_p,
            draws=outcome.draws,
            draft_s=self._phases[DRAFT],
            verify_s=self._phases[VERIFY],
            step_s=end - self._start,
            **fields,
        )
        self.index += 1
        return step
