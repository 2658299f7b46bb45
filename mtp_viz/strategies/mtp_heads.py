"""Multi-token prediction heads verified by the target (Medusa, Cai et al. 2024; heads as in
mtp_viz.drafters.heads).

Each step the heads guess the tokens after the last emitted one, from the target's hidden state
that produced it: a chain (the top guess at each depth) or a token tree (several ranked guesses
per depth, e.g. "0,1,00,10,000": rank paths from the root). The target scores every node in
one forward with a tree attention mask; the longest root path it agrees with is kept, then one
token of its own. Exact acceptance is lossless (greedy: argmax; sampling: each candidate tried
as a point-mass draft, residual after each refusal). Typical acceptance (Medusa) is lossy.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from mtp_viz.drafters.kinds import DrafterKind
from mtp_viz.errors import InvalidSettingsError
from mtp_viz.sampling import probs_from_logits, verify_tree_typical
from mtp_viz.strategies.base import DecodeContext, StepRecorder, StrategySpec, decide, verify_tree
from mtp_viz.strategies.decision import Decision, record
from mtp_viz.strategies.settings import check_settings, setting
from mtp_viz.trace import DraftToken, Step
from mtp_viz.visibility import node_depths, tree_visibility

NAME = "mtp_heads"
SUMMARY = "Trained MTP heads guess a chain or tree of next tokens; the target verifies all in one forward."
CHAIN = "chain"
# On a CPU one guess (a chain of 1): with q4 weights a 2-row verify costs 1.24x a one-token forward
# and a 4-row one 1.67x, so on Spec-Bench (13 prompts, q4, 2-core EPYC) one guess ran at 0.99x AR,
# the tree 0,1 at 0.82x and 0,1,00 at 0.71x (docs/BENCHMARKS.md; 0,1,00 was 1.31x on the fp32
# engine, whose slower one-token forward made a wider one relatively cheap). Where verifying costs
# little more, as on a GPU, bigger trees pay: LARGE_TREE.
DEFAULT_TREE = "chain"
LARGE_TREE = "0,1,2,00,01,10,000,001,0000"
MAX_TREE_NODES = 64
MAX_GUESSES = 16
EXACT = "exact"
TYPICAL = "typical"
ACCEPTANCES = (EXACT, TYPICAL)


@dataclass(frozen=True)
class MTPHeadsSettings:
    tree: str = setting(DEFAULT_TREE, "Tree: 'chain', or rank paths from the root (0,1,00,…)", gpu=LARGE_TREE)
    num_guesses: int = setting(1, "Chain length (tree = chain)", low=1, high=MAX_GUESSES, gpu=4)
    acceptance: str = setting(EXACT, "Acceptance (typical is lossy)", choices=ACCEPTANCES)
    typical_epsilon: float = setting(0.09, "Typical: hard floor ε", low=0.0, high=1.0, step=0.01)
    typical_delta: float = setting(0.3, "Typical: entropy-scaled floor δ·exp(−H)", low=0.0, high=1.0, step=0.01)

    def __post_init__(self):
        check_settings(self)
        parse_tree(self.tree, self.num_guesses)  # raises on a malformed tree

    @property
    def paths(self) -> list[tuple[int, ...]]:
        return parse_tree(self.tree, self.num_guesses)


def parse_tree(spec: str, num_guesses: int = 4) -> list[tuple[int, ...]]:
    """ "chain" or "0,1,00,…" → rank paths ordered by depth (parents before children)."""
    if spec == CHAIN:
        return [(0,) * d for d in range(1, num_guesses + 1)]
    paths = []
    for part in (p.strip() for p in str(spec).split(",")):
        if not part or not part.isdigit():
            raise InvalidSettingsError(f"tree must be 'chain' or comma-separated rank paths like 0,1,00; got {spec!r}")
        paths.append(tuple(int(c) for c in part))
    paths = sorted(set(paths), key=lambda p: (len(p), p))
    if len(paths) > MAX_TREE_NODES or max(len(p) for p in paths) > MAX_GUESSES:
        raise InvalidSettingsError(f"tree may have at most {MAX_TREE_NODES} nodes and depth {MAX_GUESSES}")
    known = set(paths) | {()}
    for p in paths:
        if p[:-1] not in known:
            raise InvalidSettingsError(f"tree path {''.join(map(str, p))} has no parent {''.join(map(str, p[:-1]))}")
    return paths


@torch.inference_mode()
def propose(heads, hidden: torch.Tensor, token: int, paths: list[tuple[int, ...]]):
    """Expand the rank paths with the heads, one batched heads step per depth.

    hidden (H,): the target's final hidden state that produced `token`. Returns node tokens,
    parents (−1: the root), and the heads' probability of each node's token.
    """
    node = {p: i for i, p in enumerate(paths)}
    tokens, parents, q = [0] * len(paths), [node.get(p[:-1], -1) for p in paths], [0.0] * len(paths)
    state = {(): (hidden[None], torch.tensor([token], device=hidden.device))}  # path → (its parent's ĥ, its token)
    for depth in range(1, max((len(p) for p in paths), default=0) + 1):
        level = [p for p in paths if len(p) == depth]
        owners = list(dict.fromkeys(p[:-1] for p in level))  # nodes whose children are guessed now
        h = heads.step(torch.cat([state[o][0] for o in owners]), torch.cat([state[o][1] for o in owners]))  # (m, H)
        probs = torch.softmax(heads.logits(h).float(), -1)  # (m, V)
        top = torch.topk(probs, max(p[-1] for p in level) + 1, dim=-1)
        for p in level:
            row = owners.index(p[:-1])
            i = node[p]
            tokens[i] = int(top.indices[row, p[-1]])
            q[i] = float(top.values[row, p[-1]])
            state[p] = (h[row : row + 1], top.indices[row, p[-1]][None])
    return tokens, parents, q


def within_budget(paths: list[tuple[int, ...]], budget: int) -> list[tuple[int, ...]]:
    """Never guess past the token budget: drop nodes deeper than `budget`."""
    return [p for p in paths if len(p) <= budget]


def verify(ctx: DecodeContext, logits: torch.Tensor, tokens, parents, settings: MTPHeadsSettings) -> Decision:
    """The step's decision: logits has a row for the root, then one per node."""
    if settings.acceptance != TYPICAL:
        return verify_tree(ctx, logits, tokens, parents)
    # typical: greedy runs judge against the plain softmax, sampled ones against the warped p
    p_target = torch.softmax(logits, -1) if ctx.warp.greedy else probs_from_logits(logits, ctx.warp)
    generator = None if ctx.warp.greedy else ctx.generator
    verdict = verify_tree_typical(
        p_target, tokens, parents, settings.typical_epsilon, settings.typical_delta, generator
    )
    return decide(ctx, verdict, p_target, tokens, parents)


