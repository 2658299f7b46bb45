"""What every strategy shares: generation settings, the decoding context, drafting a token,
chain and tree verification (each returns a decision.Decision), and the step recorder.

A strategy is a generator `run(ctx, settings) -> Iterator[Step]` that yields one Step per target
forward, as it happens. It knows its algorithm and nothing about the UI. Every loop has one shape:

    steps = StepRecorder(ctx)
    while steps.begin():
        ...propose...;  steps.drafted()
        ...verify...;   steps.verified()
        ...accept (a Decision), commit...
        yield steps.step(record(decision), drafted=..., input_tokens=..., kv_len=...)
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
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
    chain_as_tree,
    probs_from_logits,
    sample,
    verify_greedy,
    verify_sampling,
    verify_tree_greedy,
    verify_tree_sampling,
)
from mtp_viz.strategies.decision import Decision, Outcome
from mtp_viz.strategies.settings import MAX_TEMPERATURE, MAX_TOP_K, check_float, check_int
from mtp_viz.trace import ACCEPTED, AUTOREGRESSIVE, DraftToken, Step

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
    # the settings fitted to the drafter loaded (settings, its Drafting) → settings; what the trace records
    fit: Callable[[Any, Any], Any] | None = None

    def drafters(self, settings: Any) -> tuple[DrafterKind, ...]:
        return self.drafter(settings) if callable(self.drafter) else self.drafter

    def fitted(self, settings: Any, drafting: Any) -> Any:
        return self.fit(settings, drafting) if self.fit else settings

    @property
    def needs_draft(self) -> bool:
        return self.drafter == (DrafterKind.DRAFT_MODEL,)

    def is_lossless(self, settings: dict) -> bool:
        """Whether a run with these settings (a trace's `settings`) is lossless."""
        return self.lossless and not (self.lossy_when and self.lossy_when(settings))


def verify_chain(
    ctx: DecodeContext,
    target_logits: torch.Tensor,
    draft_ids: list[int],
    q_draft: torch.Tensor | None,
) -> Decision:
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
    decision = decide(ctx, chain_as_tree(verdict, k), p_target, draft_ids, list(range(-1, k - 1)))
    # cut at an EOS among the accepted tokens, a chain shows no rejection after it
    return decision if decision.accepted == verdict.accepted else replace(decision, rejected=())


def verify_tree(ctx: DecodeContext, logits: torch.Tensor, tokens: list[int], parents: list[int]) -> Decision:
    """Exact (lossless) verification of a token tree. logits: (1+n, V), the target's at the root
    then after each node."""
    if ctx.warp.greedy:
        p_target = torch.softmax(logits, -1) if ctx.record_probs else None
        verdict = verify_tree_greedy(logits.argmax(-1).tolist(), tokens, parents)
    else:
        p_target = probs_from_logits(logits, ctx.warp)
        verdict = verify_tree_sampling(p_target, tokens, parents, ctx.generator)
    return decide(ctx, verdict, p_target, tokens, parents)


def decide(
    ctx: DecodeContext, verdict: TreeVerdict, p_target: torch.Tensor | None, tokens: list[int], parents: list[int]
) -> Decision:
    """A tree verdict as the step's decision: the accepted path's tokens, then the target's own,
    cut at EOS / budget. p_target (1+n, V): the distributions the rule judged with, at the root then
    after each node (None: not recorded), read for each drafted and committed token's p."""
    committed = ctx.clip([tokens[i] for i in verdict.path] + [verdict.next_token])
    path = verdict.path[: len(committed)]
    own = len(committed) - len(path)  # the target's own token: 1, or 0 when cut before it
    p_drafted: list[float | None] = [None] * len(tokens)
    p_own = None
    if p_target is not None and tokens:
        rows = torch.tensor([par + 1 for par in parents], dtype=torch.long, device=p_target.device)
        p_drafted = p_target[rows, tokens].tolist()
    if p_target is not None and own:
        p_own = float(p_target[path[-1] + 1 if path else 0, verdict.next_token])
    return Decision(
        drafted=len(tokens),
        path=tuple(path),
        rejected=tuple(verdict.rejected),
        tokens=tuple(committed),
        origins=(ACCEPTED,) * len(path) + (verdict.next_origin if tokens else AUTOREGRESSIVE,) * own,
        p_target=tuple(p_drafted),
        p_tokens=tuple(p_drafted[i] for i in path) + (p_own,) * own,
        draws=tuple(verdict.draws.get(i) for i in range(len(tokens))),
    )


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
