"""The EAGLE-3 drafter and its checkpoint format, as vLLM's LlamaForCausalLMEagle3 loads it.

Tiny random weights on CPU; the published layout is written by hand here, not by our saver."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F
from transformers import LlamaConfig

from mtp_viz.drafters.eagle3 import (
    Eagle3Config,
    Eagle3Drafter,
    load_eagle3,
    save_eagle3,
)
from mtp_viz.drafters.eagle3_config import default_aux_layer_ids
from mtp_viz.errors import UserError

H, INTER, HEADS, KV, HD, V, DRAFT_V, TARGET_LAYERS = 32, 48, 4, 2, 8, 40, 16, 30
EPS = 1e-5


def published_config() -> dict:
    """config.json as the EAGLE authors publish theirs, key for key (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B;
    SafeAILab/EAGLE eagle/traineagle3/config.json is its training copy), sizes shrunk: no layer ids
    (vLLM and EAGLE both fall back to (2, L//2, L-3)) and no rope_theta (LlamaConfig's 10000, as both
    read it)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": INTER,
        "max_position_embeddings": 64,
        "model_type": "llama",
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "rms_norm_eps": EPS,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "transformers_version": "4.28.1",
        "use_cache": True,
        "vocab_size": V,
        "draft_vocab_size": DRAFT_V,
    }


USED = torch.tensor([0, 2, 3, 5, 7, 8, 11, 13, 17, 19, 23, 29, 31, 33, 37, 39])  # target ids the draft vocab holds


def published_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.2).half()

    w = {
        "fc.weight": r(H, 3 * H),
        "midlayer.input_layernorm.weight": 1 + r(H),
        "midlayer.hidden_norm.weight": 1 + r(H),
        "midlayer.self_attn.q_proj.weight": r(HEADS * HD, 2 * H),
        "midlayer.self_attn.k_proj.weight": r(KV * HD, 2 * H),
        "midlayer.self_attn.v_proj.weight": r(KV * HD, 2 * H),
        "midlayer.self_attn.o_proj.weight": r(H, HEADS * HD),
        "midlayer.post_attention_layernorm.weight": 1 + r(H),
        "midlayer.mlp.gate_proj.weight": r(INTER, H),
        "midlayer.mlp.up_proj.weight": r(INTER, H),
        "midlayer.mlp.down_proj.weight": r(H, INTER),
        "norm.weight": 1 + r(H),
        "lm_head.weight": r(DRAFT_V, H),
        "d2t": USED - torch.arange(DRAFT_V),  # target id = draft id + d2t[draft id]
        "t2d": torch.isin(torch.arange(V), USED),
    }
    assert len(USED) == DRAFT_V
    return w


def write_published(directory, weights=None, config=None, legacy=False):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config or published_config()))
    weights = published_weights() if weights is None else weights
    if legacy:
        torch.save(weights, directory / "pytorch_model.bin")
    else:
        save_file(weights, str(directory / "model.safetensors"))
    return directory


