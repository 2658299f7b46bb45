"""The `eagle` strategy: EAGLE-2's tree growth and rerank on hand-made probabilities, the drafter's
tree mask against its paths run alone, greedy identity with autoregressive decoding on both engines
with a random tiny EAGLE-3 drafter and with scripted ones (agreeing, or wrong at depth 2), and the
runner's wiring. (The tiny-model identity matrix and the chi-square test include eagle too.)"""

import pytest
import torch
from conftest import TINY_CONFIGS, decode, tiny_model

from mtp_viz.cache import ENGINE_ENV, ENGINES
from mtp_viz.drafters.eagle3 import EVERY_ROW, Eagle3Config, Eagle3Drafter
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.strategies.eagle import CHAIN, DYNAMIC, Drafting, EagleSettings, grow
from mtp_viz.trace import ACCEPTED, VERDICT_ACCEPTED, VERDICT_REJECTED

PROMPT = [5, 17, 3, 42, 9, 17, 3]


def tiny_drafter(model, seed: int = 0, draft_vocab_size: int | None = None) -> Eagle3Drafter:
    """A random EAGLE-3 drafter for `model`: its embedding, taps at a low, a middle and the last
    layer, and (draft_vocab_size below the target's) a random injective d2t into its vocabulary."""
    c, layers, vocab = model.config, model.config.num_hidden_layers, model.config.vocab_size
    config = Eagle3Config(
        hidden_size=c.hidden_size,
        intermediate_size=2 * c.hidden_size,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=c.hidden_size // 4,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab_size or vocab,
        aux_layer_ids=(0, layers // 2, layers - 1),
    )
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(config, model.get_input_embeddings())
    with torch.no_grad():
        for p in drafter.parameters():
            if p is not drafter.embed_tokens.weight:
                p.normal_(0.0, 0.3)
        if config.draft_vocab_size < vocab:
            targets = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[: config.draft_vocab_size]
            targets = targets.sort().values
            drafter.d2t.copy_(targets - torch.arange(config.draft_vocab_size))
            drafter.t2d.zero_()[targets] = True
    return drafter.eval()


class ScriptedDrafter(Eagle3Drafter):
    """An EAGLE-3 drafter for engine tests: it knows the target's greedy continuation and drafts
    it, except that the guesses of depth `wrong_depth` put a wrong token first (the right one
    second). Off the continuation it is uniform. Its output rows are markers [MARK, position,
    lost, depth]; rows made from the target's features (no marker) are committed positions."""

    MARK = 12345.0

    def __init__(self, model, prompt, continuation, wrong_depth: int | None = 2, confidence: float = 8.0):
        base = tiny_drafter(model)
        super().__init__(base.config, model.get_input_embeddings())
        self.seq, self.wrong_depth, self.confidence = list(prompt) + list(continuation), wrong_depth, confidence

    def forward(self, hidden, token_ids, positions, cache, mask=None, read=EVERY_ROW):
        c, t = self.config, len(token_ids)
        cache.extend(*(torch.zeros(c.num_key_value_heads, t, c.head_dim) for _ in range(2)))
        out, logits = torch.zeros(t, c.hidden_size), torch.zeros(t, c.draft_vocab_size)
        for r, (h, token, position) in enumerate(zip(hidden, token_ids.tolist(), positions.tolist(), strict=True)):
            marked = bool(h[0] == self.MARK)
            depth = int(h[3]) + 1 if marked else 0  # this row drafts the nodes of depth + 1
            lost = (marked and bool(h[2])) or position + 2 >= len(self.seq) or self.seq[position + 1] != token
            out[r, :4] = torch.tensor([self.MARK, position, float(lost), depth])
            if not lost:
                right = self.seq[position + 2]
                wrong = (right + 1) % c.draft_vocab_size
                first, second = (wrong, right) if depth + 1 == self.wrong_depth else (right, wrong)
                logits[r, first], logits[r, second] = self.confidence, self.confidence - 1.0
        return logits[read], out


def test_grow_expands_the_best_frontier_and_reranks_by_cumulative_probability():
    """Depth 3, two children per node, two nodes expanded per depth, 5 kept."""
    root = torch.tensor([0.6, 0.3, 0.1, 0.0])  # nodes 0 (token 0, 0.6) and 1 (token 1, 0.3)
    children = {  # node → its children's distribution
        0: torch.tensor([0.0, 0.0, 0.5, 0.5]),  # 2: token 2 (0.30), 3: token 3 (0.30)
        1: torch.tensor([0.9, 0.1, 0.0, 0.0]),  # 4: token 0 (0.27), 5: token 1 (0.03)
        2: torch.tensor([0.0, 0.2, 0.0, 0.8]),  # 6: token 3 (0.24), 7: token 1 (0.06)
        3: torch.tensor([0.1, 0.0, 0.7, 0.2]),  # 8: token 2 (0.21), 9: token 3 (0.06)
    }
    expanded = []

    def expand(tree, frontier):
        expanded.append(frontier)
        return torch.stack([children[n] for n in frontier])

    tree = grow(root, expand, depth=3, branching=2, nodes=5)
    assert expanded == [[0, 1], [2, 3]]  # depth 2's best two are both under node 0 (0.30 > 0.27)
    # kept: 0 (0.6), 1 (0.3), 2 (0.3), 3 (0.3), 4 (0.27); node 6 (0.24) is dropped
    assert tree.ids == [0, 1, 2, 3, 0] and tree.parents == [-1, -1, 0, 0, 1]
    assert tree.rank_paths() == [[0], [1], [0, 0], [0, 1], [1, 0]]
    torch.testing.assert_close(torch.tensor(tree.score), torch.tensor([0.6, 0.3, 0.3, 0.3, 0.27]))
    tree = grow(root, expand, depth=3, branching=2, nodes=7)  # deeper nodes kept: parents first
    assert tree.parents == [-1, -1, 0, 0, 1, 2, 3] and tree.ids[5:] == [3, 2]


def test_a_child_tied_with_its_parent_is_never_kept_without_it():
    root = torch.tensor([0.5, 0.5])
    tree = grow(root, lambda tree, frontier: torch.tensor([[1.0, 0.0]] * len(frontier)), 3, 2, 2)
    assert tree.parents == [-1, -1]  # the two roots' children tie them, but they come later


def test_chain_settings_are_a_one_child_tree():
    assert EagleSettings().draft_tree == CHAIN and EagleSettings().shape == (1, 1, 1)  # the CPU default: one draft
    assert EagleSettings(depth=3).shape == (3, 1, 3)
    assert EagleSettings(draft_tree=DYNAMIC, depth=4, branching=3, nodes=9).shape == (4, 3, 9)


def test_each_tree_row_of_the_drafter_is_its_path_run_alone():
    """The drafter's batched tree forward (tree mask, positions) computes, for every node, what
    feeding its path one position at a time computes."""
    model = tiny_model("llama-2l")
    drafter = tiny_drafter(model, seed=3, draft_vocab_size=40)
    features = torch.randn(len(PROMPT) - 1, drafter.config.fc_input_size)
    with torch.inference_mode():
        drafting = Drafting(drafter, 64)
        drafting.read(features)
        tree = drafting.propose(PROMPT, depth=3, branching=2, nodes=20)  # every node kept: numbers unchanged
        assert drafting.cache.length == len(PROMPT) - 1  # cropped back to the committed positions
        for node, (_, out) in drafting.rows.items():
            path = [*reversed(tree.ancestors(node)), node]
            alone = drafter.new_cache(64)
            start = torch.arange(len(PROMPT) - 1)
            _, h = drafter(drafter.fuse(features), torch.tensor(PROMPT[1:]), start, alone)
            h = h[-1:]
            for depth, n in enumerate(path, start=1):
                token = drafter.to_target_ids(torch.tensor([tree.ids[n]]))
                _, h = drafter(h, token, torch.tensor([len(PROMPT) - 2 + depth]), alone)
            torch.testing.assert_close(out, h[0], rtol=1e-4, atol=1e-5)
    assert len(drafting.rows) == 4 and len(tree.ids) == 2 + 4 + 4


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_greedy_identical_to_autoregressive_with_a_random_drafter(name, engine, monkeypatch):
    monkeypatch.setenv(ENGINE_ENV, engine)
    model = tiny_model(name, seed=1)
    generation = GenerationSettings(max_new_tokens=30)
    reference, _ = decode(model, "autoregressive", PROMPT, generation)
    drafter = tiny_drafter(model, seed=2, draft_vocab_size=48)
    for settings in ({}, {"depth": 3}, {"draft_tree": DYNAMIC, "depth": 4, "branching": 3, "nodes": 10}):
        out, steps = decode(model, "eagle", PROMPT, generation, eagle3=drafter, **settings)
        assert out == reference, settings
        assert all(s.extra["aux_layers"] == list(drafter.config.aux_layer_ids) for s in steps)
        assert not steps[0].drafted and steps[1].drafted and steps[1].draft_forwards == settings.get("depth", 1)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("draft_tree", [CHAIN, DYNAMIC])
def test_scripted_drafters_accept_and_reject_and_stay_identical(draft_tree, engine, monkeypatch):
    monkeypatch.setenv(ENGINE_ENV, engine)
    model = tiny_model("llama-2l", seed=0)
    generation = GenerationSettings(max_new_tokens=40)
    reference, _ = decode(model, "autoregressive", PROMPT, generation)
    settings = {"draft_tree": draft_tree, "depth": 3, "branching": 2, "nodes": 6}
    agreeing = ScriptedDrafter(model, PROMPT, reference, wrong_depth=None)
    out, steps = decode(model, "eagle", PROMPT, generation, eagle3=agreeing, **settings)
    assert out == reference
    assert all(s.extra["accepted_path"] and len(s.emitted) == 4 for s in steps[1:-1])  # the whole depth
    assert steps[1].emitted[-1].origin == "bonus" and steps[1].draft_forwards == 3
    wrong = ScriptedDrafter(model, PROMPT, reference, wrong_depth=2)
    read = []  # the target features the drafter reads, in order: every committed position's
    fuse = wrong.fuse
    wrong.fuse = lambda features: read.append(features) or fuse(features)
    out, steps = decode(model, "eagle", PROMPT, generation, eagle3=wrong, **settings)
    assert out == reference
    read = torch.cat(read)
    torch.testing.assert_close(read, target_features(model, PROMPT + out, wrong)[: len(read)], rtol=1e-4, atol=1e-5)
    assert len(read) >= len(PROMPT) + len(out) - 1 - 4  # all but the last step's
    verdicts = [v for s in steps for v in s.verdicts]
    assert VERDICT_ACCEPTED in verdicts and VERDICT_REJECTED in verdicts
    for s in steps:
        path = s.extra["accepted_path"]
        assert [e.origin for e in s.emitted[: len(path)]] == [ACCEPTED] * len(path)
        assert s.kv_len == len(PROMPT) + sum(len(x.emitted) for x in steps[: s.index + 1]) - 1
        assert all(d.source == f"eagle_d{depth}" for d, depth in zip(s.drafted, s.depths, strict=True))
    won = [[s.extra["tree"][n] for n in s.extra["accepted_path"]] for s in steps]
    if draft_tree == CHAIN:  # the wrong guess at depth 2 stops every chain after one token
        assert all(len(path) <= 1 for path in won) and any(len(path) == 1 for path in won)
    else:  # the right token, second at depth 2, wins on a non-first branch
        assert any(path[1:2] == [[0, 1]] for path in won)


def target_features(model, ids, drafter) -> torch.Tensor:
    """transformers' hidden_states at the drafter's layers, concatenated: (len(ids), n·H)."""
    with torch.no_grad():
        states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([states[k][0] for k in drafter.config.aux_layer_ids], -1)


@pytest.mark.parametrize("budget", [1, 2, 5])
def test_the_tree_never_drafts_past_the_token_budget(budget):
    model = tiny_model("llama-2l", seed=3)
    reference, _ = decode(model, "autoregressive", PROMPT, GenerationSettings(max_new_tokens=8))
    drafter = ScriptedDrafter(model, PROMPT, reference, wrong_depth=None)
    g = GenerationSettings(max_new_tokens=budget)
    out, steps = decode(model, "eagle", PROMPT, g, eagle3=drafter, draft_tree=DYNAMIC, depth=4, branching=2)
    assert out == reference[:budget]
    assert all(max(s.depths, default=0) <= budget - 1 for s in steps)


def test_the_runner_loads_the_targets_drafter_and_records_it(use_tiny_registry, monkeypatch):
    from mtp_viz.loading import drafters
    from mtp_viz.runner import RunRequest, run
    from mtp_viz.theory import measured_point
    from mtp_viz.viz.tokens import step_detail_html

    asked = []

    def load_eagle3_for(target, eagle3=None):
        asked.append((target.name, eagle3))
        return "tiny-eagle3", tiny_drafter(target.model, seed=1, draft_vocab_size=target.model.config.vocab_size // 2)

    monkeypatch.setattr(drafters, "load_eagle3_for", load_eagle3_for)
    generation = GenerationSettings(max_new_tokens=12)
    base = RunRequest(prompt="the cat sat", model="tiny", generation=generation)
    reference = run(base)
    eagle = {"depth": 3}  # deeper than the CPU default, so the replay has a tree to draw
    trace = run(
        RunRequest(prompt="the cat sat", model="tiny", generation=generation, strategy="eagle", strategy_settings=eagle)
    )
    assert asked == [("tiny", None)] and trace.draft_model == "tiny-eagle3"
    assert trace.output_token_ids == reference.output_token_ids
    assert trace.settings["draft_tree"] == CHAIN and trace.settings["top_k"] == 0  # no clash with sampling's
    drafting = [s for s in trace.steps if s.drafted]
    assert drafting and all(s.draft_forwards == 3 and s.draft_s > 0 for s in drafting[:-2])  # then the budget
    point = measured_point(trace, reference)  # the Theory view's α, γ and drafter cost ratio c
    assert point is not None and point["c"] > 0 and point["gamma"] > 1
    detail = step_detail_html(trace, drafting[0].index)  # Explore's replay draws the tree
    assert "Token tree" in detail and "eagle_d3" in detail
