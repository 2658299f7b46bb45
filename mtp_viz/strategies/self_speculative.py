"""Self-speculative decoding: the target drafts with its own first L layers, then its final norm
and head (an early exit, as in LayerSkip, Elhoushi et al. 2024 and Draft & Verify, Zhang et al.
2024), and verifies with the full model. Lossless.

Draft and target share weights and one KV cache. A drafted token passes layers 0..L−1 once, while
drafting; verification runs only layers L..N−1 over the block, starting from the hidden states the
draft left at layer L. So the early layers' key/values are computed once per token, by the draft,
and kept for the accepted tokens. An untrained exit agrees with the full model rarely; the trace
shows how rarely, layer by layer (try several L).

Works with decoder layers of the Llama family (Llama, Qwen2, Mistral in transformers).
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from mtp_viz.errors import UserError
from mtp_viz.lean import lean_model, supports
from mtp_viz.strategies.base import DecodeContext, StepRecorder, StrategySpec, chain_drafts, draft_tokens, verify_chain
from mtp_viz.strategies.decision import record
from mtp_viz.strategies.settings import check_settings, setting
from mtp_viz.trace import Step
from mtp_viz.visibility import causal_after

NAME = "self_speculative"
SUMMARY = "The target's first L layers draft (early exit); the remaining layers verify, sharing the KV cache."
MAX_DRAFT_TOKENS = 64
MAX_LAYERS = 256
EXIT_SOURCE = "early_exit"


@dataclass(frozen=True)
class SelfSpeculativeSettings:
    exit_layer: int = setting(8, "Exit layer L (the draft is layers 0..L−1)", low=1, high=MAX_LAYERS)
    # on a 2-core CPU (Zen 1 EPYC, compiled q4, Spec-Bench 13 × 128) 2 drafts ran at 0.46x AR, 4 at
    # 0.31x: layers 0-7 of 30 guess the next token ~6% of the time, so a longer draft only costs
    num_draft_tokens: int = setting(2, "Draft tokens per step", low=1, high=MAX_DRAFT_TOKENS, gpu=4)

    def __post_init__(self):
        check_settings(self)


class SplitModel:
    """One model run as two stacks of layers over one KV cache: lower (0..L−1), upper (L..N−1)."""

    def __init__(self, model, exit_layer: int, vocab_size: int, prompt_length: int):
        self.lean = lean_model(model)
        if self.lean is None:
            raise UserError(f"self-speculative decoding needs a Llama-family model: {supports(model)}")
        layers = len(self.lean.layers)
        if not 1 <= exit_layer < layers:
            raise UserError(f"exit_layer must be from 1 to {layers - 1} for this model, got {exit_layer}")
        self.exit, self.layers = exit_layer, layers
        self.vocab_size = vocab_size
        self.kv = self.lean.new_cache()
        self.lower_len = self.upper_len = 0  # cached positions in the lower and upper layers
        self.exact_from = prompt_length - 1  # rows after the prompt's prefill: as one-token forwards (kv_slots.RowKeys)

    def _run(self, hidden: torch.Tensor, layers: tuple[int, int], past: int) -> torch.Tensor:
        n = hidden.shape[0]
        allowed = causal_after(past, n) if n > 1 else None
        return self.lean.run(hidden, list(range(past, past + n)), self.kv, past, allowed, layers, self.exact_from)

    @torch.inference_mode()
    def lower(self, tokens: list[int]) -> torch.Tensor:
        """Embed `tokens` and run the early layers: hidden states at layer L (n, H)."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self.lean.device)
        out = self._run(self.lean.embed(ids), (0, self.exit), self.lower_len)
        self.lower_len += len(tokens)
        return out

    @torch.inference_mode()
    def upper(self, hidden: torch.Tensor) -> torch.Tensor:
        """Run the late layers on layer-L hidden states (n, H); logits (n, V)."""
        out = self._run(hidden, (self.exit, self.layers), self.upper_len)
        self.upper_len += hidden.shape[0]
        return self.logits(out)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm and head on (n, H): the early exit's logits at layer L, or the model's own."""
        return self.lean.logits(self.lean.norm(hidden))[:, : self.vocab_size].float()

    def crop(self, length: int) -> None:
        """Both stacks forget every position >= length (the slots are simply overwritten later)."""
        self.lower_len, self.upper_len = min(self.lower_len, length), min(self.upper_len, length)


def propose(ctx: DecodeContext, model: SplitModel, root: int, k: int):
    """Draft k tokens with the early exit. Returns ids, the warped draft distributions (k, V) when
    sampling, each token's q, and the layer-L hidden states of root and all drafted tokens."""
    ids, dists, q, states = [], [], [], []
    token = root
    for _ in range(k):
        h = model.lower([token])  # (1, H)
        states.append(h)
        guess, q_draft, q_token = draft_tokens(ctx, model.logits(h))
        token = guess[0]
        ids.append(token)
        q += q_token
        if q_draft is not None:
            dists.append(q_draft)
    states.append(model.lower([token]))  # the last guess (or the root) through the early layers too
    return ids, (torch.cat(dists) if dists else None), q, torch.cat(states)


def run(ctx: DecodeContext, settings: SelfSpeculativeSettings) -> Iterator[Step]:
    model = SplitModel(ctx.target, settings.exit_layer, ctx.vocab_size, len(ctx.prompt_ids))
    steps = StepRecorder(ctx)
    while steps.begin():
        seq = ctx.seq
        if steps.index == 0:  # prefill: the prompt through every layer, no draft yet
            ids, q_draft, q = [], None, []
            logits = model.upper(model.lower(seq))[-1:]  # (1, V)
            fed = len(seq)
        else:
            k = min(settings.num_draft_tokens, ctx.remaining - 1)
            # propose: the early exit guesses k tokens, leaving their layer-L states behind
            ids, q_draft, q, states = propose(ctx, model, seq[-1], k)
            steps.drafted()
            # verify: the late layers score root + guesses in one pass from those states
            logits = model.upper(states)  # (k+1, V)
            fed = k + 1
        steps.verified()
        # accept: the longest acceptable prefix, then the target's own token
        decision = verify_chain(ctx, logits, ids, q_draft)
        # commit: both stacks keep the accepted tokens' key/values
        ctx.output.extend(decision.tokens)
        model.crop(len(ctx.seq) - 1)
        drafted = chain_drafts(ids, EXIT_SOURCE, q)
        extra = {"draft_len": len(ids), "exit_layer": settings.exit_layer}
        yield steps.step(
            record(decision),
            drafted=drafted,
            draft_forwards=len(ids),
            input_tokens=fed,
            kv_len=model.upper_len,
            extra=extra,
        )


SPEC = StrategySpec(NAME, SelfSpeculativeSettings, run, SUMMARY)
