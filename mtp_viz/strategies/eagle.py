"""EAGLE-3 (Li et al., 2025) drafting EAGLE-2 dynamic trees (Li et al., 2024), verified by the target.

The drafter (mtp_viz.drafters.eagle3) reads the target's residual stream at a low, a middle and a
high layer (its `aux_layer_ids`), fused, beside the next token's embedding, and keeps its own KV
cache. Each step:
- propose: feed the drafter the positions the target committed last step (their features come
  from that verify forward); the last row gives the draft distribution after the last emitted
  token. Then grow the tree level by level: expand the `branching` newest nodes with the highest
  cumulative draft probability (the product of the drafter's probabilities along the path) in one
  batched drafter forward under a tree mask, `branching` children each; after `depth` levels keep
  the `nodes` best of every drafted node (EAGLE-2's rerank). `chain`: the top guess per depth.
- verify: the target scores every node in one forward with a tree mask, tapping the features.
- accept: greedy, the longest root path whose tokens are the target's argmax, then its own token.
  Sampling, exact: the candidates are deterministic (top-ranked draft tokens), so each child is
  tried as a point-mass draft, accepted with probability p(token) under the current distribution,
  which after a refusal becomes the residual norm(max(0, p − δ_token)); when every child is refused
  the token is drawn from what remains (SpecInfer's multi-draft rule with deterministic drafts,
  `verify_tree_sampling`: each round emits exactly p). The drafter's q is recorded, not used by it.
- commit: keep the accepted nodes' key/values; their feature rows feed the drafter next step.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch

from mtp_viz.drafters.kinds import DrafterKind
from mtp_viz.strategies.base import DecodeContext, StepRecorder, StrategySpec, verify_tree
from mtp_viz.strategies.decision import record
from mtp_viz.strategies.settings import check_settings, setting
from mtp_viz.trace import DraftToken, Step
from mtp_viz.visibility import node_depths, tree_visibility

NAME = "eagle"
SUMMARY = (
    "An EAGLE-3 drafter reads the target's hidden states and drafts a dynamic tree; one target forward verifies it."
)
CHAIN, DYNAMIC = "chain", "dynamic"
DRAFT_TREES = (CHAIN, DYNAMIC)
MAX_DEPTH = 16
MAX_BRANCHING = 16
MAX_NODES = 128
LAST_ROW = slice(-1, None)  # a propose drafts from its last row only: the head scores that row alone


@dataclass(frozen=True)
class EagleSettings:
    # CPU: one draft, measured fastest with the shipped drafter on Spec-Bench (13 prompts x 128 tokens,
    # q4, 2-core AMD EPYC, 2026-12-05; assets/bench/cpu-smollm2-135m-eagle): a chain of 1 ran at 0.88x
    # AR (1.30 tokens per forward), of 2 at 0.76x (1.37), of 3 at 0.66x (1.40), dynamic trees of 4-8
    # nodes at 0.37-0.47x (1.52-1.65): a q4 verify costs 1.26x a one-token forward at 2 rows and more
    # per row after, and the drafter ~3 ms a step. The GPU defaults are EAGLE-2's scale (top-10, ~60
    # nodes), where a wide verify costs little more than a narrow one: not measured (no GPU lent).
    draft_tree: str = setting(
        CHAIN, "Draft: chain (top guess per depth) or dynamic (EAGLE-2 tree)", choices=DRAFT_TREES, gpu=DYNAMIC
    )
    depth: int = setting(1, "Draft depth (drafter steps)", low=1, high=MAX_DEPTH, gpu=6)
    branching: int = setting(
        4,
        "Dynamic tree: children per expanded node and nodes expanded per depth (EAGLE-2's top-k)",
        low=1,
        high=MAX_BRANCHING,
        gpu=10,
    )
    nodes: int = setting(8, "Dynamic tree: nodes kept after the rerank", low=1, high=MAX_NODES, gpu=60)

    def __post_init__(self):
        check_settings(self)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(depth, children per expanded node, nodes kept): a chain is a tree of one child per node."""
        return (self.depth, 1, self.depth) if self.draft_tree == CHAIN else (self.depth, self.branching, self.nodes)


