"""The lean forward (mtp_viz.lean) computes what transformers' forward computes, over a cache that
extends in place and rolls back without copies; unsupported models fall back to transformers."""

import pytest
import torch
from conftest import TINY_CONFIGS, decode, perturbed, tiny_model
from test_eagle_strategy import ScriptedDrafter
from transformers import GPT2Config, GPT2LMHeadModel

from mtp_viz.cache import ENGINE_ENV, ENGINES, LEAN, TRANSFORMERS, CachedModel, engine_for
from mtp_viz.lean import CompileUnavailable, lean_model, supports
from mtp_viz.projections import FusedLinear
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.visibility import node_depths, tree_visibility

IDS = [5, 17, 3, 42, 9, 17, 3, 8, 9, 10, 11, 12]


@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_chain_logits_equal_transformers_forward(name):
    model = tiny_model(name)
    with torch.no_grad():
        reference = model(torch.tensor([IDS])).logits[0]  # (L, V)
    cached = CachedModel(model)
    assert cached.engine == LEAN
    got = [cached.forward(IDS[:7], logits_to_keep=7)]
    got.append(cached.forward(IDS[:8]))  # one token
    got.append(cached.forward(IDS, logits_to_keep=4))  # a block after a past
    torch.testing.assert_close(torch.cat(got), reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_tree_rows_equal_each_path_run_alone(name):
    """A token tree in one forward: each node's logits are those of its own path as a plain sequence."""
    model = tiny_model(name)
    prefix = IDS[:6]
    tokens, parents = [7, 8, 9, 10], [-1, -1, 0, 2]  # two children of the root; a chain under the first
    depths = [1, 1, 2, 3]
    cached = CachedModel(model)
    logits, hidden = cached.forward_hidden(prefix, tokens, depths, tree_visibility(parents))
    assert logits.shape[0] == hidden.shape[0] == 1 + len(tokens)
    paths = [[7], [8], [7, 9], [7, 9, 10]]
    with torch.no_grad():
        for row, path in enumerate(paths, start=1):
            alone = model(torch.tensor([prefix + path])).logits[0, -1]
            torch.testing.assert_close(logits[row], alone, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", ["llama-2l", "llama-3l-mha"])
def test_tapped_features_are_transformers_hidden_states_and_leave_the_logits_alone(name, engine, monkeypatch):
    """An EAGLE-3 target's features: tap k is transformers' hidden_states[k] at every row fed (the
    prompt's, then each tree node's as if its path ran alone), in tap order, on both engines and on
    the one-row-at-a-time path after the prompt; the logits are those of the untapped forward."""
    monkeypatch.setenv(ENGINE_ENV, engine)
    model = tiny_model(name)
    taps = (model.config.num_hidden_layers - 1, 0, 1)  # out of order, and the embedding (k = 0)

    def expected(ids: list[int]) -> torch.Tensor:  # (len(ids), len(taps)·H)
        with torch.no_grad():
            states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        return torch.cat([states[k][0] for k in taps], -1)

    prefix, tokens, parents = IDS[:6], [7, 8, 9], [-1, -1, 0]
    tapped, plain = (CachedModel(model, prompt_length=len(prefix)) for _ in range(2))
    for step, seq in enumerate((prefix, prefix + [8])):  # the prompt, then one token and a tree after it
        args = (tokens, node_depths(parents), tree_visibility(parents))
        logits, features = tapped.forward_features(seq, taps, *args)
        assert torch.equal(logits, plain.forward_hidden(seq, *args)[0])
        fed = len(seq) - (0 if step == 0 else len(prefix))
        assert features.shape == (fed + len(tokens), len(taps) * model.config.hidden_size)
        torch.testing.assert_close(features[:fed], expected(seq)[-fed:], rtol=1e-4, atol=1e-5)
        for row, path in enumerate([[7], [8], [7, 9]]):
            torch.testing.assert_close(features[fed + row], expected(seq + path)[-1], rtol=1e-4, atol=1e-5)
        for cached in (tapped, plain):
            cached.keep(len(seq), [])


def test_keep_moves_the_accepted_path_and_rollback_copies_nothing():
    model = tiny_model("llama-2l")
    cached = CachedModel(model)
    prefix = IDS[:6]
    cached.forward_hidden(prefix, [7, 8, 9], [1, 1, 2], tree_visibility([-1, -1, 1]))
    cached.keep(len(prefix), [1, 2])  # keep the path 8 → 9
    data = cached.backend.kv.data
    cached.rollback(len(prefix) + 1)
    assert cached.backend.kv.data is data  # rollback is a length
    after = cached.forward(prefix + [8, 9, 4])
    fresh = CachedModel(model).forward(prefix + [8, 9, 4])
    torch.testing.assert_close(after, fresh, rtol=1e-4, atol=1e-5)


def test_the_cache_grows_by_doubling_and_keeps_its_entries():
    model = tiny_model("llama-2l")
    cached = CachedModel(model)
    seq = list(range(10, 20))
    cached.forward(seq)
    first = cached.backend.kv.capacity
    long = seq + [(i * 7) % 90 + 3 for i in range(first + 5)]
    logits = cached.forward(long)
    assert cached.backend.kv.capacity == 2 * first
    torch.testing.assert_close(logits, CachedModel(model).forward(long), rtol=1e-4, atol=1e-5)


def test_fused_projections_are_views_and_leave_the_weights_alone():
    model = tiny_model("qwen2-2l")  # q/k/v carry biases
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lean = lean_model(model)
    assert all(isinstance(b.proj.qkv, FusedLinear) for b in lean.blocks)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == lean.blocks[0].proj.qkv.weight.data_ptr()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    model.to(torch.float64)  # weights replaced: the lean view is rebuilt, not stale
    assert lean_model(model) is not lean and lean_model(model).current()


def test_the_lean_view_is_remade_once_a_transform_replaces_a_module_and_dies_with_the_model():
    """The lean view is kept beside the model (not in it) and knows the modules it was made over:
    a linear swapped for a FastLinear after it was made makes it stale, and it holds the model only
    weakly, so a dropped model takes its view with it."""
    import gc
    import weakref

    from mtp_viz.kernels import FIXED_PLAN, FastLinear, use_fast_linears

    model = tiny_model("llama-2l")
    lean = lean_model(model)
    assert lean_model(model) is lean and "_mtp_viz_lean" not in model.__dict__
    use_fast_linears(model, FIXED_PLAN)
    again = lean_model(model)
    assert again is not lean and not lean.current()
    assert type(again.blocks[0].proj.o) is FastLinear and again.head is model.lm_head
    gone = weakref.ref(again)
    del model, lean, again
    gc.collect()
    assert gone() is None


def test_unsupported_models_run_on_transformers_forward(monkeypatch):
    config = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    gpt2 = GPT2LMHeadModel(config).eval()
    assert supports(gpt2) and lean_model(gpt2) is None
    assert engine_for(gpt2) == TRANSFORMERS
    cached = CachedModel(gpt2)
    with torch.no_grad():
        reference = gpt2(torch.tensor([IDS])).logits[0, -1]
    cached.forward(IDS[:5])
    torch.testing.assert_close(cached.forward(IDS)[0], reference, rtol=1e-4, atol=1e-5)
    monkeypatch.setenv(ENGINE_ENV, TRANSFORMERS)  # and any model can be sent there
    assert engine_for(tiny_model("llama-2l")) == TRANSFORMERS


@pytest.mark.slow
def test_compiled_forward_is_token_identical_for_every_lossless_strategy():
    """The compiled lean forward (inductor on a CPU here, CUDA graphs on a GPU) decodes exactly
    the tokens of the eager one, for the baseline and every lossless strategy."""
    model = tiny_model("llama-2l", seed=1)
    draft = perturbed(model, noise=0.2, seed=11)
    generation = GenerationSettings(max_new_tokens=24)
    prompt = IDS[:7]
    eager = decode(model, "autoregressive", prompt, generation)[0]
    eagle3 = ScriptedDrafter(model, prompt, eager, wrong_depth=2)  # its tapped forward runs in layer segments
    lean, lean_draft = lean_model(model), lean_model(draft)
    assert lean.compile() > 0 and lean_draft.compile() > 0
    try:
        runs = {
            "autoregressive": decode(model, "autoregressive", prompt, generation),
            "speculative": decode(model, "speculative", prompt, generation, draft=draft, num_draft_tokens=3),
            "prompt_lookup": decode(model, "prompt_lookup", prompt, generation, min_ngram_size=1, max_ngram_size=2),
            "lookahead": decode(model, "lookahead", prompt, generation, level=3, window=3, guess=3),
            "self_speculative": decode(model, "self_speculative", prompt, generation, exit_layer=1),
            "eagle": decode(model, "eagle", prompt, generation, eagle3=eagle3, draft_tree="dynamic", branching=2),
        }
    finally:
        lean.decompile()
        lean_draft.decompile()
    for name, (output, _) in runs.items():
        assert output == eager, name
    assert any(s.accepted for s in runs["speculative"][1]) and any(s.accepted for s in runs["eagle"][1])


def test_compile_unavailable_falls_back_to_eager_with_a_reason(monkeypatch):
    import mtp_viz.lean as lean_module

    monkeypatch.setattr(lean_module.shutil, "which", lambda name: None)
    lean = lean_model(tiny_model("llama-2l"))
    with pytest.raises(CompileUnavailable, match="C\\+\\+ compiler"):
        lean.compile()
    assert not lean.compiled


def test_traces_name_their_machine_and_engine(use_tiny_registry, monkeypatch):
    import mtp_viz.lean as lean_module
    from mtp_viz.errors import InvalidSettingsError
    from mtp_viz.runner import RunRequest, run
    from mtp_viz.trace import Trace

    trace = run(RunRequest(prompt="the cat", generation=GenerationSettings(max_new_tokens=4)))
    machine = trace.machine
    assert machine["cpu"] and machine["threads"] >= 1 and machine["torch"] and machine["transformers"]
    assert machine["forward"] == LEAN and machine["compiled"] is False and machine["linear"]
    assert trace.settings["compile"] == "auto"
    assert Trace.from_json(trace.to_json()).machine == machine
    monkeypatch.setattr(lean_module.shutil, "which", lambda name: None)  # compile asked for, impossible
    forced = run(RunRequest(prompt="the cat", compile="on", generation=GenerationSettings(max_new_tokens=4)))
    assert forced.machine["compiled"] is False and "C++ compiler" in forced.machine["compile_note"]
    assert forced.output_token_ids == trace.output_token_ids
    with pytest.raises(InvalidSettingsError, match="compile"):
        run(RunRequest(prompt="the cat", compile="sometimes"))


def test_peers_run_the_plain_model_and_put_our_linears_back(use_tiny_registry):
    from torch import nn

    from mtp_viz.kernels import FastLinear, stock_linears
    from mtp_viz.loading import load_model

    model = load_model("tiny").model
    fast = [m for m in model.modules() if type(m) is FastLinear]
    lean = lean_model(model)
    with stock_linears(model):
        plain = [m for m in model.modules() if isinstance(m, nn.Linear)]
        assert fast and all(type(m) is nn.Linear for m in plain)
        assert {id(m.weight) for m in plain} == {id(m.weight) for m in fast}  # the same parameters
    assert [m for m in model.modules() if type(m) is FastLinear] == fast  # the same modules back
    with stock_linears(model):  # the same plain ones each time (a compiled peer's guards hold)
        assert [m for m in model.modules() if isinstance(m, nn.Linear)] == plain
    assert lean_model(model) is lean  # so the lean view made before still holds


@pytest.mark.slow
def test_transformers_static_compile_peer_decodes_the_same_tokens(use_tiny_registry):
    from mtp_viz.loading import encode_prompt, load_model
    from mtp_viz.peers import HF_GENERATE, HF_STATIC_COMPILE, run_peer

    loaded = load_model("tiny")
    ids = encode_prompt(loaded, "the cat sat")
    plain = run_peer(HF_GENERATE, loaded, ids, 6)
    compiled = run_peer(HF_STATIC_COMPILE, loaded, ids, 6)
    assert compiled.output_token_ids == plain.output_token_ids and compiled.wall_time_s > 0


def test_a_compiled_forward_that_fails_mid_run_falls_back_to_eager():
    model = tiny_model("llama-2l", seed=1)
    generation = GenerationSettings(max_new_tokens=12)
    eager = decode(model, "autoregressive", IDS[:7], generation)[0]
    lean = lean_model(model)

    def broken(*args, **kwargs):
        raise RuntimeError("a graph that cannot run here")

    lean.graph, lean.compiled = broken, True
    assert decode(model, "autoregressive", IDS[:7], generation)[0] == eager
    assert not lean.compiled  # and it stays eager


def test_the_fused_projections_follow_the_models_current_linear_path(monkeypatch):
    """Switching a model's linear path after its lean view exists switches the fused q|k|v and
    gate|up products too (they read the plan of the modules they fuse at each call)."""
    import mtp_viz.kernels as kernels
    from mtp_viz.kernels import FIXED_PLAN, STOCK_PLAN, use_fast_linears

    model = tiny_model("llama-2l")
    use_fast_linears(model, FIXED_PLAN)
    fused_rows = lean_model(model).blocks[0].proj.qkv.weight.shape[0]
    widths = []
    real = kernels.F.linear
    monkeypatch.setattr(kernels.F, "linear", lambda x, w, b=None: widths.append(w.shape[0]) or real(x, w, b))
    CachedModel(model).forward(IDS[:3])
    assert fused_rows not in widths  # the padded W @ xᵀ path
    use_fast_linears(model, STOCK_PLAN)
    CachedModel(model).forward(IDS[:3])
    assert fused_rows in widths  # F.linear now