def run(ctx: DecodeContext, settings: MTPHeadsSettings) -> Iterator[Step]:
    target = ctx.target_cache()
    paths = settings.paths
    hidden = None  # the target's final hidden state that produced the last output token
    steps = StepRecorder(ctx)
    while steps.begin():
        seq = ctx.seq
        # propose: the heads guess a tree of continuations (nothing before the first token)
        shape = within_budget(paths, ctx.remaining - 1) if hidden is not None else []
        tokens, parents, q = propose(ctx.heads, hidden, seq[-1], shape) if shape else ([], [], [])
        steps.drafted()
        # verify: one target forward over the unseen tokens and every node, tree-masked
        fed = len(seq) - target.length + len(tokens)
        logits, hiddens = target.forward_hidden(seq, tokens, node_depths(parents), tree_visibility(parents))
        steps.verified()
        # accept: the longest root path the target agrees with, then its own token
        decision = verify(ctx, logits, tokens, parents, settings)
        # commit: keep the accepted nodes' key/values; remember the hidden state behind the last token
        ctx.output.extend(decision.tokens)
        path = decision.cached_path
        target.keep(len(seq), path)
        hidden = hiddens[path[-1] + 1 if path else 0]
        drafted = [
            DraftToken(t, f"head_{d}", qi, parent=par)
            for t, qi, par, d in zip(tokens, q, parents, node_depths(parents), strict=True)
        ]
        extra = {"tree": [list(p) for p in shape], "accepted_path": list(path)}
        yield steps.step(record(decision), drafted=drafted, input_tokens=fed, kv_len=target.length, extra=extra)


SPEC = StrategySpec(
    NAME,
    MTPHeadsSettings,
    run,
    SUMMARY,
    drafter=(DrafterKind.HEADS,),
    lossy_when=lambda settings: settings.get("acceptance") == TYPICAL,
)