@dataclass
class DraftTree:
    """Drafted nodes in creation order, so parents come before children."""

    ids: list[int] = field(default_factory=list)  # draft-vocabulary ids
    parents: list[int] = field(default_factory=list)  # −1: a child of the root (the last emitted token)
    q: list[float] = field(default_factory=list)  # the drafter's probability of the node after its path
    score: list[float] = field(default_factory=list)  # cumulative: the product of q along the path
    rank: list[int] = field(default_factory=list)  # among its parent's drafted children (0: the top guess)

    def add_children(self, parent: int, probs: torch.Tensor, k: int) -> list[int]:
        """The k most probable tokens of probs (draft_V,) as children of `parent`; their indices."""
        top = torch.topk(probs, min(k, probs.shape[-1]))
        base = 1.0 if parent < 0 else self.score[parent]
        added = []
        for rank, (token, q) in enumerate(zip(top.indices.tolist(), top.values.tolist(), strict=True)):
            added.append(len(self.ids))
            self.ids.append(token)
            self.parents.append(parent)
            self.q.append(q)
            self.score.append(base * q)
            self.rank.append(rank)
        return added

    def ancestors(self, node: int) -> list[int]:
        """The node's ancestors, nearest first (the root excluded)."""
        out = []
        while (node := self.parents[node]) >= 0:
            out.append(node)
        return out

    def rank_paths(self) -> list[list[int]]:
        """Each node's ranks from the root: [0, 1] = the drafter's second guess after its first."""
        paths: list[list[int]] = []
        for parent, rank in zip(self.parents, self.rank, strict=True):
            paths.append((paths[parent] if parent >= 0 else []) + [rank])
        return paths

    def subset(self, keep: list[int]) -> "DraftTree":
        """The nodes `keep` (ascending, closed under ancestors), renumbered."""
        new = {old: i for i, old in enumerate(keep)}
        parents = [new[self.parents[i]] if self.parents[i] >= 0 else -1 for i in keep]
        ids, q, score, rank = ([values[i] for i in keep] for values in (self.ids, self.q, self.score, self.rank))
        return DraftTree(ids, parents, q, score, rank)


def best(score: list[float], candidates, k: int) -> list[int]:
    """The k candidates with the highest cumulative probability, best first; ties: the earlier node."""
    return sorted(candidates, key=lambda i: (-score[i], i))[:k]


def grow(
    root_probs: torch.Tensor,
    expand: Callable[[DraftTree, list[int]], torch.Tensor],
    depth: int,
    branching: int,
    nodes: int,
) -> DraftTree:
    """EAGLE-2's dynamic draft tree. root_probs (draft_V,): the draft distribution after the last
    emitted token; expand(tree, frontier) → (len(frontier), draft_V): each frontier node's children's
    distribution (one batched drafter forward). Each level expands the `branching` best nodes of
    the newest level; then the `nodes` best of all are kept. A child's score (its parent's times
    q <= 1) never exceeds its parent's and it was made later, so the kept set holds every kept
    node's ancestors, and creation order puts parents first."""
    tree = DraftTree()
    level = tree.add_children(-1, root_probs, branching)
    for _ in range(depth - 1):
        frontier = best(tree.score, level, branching)
        probs = expand(tree, frontier)  # (f, draft_V)
        level = [c for node, p in zip(frontier, probs, strict=True) for c in tree.add_children(node, p, branching)]
    return tree.subset(sorted(best(tree.score, range(len(tree.ids)), nodes)))


