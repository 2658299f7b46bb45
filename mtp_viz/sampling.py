"""Logits → probabilities, sampling, and the speculative accept rule.

Everything here is a pure tensor function: probabilities in, decision out, no model and no cache,
so each rule can be tested on hand-made distributions. Names follow the papers: `p_target` is the
target model's distribution, `q_draft` the drafter's.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Warp:
    """How logits become the distribution tokens are drawn from. temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs_from_logits(logits: torch.Tensor, warp: Warp) -> torch.Tensor:
    """Warped distribution over the vocabulary for each row of `logits` (..., V).

    Order as in transformers: temperature, then top-k, then top-p. Greedy returns the plain softmax
    (what the trace shows as p and q); decisions in greedy mode use the argmax.
    """
    if warp.greedy:
        return torch.softmax(logits, dim=-1)
    logits = logits / warp.temperature
    if warp.top_k > 0 and warp.top_k < logits.shape[-1]:
        kth = torch.topk(logits, warp.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if warp.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= warp.top_p  # keeps the smallest prefix reaching top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id drawn from a single distribution (V,)."""
    return int(torch.multinomial(probs, 1, generator=generator))


def acceptance_probability(p_target: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """min(1, p/q) elementwise: the chance of keeping a drafted token (Leviathan et al., Chen et al.).

    Tokens the drafter cannot propose (q = 0) get 1; they are never drafted.
    """
    return torch.where(q_draft > 0, torch.clamp(p_target / q_draft, max=1.0), 1.0)


def residual_distribution(p_target: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p − q)) (V,): where a rejected draft resamples from.

    When p ≤ q everywhere up to rounding the residual vanishes; a rejection is then only possible
    through rounding, and p itself is the right fallback.
    """
    residual = torch.clamp(p_target - q_draft, min=0.0)
    total = residual.sum()
    if total <= 1e-12:
        return p_target
    return residual / total


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft block: how many drafted tokens were kept, then the next token."""

    accepted: int
    next_token: int
    next_origin: str  # "bonus" when every draft was accepted, else "resampled" (from the target)
    draws: list[float | None]  # the uniform draw that decided each verified position


def verify_greedy(target_argmax: list[int], draft_ids: list[int]) -> Verdict:
    """Keep the longest prefix of the draft that equals the target's argmax.

    target_argmax has len(draft_ids) + 1 entries: the target's choice after each prefix.
    """
    accepted = 0
    while accepted < len(draft_ids) and draft_ids[accepted] == target_argmax[accepted]:
        accepted += 1
    origin = "bonus" if accepted == len(draft_ids) else "resampled"
    return Verdict(accepted, target_argmax[accepted], origin, [None] * min(accepted + 1, len(draft_ids)))


def verify_sampling(
    p_target: torch.Tensor,
    q_draft: torch.Tensor,
    draft_ids: list[int],
    generator: torch.Generator | None,
) -> Verdict:
    """Speculative sampling: accept token i with probability min(1, p/q); at the first rejection
    resample from norm(max(0, p − q)); if all are accepted draw a bonus token from p.

    p_target: (k+1, V) target distributions after each draft prefix; q_draft: (k, V).
    """
    k = len(draft_ids)
    ids = torch.tensor(draft_ids, dtype=torch.long, device=p_target.device)
    p_tok = p_target[:k].gather(-1, ids[:, None])[:, 0]  # (k,)
    q_tok = q_draft.gather(-1, ids[:, None])[:, 0]  # (k,)
    keep = acceptance_probability(p_tok, q_tok)  # (k,)
    u = torch.rand(k, generator=generator, device=p_target.device)  # (k,)
    rejected = (u >= keep).tolist()
    accepted = rejected.index(True) if True in rejected else k
    draws = u[: min(accepted + 1, k)].tolist()
    if accepted == k:
        return Verdict(k, sample(p_target[k], generator), "bonus", draws)
    residual = residual_distribution(p_target[accepted], q_draft[accepted])
    return Verdict(accepted, sample(residual, generator), "resampled", draws)
