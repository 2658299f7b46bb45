"""Every drafter kind runs as its target runs: in the target's weight format and on its linear plan,
q|k|v and gate|up fused, its head scoring only the rows that are read, and the run's record says
which format the drafter ran in. On a tiny random Llama target with a tiny EAGLE-3 drafter, trained
draft and MTP heads written here; lossless decoding does not depend on the drafter's format."""

import json

import pytest
import torch
from conftest import save_tiny_dir
from torch import nn

from mtp_viz import loading
from mtp_viz.drafters.draft import DraftSpec, build_draft, save_draft
from mtp_viz.drafters.eagle3 import Eagle3Config, Eagle3Drafter, save_eagle3
from mtp_viz.drafters.heads import HeadsSpec, build_heads, save_heads
from mtp_viz.kernels import FastLinear
from mtp_viz.loading import DrafterRequest, load_drafting, load_eagle3_for, load_heads_for, load_model, resolve
from mtp_viz.loading.eagle3 import eagle3_weights
from mtp_viz.machine import DRAFTER_WEIGHTS, describe, same_machine
from mtp_viz.projections import FusedLinear
from mtp_viz.runner import RunRequest, run
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.strategies.eagle import Drafting
from mtp_viz.weights import AUTO, FP32, Q4, FormatLinear, Q4Linear, head_format

TARGET_LAYERS = 2  # conftest's llama-2l: hidden 32, intermediate 64, 4 heads, 2 kv heads
DRAFT_VOCAB = 12  # every other id of the tiny tokenizer's 28
ODD_INTERMEDIATE = 48  # a drafter MLP whose down projection reads 48 inputs: not blocks of 32
PROMPT = "the cat sat on the mat"
STEPS, SEQUENCES = 24, 3  # drafter steps compared between the fp32 and the q4 drafter, on each of 3 sequences
MIN_AGREEMENT = 0.6  # of their top proposals; measured 0.86 (62 of 72) on these weights; chance: 1 in 12


def tiny_eagle3(vocab: int, intermediate: int = 64, seed: int = 0) -> Eagle3Drafter:
    """A random drafter with weights large enough that its top proposal is clear-cut."""
    config = Eagle3Config(
        hidden_size=32,
        intermediate_size=intermediate,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        vocab_size=vocab,
        draft_vocab_size=DRAFT_VOCAB,
        aux_layer_ids=(0, 1, TARGET_LAYERS - 1),  # the lean forward taps layers 0..L-1
    )
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(config)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0.0, 0.3)
    targets = torch.arange(DRAFT_VOCAB) * 2
    drafter.d2t.copy_(targets - torch.arange(DRAFT_VOCAB))
    drafter.t2d.zero_()[targets] = True
    return drafter


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    """A registry of target "t" with an EAGLE-3 drafter (and one with an odd MLP), a trained draft
    and MTP heads, each written by its own saver."""
    root = tmp_path_factory.mktemp("drafter-formats")
    save_tiny_dir(root / "target")
    vocab = json.loads((root / "target" / "config.json").read_text())["vocab_size"]
    save_eagle3(tiny_eagle3(vocab), root / "eagle3" / "t")
    save_eagle3(tiny_eagle3(vocab, ODD_INTERMEDIATE), root / "eagle3" / "odd")
    target = load_model(str(root / "target"), "cpu", "float32")
    ids = torch.arange(0, vocab, 3)
    draft = build_draft(target.model, (1,), ids)
    save_draft(draft, DraftSpec("t", (1,), 32, vocab, len(ids)), root / "draft")
    spec = HeadsSpec("t", 32, 64, vocab, len(ids), trained_depth=2)
    save_heads(build_heads(target.model, spec, ids), root / "heads")
    registry = {
        "defaults": {"cpu": "t"},
        "models": [
            {
                "id": "t",
                "sources": [{"kind": "local", "path": "target"}],
                "drafts": ["t-draft"],
                "heads": ["t-heads"],
                "eagle3": ["t-eagle3", "t-odd"],
            },
            {"id": "t-draft", "sources": [{"kind": "trained_draft", "base": "t", "path": "draft"}]},
        ],
        "heads": [{"id": "t-heads", "base": "t", "path": "heads"}],
        "eagle3": [
            {"id": "t-eagle3", "base": "t", "path": "eagle3/t"},
            {"id": "t-odd", "base": "t", "path": "eagle3/odd"},
        ],
    }
    (root / "models.yaml").write_text(json.dumps(registry))
    return root