def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def reference_first_step(w, embed, features, token):
    """The drafter at one position with an empty cache, from the raw weights: softmax over one key is
    1, so attention is o_proj(v_proj(x)) with each kv head serving HEADS/KV query heads."""
    w = {k: v.float() for k, v in w.items()}
    h = features @ w["fc.weight"].T
    x = torch.cat([rms(embed, w["midlayer.input_layernorm.weight"]), rms(h, w["midlayer.hidden_norm.weight"])])
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(KV, HD).repeat_interleave(HEADS // KV, 0)
    r = h + v.reshape(-1) @ w["midlayer.self_attn.o_proj.weight"].T
    y = rms(r, w["midlayer.post_attention_layernorm.weight"])
    mlp = (F.silu(y @ w["midlayer.mlp.gate_proj.weight"].T) * (y @ w["midlayer.mlp.up_proj.weight"].T)) @ w[
        "midlayer.mlp.down_proj.weight"
    ].T
    out = r + mlp
    return rms(out, w["norm.weight"]) @ w["lm_head.weight"].T, out


@pytest.fixture
def embed():
    torch.manual_seed(1)
    return nn.Embedding(V, H)


@pytest.mark.parametrize("legacy", [False, True], ids=["safetensors", "pytorch_model.bin"])
def test_published_checkpoint_loads_and_drafts_two_steps(tmp_path, embed, legacy):
    directory = write_published(tmp_path / "ckpt", legacy=legacy)
    drafter = load_eagle3(directory, embed=embed, target_layers=TARGET_LAYERS)
    assert drafter.config.aux_layer_ids == (2, 15, 27) == default_aux_layer_ids(TARGET_LAYERS)
    assert drafter.embed_tokens is embed and not drafter.owns_embedding
    assert drafter.config.rope_theta == 10000.0 and drafter.config.head_dim == H // HEADS

    torch.manual_seed(2)
    features = torch.randn(1, 3 * H)  # the target's residual streams at the 3 layers, concatenated
    token = torch.tensor([5])
    cache = drafter.new_cache(8)
    with torch.no_grad():
        logits, hidden = drafter(drafter.fuse(features), token, torch.tensor([0]), cache)
        want_logits, want_hidden = reference_first_step(published_weights(), embed.weight[5], features[0], token)
        assert torch.allclose(logits[0], want_logits, atol=1e-5) and torch.allclose(hidden[0], want_hidden, atol=1e-5)

        draft_id = logits.argmax(-1)  # (1,)
        next_token = drafter.to_target_ids(draft_id)
        assert next_token.item() == USED[draft_id].item()
        logits2, hidden2 = drafter(hidden, next_token, torch.tensor([1]), cache)  # fed its own hidden
    assert logits2.shape == (1, DRAFT_V) and hidden2.shape == (1, H) and cache.length == 2
    assert torch.equal(drafter.t2d, torch.isin(torch.arange(V), USED))
    full = drafter.target_logits(logits2)
    assert full.shape == (1, V) and torch.equal(torch.isfinite(full[0]), drafter.t2d)
    assert torch.equal(full[0, USED], logits2[0])


def test_a_published_checkpoint_with_its_own_embedding_uses_it(tmp_path, embed):
    """Some published drafters carry `embed_tokens.weight` (yuhuili/EAGLE3-LLaMA3.3-Instruct-70B does,
    per vLLM PR 28549); the 8B one does not and shares the target's."""
    weights = published_weights() | {"embed_tokens.weight": torch.randn(V, H).half()}
    drafter = load_eagle3(write_published(tmp_path / "c", weights), embed=embed, target_layers=TARGET_LAYERS)
    assert drafter.owns_embedding and drafter.embed_tokens is not embed
    assert torch.equal(drafter.embed_tokens.weight, weights["embed_tokens.weight"].float())


def test_t2d_is_derived_when_a_checkpoint_omits_it(tmp_path, embed):
    weights = published_weights()
    del weights["t2d"]  # vLLM skips t2d when loading; some exports leave it out
    drafter = load_eagle3(write_published(tmp_path / "c", weights), embed=embed, target_layers=TARGET_LAYERS)
    assert torch.equal(drafter.t2d, torch.isin(torch.arange(V), USED))


def random_drafter(norm_before_fc=False, draft_vocab=DRAFT_V, seed=3) -> Eagle3Drafter:
    torch.manual_seed(seed)
    config = Eagle3Config(
        hidden_size=H,
        intermediate_size=INTER,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        head_dim=HD,
        rms_norm_eps=EPS,
        rope_theta=10000.0,
        max_position_embeddings=64,
        vocab_size=V,
        draft_vocab_size=draft_vocab,
        aux_layer_ids=(2, 15, 27),
        norm_before_fc=norm_before_fc,
    )
    drafter = Eagle3Drafter(config, nn.Embedding(V, H))
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.2)
        if draft_vocab < V:
            drafter.d2t.copy_(USED - torch.arange(DRAFT_V))
            drafter.t2d.copy_(torch.isin(torch.arange(V), USED))
    return drafter.eval()