class Drafting:
    """The drafter's side of a run: its KV cache, which holds the positions the target committed
    (rows computed from the target's features), and the committed positions' features not read yet."""

    def __init__(self, drafter, capacity: int):
        self.drafter = drafter
        self.cache = drafter.new_cache(capacity)
        self.dtype = drafter.dtype
        self.pending: torch.Tensor | None = None  # (m, F) features of positions cache.length, …
        self.forwards = 0  # drafter forwards so far
        self.committed = 0  # the cache's rows that hold committed positions; tree rows follow them
        self.rows: dict[int, tuple[int, torch.Tensor]] = {}  # fed node → (cache slot, its output (H,))
        self.root_out: torch.Tensor | None = None  # the output (H,) that drafted the root's children

    def read(self, features: torch.Tensor) -> None:
        """Features (m, F) of the next committed positions, in order."""
        features = features.to(self.dtype)
        self.pending = features if self.pending is None else torch.cat([self.pending, features])

    @torch.inference_mode()
    def propose(self, seq: list[int], depth: int, branching: int, nodes: int) -> DraftTree:
        """Feed the pending positions i (hidden: fuse(features at i), token: seq[i+1]), grow the
        tree from the last row, then forget the tree's rows (crop to the committed positions)."""
        start, m = self.cache.length, len(self.pending)
        assert start + m == len(seq) - 1, "the drafter reads every committed position but the last token's"
        device = self.pending.device
        tokens = torch.tensor(seq[start + 1 :], dtype=torch.long, device=device)
        positions = torch.arange(start, start + m, device=device)
        hidden = self.drafter.fuse(self.pending)  # (m, H)
        logits, out = self.drafter(hidden, tokens, positions, self.cache, read=LAST_ROW)  # (1, dV), (m, H)
        self.pending, self.committed, self.rows, self.root_out = None, start + m, {}, out[-1]
        self.forwards += 1
        tree = grow(torch.softmax(logits[0].float(), -1), self.expand, depth, branching, nodes)
        self.cache.crop(self.committed)
        return tree

    def expand(self, tree: DraftTree, frontier: list[int]) -> torch.Tensor:
        """One drafter forward over the frontier nodes: hidden = their parent's output, token =
        their own, position = their parent's + 1; each sees the committed cache, its ancestors' rows
        and itself. Returns their children's draft distributions (f, draft_V)."""
        past, f = self.cache.length, len(frontier)
        device = self.root_out.device
        mask = torch.zeros(f, past + f, dtype=torch.bool)
        mask[:, : self.committed] = True
        for r, node in enumerate(frontier):
            mask[r, [self.rows[a][0] for a in tree.ancestors(node)] + [past + r]] = True
        parents = [tree.parents[n] for n in frontier]
        hidden = torch.stack([self.root_out if p < 0 else self.rows[p][1] for p in parents])  # (f, H)
        ids = torch.tensor([tree.ids[n] for n in frontier], device=device)
        positions = torch.tensor([self.committed + len(tree.ancestors(n)) for n in frontier], device=device)
        logits, out = self.drafter(hidden, self.drafter.to_target_ids(ids), positions, self.cache, mask.to(device))
        self.rows |= {node: (past + r, out[r]) for r, node in enumerate(frontier)}
        self.forwards += 1
        return torch.softmax(logits.float(), -1)


def run(ctx: DecodeContext, settings: EagleSettings) -> Iterator[Step]:
    drafter = ctx.eagle3
    assert drafter is not None, "eagle needs an EAGLE-3 drafter (DecodeContext.eagle3)"
    taps = tuple(drafter.config.aux_layer_ids)
    depth, branching, nodes = settings.shape
    target = ctx.target_cache()
    with torch.inference_mode():
        drafting = Drafting(drafter, len(ctx.prompt_ids) + ctx.generation.max_new_tokens + depth * branching)
    steps = StepRecorder(ctx)
    while steps.begin():
        seq, forwards = ctx.seq, drafting.forwards
        # propose: the drafter reads last step's committed positions, then grows its tree (none before the first token)
        budget = min(depth, ctx.remaining - 1)
        tree = (
            drafting.propose(seq, budget, branching, nodes) if drafting.pending is not None and budget else DraftTree()
        )
        tokens = drafter.to_target_ids(torch.tensor(tree.ids, dtype=torch.long, device=drafter.d2t.device)).tolist()
        steps.drafted()
        # verify: one target forward over the unseen tokens and every node, tree-masked, features tapped
        unseen = len(seq) - target.length
        visibility = tree_visibility(tree.parents)
        logits, features = target.forward_features(seq, taps, tokens, node_depths(tree.parents), visibility)
        steps.verified()
        # accept: the longest root path the target agrees with, then its own token
        decision = verify_tree(ctx, logits, tokens, tree.parents)
        # commit: keep the accepted nodes' key/values; the drafter reads the committed rows' features next step
        ctx.output.extend(decision.tokens)
        path = list(decision.cached_path)
        target.keep(len(seq), path)
        drafting.read(features[list(range(unseen)) + [unseen + i for i in path]])
        drafted = [
            DraftToken(t, f"eagle_d{d}", q, parent=par)
            for t, q, par, d in zip(tokens, tree.q, tree.parents, node_depths(tree.parents), strict=True)
        ]
        extra = {"tree": tree.rank_paths(), "scores": tree.score, "accepted_path": path, "aux_layers": list(taps)}
        yield steps.step(
            record(decision),
            drafted=drafted,
            draft_forwards=drafting.forwards - forwards,
            input_tokens=unseen + len(tokens),
            kv_len=target.length,
            extra=extra,
        )


def fit(settings: EagleSettings, drafting) -> EagleSettings:
    """The depth capped at the draft steps the drafter was trained to take (where it says)."""
    trained = drafting.eagle3.config.trained_steps if drafting.eagle3 is not None else None
    return replace(settings, depth=min(settings.depth, trained)) if trained else settings


SPEC = StrategySpec(NAME, EagleSettings, run, SUMMARY, drafter=(DrafterKind.EAGLE3,), fit=fit)