@pytest.fixture
def registry(tiny_root, monkeypatch):
    """This file's registry, on an empty load cache (other files name their models "t" too)."""
    monkeypatch.setenv("MTP_VIZ_MODELS", str(tiny_root / "models.yaml"))
    loading.forget()
    yield tiny_root
    loading.forget()


def linears(module: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in module.named_modules() if isinstance(m, nn.Linear)}


def test_an_eagle3_drafter_of_a_q4_target_holds_q4_layers_a_q8_head_and_fused_products(registry):
    target = load_model("t", "cpu", "float32", Q4)
    _, drafter = load_eagle3_for(target)
    layers = {name: m for name, m in linears(drafter).items() if name != "lm_head"}
    assert len(layers) == 8 and all(isinstance(m, Q4Linear) for m in layers.values())  # fc, q, k, v, o, gate, up, down
    assert getattr(drafter.lm_head, "fmt", FP32) == head_format(Q4)  # Q8_0 where our kernels run, as the target's
    fused, attn, mlp = drafter.midlayer.fused, drafter.midlayer.self_attn, drafter.midlayer.mlp
    assert isinstance(fused.qkv, Q4Linear) and fused.qkv.fused_from == (attn.q_proj, attn.k_proj, attn.v_proj)
    assert isinstance(fused.gate_up, Q4Linear) and fused.gate_up.fused_from == (mlp.gate_proj, mlp.up_proj)
    assert attn.k_proj.qs.untyped_storage().data_ptr() == fused.qkv.qs.untyped_storage().data_ptr()  # views, one copy
    described = eagle3_weights(drafter, Q4)
    assert described == f"q4 (head {head_format(Q4)}; q|k|v, gate|up fused)"


def test_the_fused_products_compute_what_the_separate_ones_do(registry):
    for weights in (FP32, Q4):
        _, drafter = load_eagle3_for(load_model("t", "cpu", "float32", weights))
        x = torch.randn(3, 64)
        fused, attn, mlp = drafter.midlayer.fused, drafter.midlayer.self_attn, drafter.midlayer.mlp
        apart = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], -1)
        torch.testing.assert_close(fused.qkv(x), apart, rtol=1e-5, atol=1e-5)
        apart = torch.cat([mlp.gate_proj(x[:, :32]), mlp.up_proj(x[:, :32])], -1)
        torch.testing.assert_close(fused.gate_up(x[:, :32]), apart, rtol=1e-5, atol=1e-5)


def test_an_fp32_drafter_runs_on_the_targets_linear_plan(registry):
    target = load_model("t", "cpu", "float32")
    _, drafter = load_eagle3_for(target)
    assert all(type(m) is FastLinear and m.plan == target.plan for m in linears(drafter).values())
    fused = drafter.midlayer.fused
    assert isinstance(fused.qkv, FusedLinear) and isinstance(fused.gate_up, FusedLinear)  # one float32 weight each
    assert eagle3_weights(drafter, FP32) == "fp32 (head fp32; q|k|v, gate|up fused)"


def test_a_linear_whose_inputs_are_not_blocks_of_32_stays_fp32_and_the_record_says_why(registry):
    target = load_model("t", "cpu", "float32", Q4)
    _, drafter = load_eagle3_for(target, "t-odd")
    down = drafter.midlayer.mlp.down_proj
    assert type(down) is FastLinear and down.plan == target.plan
    assert isinstance(drafter.midlayer.mlp.gate_proj, Q4Linear) and isinstance(drafter.fc, Q4Linear)
    assert "midlayer.mlp.down_proj fp32: 48 inputs, not a multiple of 32" in eagle3_weights(drafter, Q4)
    drafting = Drafting(drafter, 16)  # and it drafts, its formats mixed
    drafting.read(torch.randn(3, drafter.config.fc_input_size))
    assert len(drafting.propose([4, 5, 6, 7], depth=2, branching=1, nodes=2).ids) == 2