def run_steps(drafter, seed=4):
    """Three positions from the target's features, then two fed the drafter's own hidden."""
    torch.manual_seed(seed)
    cache = drafter.new_cache(16)
    with torch.no_grad():
        logits, hidden = drafter(drafter.fuse(torch.randn(3, 3 * H)), torch.tensor([1, 4, 9]), torch.arange(3), cache)
        out = [logits]
        for pos in (3, 4):
            token = drafter.to_target_ids(logits[-1:].argmax(-1))
            logits, hidden = drafter(hidden[-1:], token, torch.tensor([pos]), cache)
            out.append(logits)
    return torch.cat(out)


@pytest.mark.parametrize(
    "norm_before_fc,draft_vocab", [(False, DRAFT_V), (True, DRAFT_V), (False, V)], ids=["reduced", "norm_fc", "full"]
)
def test_save_load_round_trip_is_bit_identical(tmp_path, norm_before_fc, draft_vocab):
    drafter = random_drafter(norm_before_fc, draft_vocab)
    save_eagle3(drafter, tmp_path / "out")
    loaded = load_eagle3(tmp_path / "out", embed=drafter.embed_tokens)
    assert loaded.config == drafter.config
    assert torch.equal(run_steps(loaded), run_steps(drafter))
    assert torch.equal(loaded.d2t, drafter.d2t) and torch.equal(loaded.t2d, drafter.t2d)


# Every name vLLM's Eagle3LlamaForCausalLM.load_weights accepts for a one-layer drafter
# (vllm/model_executor/models/llama_eagle3.py: "midlayer." → "layers.0." in LlamaModel.hf_to_vllm_mapper,
# q/k/v and gate/up stacked, d2t → draft_id_to_target_id, t2d skipped, non-lm_head names prefixed "model.").
VLLM_NAMES = {
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
}


def test_written_checkpoint_has_vllms_names_and_config_keys(tmp_path):
    drafter = random_drafter(norm_before_fc=True)
    save_eagle3(drafter, tmp_path / "out")
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    # input_norm only with norm_before_fc (LlamaModel.__init__); d2t/t2d only with a reduced vocabulary, since
    # Eagle3LlamaForCausalLM.__init__ creates draft_id_to_target_id only when draft_vocab_size != the target's;
    # no embed_tokens, so vLLM shares the target's (llm_base_proposer._maybe_share_embeddings).
    assert set(weights) == VLLM_NAMES | {"input_norm.weight", "d2t", "t2d"}
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    assert weights["input_norm.weight"].shape == (3 * H,) and weights["fc.weight"].shape == (H, 3 * H)
    assert weights["midlayer.self_attn.q_proj.weight"].shape == (HEADS * HD, 2 * H)

    config = json.loads((tmp_path / "out" / "config.json").read_text())
    # model_executor/models/registry.py maps this architecture to llama_eagle3.Eagle3LlamaForCausalLM
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    # config/speculative.py parses the draft config as the model_type's HF config, then wraps it in EAGLEConfig
    assert config["model_type"] == "llama"
    # llama_eagle3.py: LlamaModel builds num_hidden_layers layers, the first one with a 2H qkv input
    assert config["num_hidden_layers"] == 1 and config["hidden_act"] == "silu"
    # Eagle3LlamaForCausalLM.__init__: lm_head and logits over draft_vocab_size
    assert (config["draft_vocab_size"], config["vocab_size"]) == (DRAFT_V, V)
    # gpu_model_runner._get_eagle3_aux_layers_from_config and LlamaModel.__init__ (norm_before_fc, use_aux_hidden_state)
    assert config["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [2, 15, 27],
        "use_aux_hidden_state": True,
        "norm_before_fc": True,
    }
    assert not config["tie_word_embeddings"] and not config["attention_bias"]
    # the HF config vLLM builds from it carries our sizes and RoPE
    hf = LlamaConfig(**config)
    assert (hf.hidden_size, hf.num_key_value_heads, hf.head_dim) == (H, KV, HD)
    assert hf.rope_parameters["rope_theta"] == 10000.0
    assert Eagle3Config.from_hf(config) == drafter.config


def test_layer_ids_in_a_config_beat_the_default(tmp_path):
    config = published_config() | {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 10, 20]}}
    drafter = load_eagle3(write_published(tmp_path / "c", config=config), target_layers=TARGET_LAYERS)
    assert drafter.config.aux_layer_ids == (1, 10, 20)


