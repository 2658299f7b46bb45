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


@dataclass(frozen=True)
class TreeVerdict:
    """Outcome of verifying a token tree: the accepted path from the root, then the next token."""

    path: list[int]  # accepted node indices, root side first
    next_token: int
    next_origin: str  # "bonus" when the path ends at a leaf, else "resampled"
    rejected: list[int]  # nodes the rule judged and refused
    draws: dict[int, float]  # node → the uniform draw that judged it (sampling)


def chain_as_tree(verdict: Verdict, k: int) -> TreeVerdict:
    """A chain's verdict (k drafted tokens) as the verdict of the tree whose node i follows node i − 1."""
    rejected = [verdict.accepted] if verdict.accepted < k else []
    draws = {i: u for i, u in enumerate(verdict.draws) if u is not None}
    return TreeVerdict(list(range(verdict.accepted)), verdict.next_token, verdict.next_origin, rejected, draws)


def children_of(parents: list[int]) -> dict[int, list[int]]:
    """node (−1: the root) → its children, in order."""
    kids: dict[int, list[int]] = {-1: []}
    for i, parent in enumerate(parents):
        kids.setdefault(parent, []).append(i)
        kids.setdefault(i, [])
    return kids


def verify_tree_greedy(target_argmax: list[int], tokens: list[int], parents: list[int]) -> TreeVerdict:
    """Follow the target's argmax down the tree: the longest root path whose every token equals
    the target's choice after its prefix. target_argmax: one entry for the root, then per node.
    With one child per node this is `verify_greedy`."""
    kids = children_of(parents)
    node, path, rejected = -1, [], []
    while True:
        want = target_argmax[node + 1]
        match = [c for c in kids[node] if tokens[c] == want]
        rejected += [c for c in kids[node] if tokens[c] != want]
        if not match:
            break
        node = match[0]
        path.append(node)
    origin = "bonus" if not kids[node] else "resampled"
    return TreeVerdict(path, target_argmax[node + 1], origin, rejected, {})


def verify_tree_sampling(
    p_target: torch.Tensor, tokens: list[int], parents: list[int], generator: torch.Generator | None
) -> TreeVerdict:
    """Lossless verification of a tree of deterministic candidates (top-k guesses, n-grams).

    At each node the children are tried in order, each as a point-mass draft: accepted with
    probability min(1, p/q) = p(token) under the current distribution, else the distribution
    becomes the residual norm(max(0, p − δ_token)) and the next child is tried. If every child is
    refused the next token is drawn from what remains; after a leaf, from p (a bonus token). Each
    round emits exactly p, so the output is distributed as the target's (SpecInfer's multi-draft
    rule with deterministic drafts). With one child per node this is `verify_sampling` with q = δ.

    p_target: (n+1, V) warped target distributions, at the root then after each node.
    """
    kids = children_of(parents)
    node, path, rejected, draws = -1, [], [], {}
    while True:
        p = p_target[node + 1]
        chosen = None
        for c in kids[node]:
            u = float(torch.rand((), generator=generator, device=p.device))
            draws[c] = u
            if u < float(acceptance_probability(p[tokens[c]], torch.ones((), device=p.device))):
                chosen = c
                break
            rejected.append(c)
            p = residual_distribution(p, torch.nn.functional.one_hot(torch.tensor(tokens[c]), len(p)).to(p))
        if chosen is None:
            origin = "bonus" if not kids[node] else "resampled"
            return TreeVerdict(path, sample(p, generator), origin, rejected, draws)
        node = chosen
        path.append(node)


def typical_threshold(p: torch.Tensor, epsilon: float, delta: float) -> torch.Tensor:
    """Medusa's typical-acceptance floor for rows of p (..., V): min(ε, δ·exp(−H(p)))."""
    entropy = -(p * torch.log(p + 1e-5)).sum(-1)
    return torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))


def verify_tree_typical(
    p_target: torch.Tensor,
    tokens: list[int],
    parents: list[int],
    epsilon: float,
    delta: float,
    generator: torch.Generator | None = None,
) -> TreeVerdict:
    """Medusa's typical acceptance (lossy): a node passes when the target gives its token more than
    min(ε, δ·exp(−H)) at its parent; the longest root path of passing nodes wins (ties: the larger
    Σ log p). Then the target's argmax after it (or a draw from p, given a generator).

    p_target: (n+1, V), at the root then after each node.
    """
    kids = children_of(parents)
    floor = typical_threshold(p_target, epsilon, delta)  # (n+1,)
    rows = torch.tensor([par + 1 for par in parents], dtype=torch.long)
    p_tok = p_target[rows, tokens] if tokens else p_target.new_zeros(0)
    passes = (p_tok > floor[rows]).tolist()
    best: tuple[int, float, list[int]] = (0, 0.0, [])
    stack = [(-1, [], 0.0)]
    while stack:
        node, path, score = stack.pop()
        if (len(path), score) > best[:2]:
            best = (len(path), score, path)
        for c in kids[node]:
            if passes[c]:
                stack.append((c, path + [c], score + float(torch.log(p_tok[c]))))
    path = best[2]
    last = path[-1] if path else -1
    on_path = set(path)
    rejected = [c for n in [-1, *path] for c in kids[n] if c not in on_path]
    p = p_target[last + 1]
    next_token = int(torch.argmax(p)) if generator is None else sample(p, generator)
    return TreeVerdict(path, next_token, "bonus" if not kids[last] else "resampled", rejected, {})