def target_features(target, ids: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """The target's residual streams at `layers`, concatenated: (len(ids), n·H)."""
    with torch.no_grad():
        states = target.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([states[k][0] for k in layers], -1)


def proposals(drafter: Eagle3Drafter, ids: list[int], features: torch.Tensor) -> list[int]:
    """The drafter's top proposal after each position from the 4th on, one committed row at a time."""
    drafting, tops = Drafting(drafter, len(ids) + 8), []
    drafting.read(features[:3])
    for end in range(4, len(ids) + 1):
        tops.append(drafting.propose(ids[:end], depth=1, branching=1, nodes=1).ids[0])
        drafting.read(features[end - 1 : end])
    return tops


def test_the_q4_drafter_proposes_what_the_fp32_one_does_nearly_always(registry):
    fp32, q4 = load_model("t", "cpu", "float32"), load_model("t", "cpu", "float32", Q4)
    _, plain = load_eagle3_for(fp32)
    _, quantized = load_eagle3_for(q4)
    assert isinstance(quantized.fc, Q4Linear) and not isinstance(plain.fc, FormatLinear)
    agree, vocab = [], fp32.model.config.vocab_size
    for seed in range(SEQUENCES):
        ids = torch.randint(0, vocab, (STEPS + 3,), generator=torch.Generator().manual_seed(seed)).tolist()
        features = target_features(fp32, ids, plain.config.aux_layer_ids)  # the same features for both
        a, b = proposals(plain, ids, features), proposals(quantized, ids, features)
        agree += [x == y for x, y in zip(a, b, strict=True)]
    assert len(agree) == STEPS * SEQUENCES and sum(agree) / len(agree) >= MIN_AGREEMENT, sum(agree)


def test_the_head_scores_only_the_rows_whose_logits_are_read(registry):
    _, drafter = load_eagle3_for(load_model("t", "cpu", "float32", Q4))
    rows = []
    hook = drafter.lm_head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    try:
        drafting = Drafting(drafter, 32)
        drafting.read(torch.randn(5, drafter.config.fc_input_size))
        drafting.propose([4, 5, 6, 7, 8, 9], depth=3, branching=2, nodes=6)
    finally:
        hook.remove()
    assert rows == [1, 2, 2]  # the last committed row, then each level's frontier: all read


@pytest.mark.parametrize("strategy", ["eagle", "speculative", "mtp_heads"])
def test_each_drafter_runs_in_the_targets_format_lossless_and_the_record_names_it(registry, strategy):
    generation = GenerationSettings(max_new_tokens=12)
    reference = run(RunRequest(prompt=PROMPT, model="t", weights=Q4, generation=generation))
    trace = run(RunRequest(prompt=PROMPT, model="t", strategy=strategy, weights=Q4, generation=generation))
    assert trace.output_token_ids == reference.output_token_ids
    recorded = trace.machine[DRAFTER_WEIGHTS]
    assert recorded.startswith("q4 (") and f"drafter {recorded}" in describe(trace.machine)
    assert DRAFTER_WEIGHTS not in reference.machine  # autoregressive decoding has no drafter
    assert same_machine(trace.machine, reference.machine)  # still paired with it as one machine's runs


def test_the_draft_model_follows_the_targets_format_even_under_auto(registry, monkeypatch):
    """A run asking `auto` resolves it for its target; the draft loads in that format, without a
    choice of its own."""
    target = load_model("t", "cpu", "float32", Q4)

    def measured(spec):
        raise AssertionError(f"the draft's format was chosen for {spec.name} alone")

    monkeypatch.setattr(resolve, "auto_format", measured)
    drafting = load_drafting(target, ("draft_model",), DrafterRequest("speculative", device="cpu", weights=AUTO))
    draft = drafting.draft
    assert draft.weights == Q4 and drafting.weights == draft.weights_detail
    assert all(isinstance(m, Q4Linear) for m in linears(draft.model.model.layers).values())
    assert getattr(draft.model.lm_head.product, "fmt", FP32) == head_format(Q4)  # its reduced head: the head's format
    assert draft.weights_detail.startswith("q4 (Q4_1 quantized here")  # its own layers, not the target's codes


def test_mtp_heads_take_the_targets_format_and_their_reduced_head_the_heads(registry):
    target = load_model("t", "cpu", "float32", Q4)
    _, heads = load_heads_for(target)
    assert all(isinstance(getattr(heads, n), Q4Linear) for n in ("fuse", "gate", "up", "down"))
    assert getattr(heads.head.product, "fmt", FP32) == head_format(Q4)
    logits = heads.logits(torch.randn(2, 32))
    assert logits.shape == (2, target.model.config.vocab_size) and torch.isfinite(logits[:, heads.head.ids]).all()
    drafting = load_drafting(target, ("heads",), DrafterRequest("mtp_heads", device="cpu", weights=Q4))
    assert drafting.weights == f"q4 (head {head_format(Q4)})"