def bad(weights_change=None, config_change=None):
    weights, config = published_weights(), published_config() | (config_change or {})
    (weights_change or (lambda w: None))(weights)
    return weights, config


@pytest.mark.parametrize(
    "case,weights_change,config_change,message",
    [
        ("missing weight", lambda w: w.pop("midlayer.hidden_norm.weight"), None, "missing weights.*hidden_norm"),
        ("missing d2t", lambda w: w.pop("d2t"), None, "missing weights.*d2t"),
        ("unknown weight", lambda w: w.update({"layers.1.fc.weight": torch.zeros(1)}), None, "unknown.*layers.1"),
        (
            "wrong shape",
            lambda w: w.update({"fc.weight": torch.zeros(H, 2 * H)}),
            None,
            r"fc.weight has shape \(32, 64\).*\(32, 96\)",
        ),
        ("config vs weights", None, {"intermediate_size": 2 * INTER}, "gate_proj.weight has shape"),
        ("d2t out of range", lambda w: w["d2t"].add_(V), None, "outside the target vocabulary"),
        ("two layers", None, {"num_hidden_layers": 2}, "num_hidden_layers=2 is not supported"),
        ("no layer ids, no depth", None, None, "give the target's layer count"),
    ],
)
def test_a_bad_checkpoint_says_what_is_wrong(tmp_path, case, weights_change, config_change, message):
    weights, config = bad(weights_change, config_change)
    directory = write_published(tmp_path / "c", weights, config)
    layers = None if case == "no layer ids, no depth" else TARGET_LAYERS
    with pytest.raises(UserError, match=message):
        load_eagle3(directory, target_layers=layers)


def test_missing_files_say_which(tmp_path):
    with pytest.raises(UserError, match="config.json missing"):
        load_eagle3(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(published_config()))
    with pytest.raises(UserError, match="model.safetensors or pytorch_model.bin missing"):
        load_eagle3(tmp_path, target_layers=TARGET_LAYERS)


def test_no_embedding_is_a_clear_error(tmp_path):
    drafter = load_eagle3(write_published(tmp_path / "c"), target_layers=TARGET_LAYERS)
    with pytest.raises(UserError, match="no token embedding"):
        drafter(torch.zeros(1, H), torch.tensor([0]), torch.tensor([0]), drafter.new_cache(2))


def test_t_positions_at_once_equal_t_single_steps_with_the_cache():
    drafter = random_drafter()
    torch.manual_seed(5)
    hidden, tokens, t = torch.randn(6, H), torch.randint(0, V, (6,)), 6
    positions = torch.arange(3, 3 + t)  # after a prefix of 3 already in the cache
    prefix = (torch.randn(3, H), torch.randint(0, V, (3,)), torch.arange(3))
    with torch.no_grad():
        batch_cache, step_cache = drafter.new_cache(16), drafter.new_cache(16)
        drafter(*prefix, batch_cache)
        drafter(*prefix, step_cache)
        at_once = drafter(hidden, tokens, positions, batch_cache)
        steps = [drafter(hidden[i : i + 1], tokens[i : i + 1], positions[i : i + 1], step_cache) for i in range(t)]
    for got, want in zip(at_once, (torch.cat(s) for s in zip(*steps, strict=True)), strict=True):
        assert torch.allclose(got, want, atol=1e-6, rtol=0)
    # and positions matter: RoPE makes the same inputs at other positions differ
    with torch.no_grad():
        other = drafter(hidden, tokens, positions + 7, drafter.new_cache(16))[0]
    assert not torch.allclose(other, at_once[0], atol=1e-3)


def test_crop_rolls_the_cache_back():
    drafter = random_drafter()
    torch.manual_seed(6)
    x, tokens = torch.randn(4, H), torch.randint(0, V, (4,))
    with torch.no_grad():
        cache = drafter.new_cache(8)
        first = drafter(x, tokens, torch.arange(4), cache)[0]
        cache.crop(2)
        again = drafter(x[2:], tokens[2:], torch.arange(2, 4), cache)[0]
    assert cache.length == 4 and torch.allclose(again, first[2:], atol=1e-6, rtol=0)
