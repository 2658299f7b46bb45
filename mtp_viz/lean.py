"""The lean forward: a Llama-family decoder run over a preallocated KV cache, without
transformers' per-call machinery.

transformers' `model.forward` spends, per call, as much time building masks, position tensors,
cache objects and output dataclasses as a small model spends on its own arithmetic (20 ms of a
~75 ms SmolLM2-135M forward on a 2-core CPU, measured). Decoding strategies call it hundreds of
times per answer, with 1 to a few dozen tokens each, so that cost is what makes a small draft, a
heads step or a tree verify cost more than its arithmetic.

`LeanModel` reads the model's own modules (its linears, norms, rotary tables and head, so a
FastLinear or an adapter inside them still applies) and does, per layer, only: norm, q/k/v, rotary,
write k/v into the cache in place, attention over the cached prefix, output, norm, MLP. The cache
(`StaticKV`) is one preallocated tensor per model: extend writes in place, rollback is a length,
and keeping a tree's accepted path moves only those entries. As in gpt-fast's `generate.py` and
transformers' static cache, shapes stay fixed (the capacity grows by doubling, rarely), so a
compiled forward (mtp_viz.compile) is reused from step to step.

Supported: decoder layers of the Llama family (Llama, Qwen2, Mistral without a sliding window) with
a static rotary embedding. Anything else runs on transformers' own forward (`supports` says why).
"""

from dataclasses import dataclass

import torch
from torch.nn import functional as F
from transformers import PreTrainedModel

SUPPORTED_ROPE = ("default", "linear", "llama3")  # position tables that do not depend on length
MIN_CAPACITY = 256


def supports(model: PreTrainedModel) -> str | None:
    """None when the lean forward can run `model`, else why not (one line)."""
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None or not len(layers) or getattr(decoder, "rotary_emb", None) is None:
        return f"{type(model).__name__} has no Llama-style decoder"
    attn, mlp = layers[0].self_attn, layers[0].mlp
    needed = ("q_proj", "k_proj", "v_proj", "o_proj")
    if not all(hasattr(attn, n) for n in needed) or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj")):
        return f"{type(model).__name__}'s layers are not Llama-style"
    if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
        return f"{type(model).__name__} normalises queries and keys"
    if any(t != "full_attention" for t in getattr(model.config, "layer_types", None) or ()):
        return f"{type(model).__name__} uses sliding-window attention"
    if getattr(decoder.rotary_emb, "rope_type", "default") not in SUPPORTED_ROPE:
        return f"rotary embedding {decoder.rotary_emb.rope_type!r} depends on the sequence length"
    return None


class StaticKV:
    """Key/values of every layer in one preallocated tensor (layers, 2, kv_heads, capacity, head_dim).

    Positions are slots: entry i holds the key/value of the token at sequence position i. What
    holds valid entries is tracked by the caller (CachedModel's `length`); rollback only moves it.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device, capacity: int):
        self.shape = (layers, 2, kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.data = torch.zeros(layers, 2, kv_heads, capacity, head_dim, dtype=dtype, device=device)

    @property
    def capacity(self) -> int:
        return self.data.shape[3]

    def ensure(self, needed: int) -> None:
        """Grow (doubling, copying the old entries) until `needed` slots fit."""
        if needed <= self.capacity:
            return
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        grown = self.data.new_zeros(*self.data.shape[:3], capacity, self.data.shape[4])
        grown[:, :, :, : self.capacity] = self.data
        self.data = grown

    def move(self, start: int, rows: list[int]) -> None:
        """Slots start..start+len(rows)−1 take the entries at start + r for r in rows (every layer)."""
        index = torch.tensor([start + r for r in rows], dtype=torch.long, device=self.device)
        self.data[:, :, :, start : start + len(rows)] = self.data.index_select(3, index)


@dataclass
class LeanModel:
    """A Llama-family model's modules, run lean. One per model (see `lean_model`); stateless
    between calls except for the rotary tables, which grow with the longest position seen."""

    model: PreTrainedModel

    def __post_init__(self):
        config = self.model.config
        decoder = self.model.model
        self.decoder = decoder
        self.layers = list(decoder.layers)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.scaling = attn.scaling
        self.head = self.model.get_output_embeddings()
        self.device, self.dtype = self.model.device, self.model.dtype
        self.cos = self.sin = torch.empty(0, self.head_dim, device=self.device, dtype=self.dtype)

    def new_cache(self, capacity: int = MIN_CAPACITY) -> StaticKV:
        return StaticKV(len(self.layers), self.kv_heads, self.head_dim, self.dtype, self.device, capacity)

    def rotary(self, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (S, head_dim) at `positions`, from the model's own rotary module (tabled once)."""
        longest = max(positions)
        if longest >= len(self.cos):
            size = max(MIN_CAPACITY, 2 * longest)
            every = torch.arange(size, device=self.device)[None]
            probe = torch.empty(0, device=self.device, dtype=self.dtype)
            cos, sin = self.decoder.rotary_emb(probe, every)  # (1, size, head_dim)
            self.cos, self.sin = cos[0], sin[0]
        if positions == list(range(positions[0], positions[0] + len(positions))):
            return self.cos[positions[0] : longest + 1], self.sin[positions[0] : longest + 1]
        index = torch.tensor(positions, device=self.device)
        return self.cos[index], self.sin[index]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """(S,) → (S, H)."""
        return self.decoder.embed_tokens(ids)

    def run(
        self,
        hidden: torch.Tensor,
        positions: list[int],
        kv: StaticKV,
        start: int,
        allowed: torch.Tensor | None,
        layers: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Run `layers` (first, last+1; default all) on hidden (S, H) at `positions`, writing their
        key/values into slots start..start+S−1 of `kv`; token i attends to the slots j < start+S
        that allowed[i, j] permits (None: every slot up to its own). Returns hidden (S, H)."""
        s = hidden.shape[0]
        end = start + s
        kv.ensure(end)
        first, last = layers or (0, len(self.layers))
        cos, sin = self.rotary(positions)
        slots = torch.arange(start, end, device=self.device)
        mask = None if allowed is None else allowed.to(self.device)[None, None]  # (1, 1, S, end)
        return self.core(hidden, cos, sin, slots, kv.data, mask, end, first, last)

    def core(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        kv: torch.Tensor,
        mask: torch.Tensor | None,
        end: int,
        first: int,
        last: int,
    ) -> torch.Tensor:
        """Layers first..last−1 on hidden (S, H); k/v written at `slots` of kv (layers, 2, kv_heads,
        capacity, d); attention over slots 0..end−1 under mask (1, 1, S, end) or none."""
        s = hidden.shape[0]
        for i in range(first, last):
            layer = self.layers[i]
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)  # (S, H)
            q = attn.q_proj(x).view(s, self.heads, self.head_dim).transpose(0, 1)  # (h, S, d)
            k = attn.k_proj(x).view(s, self.kv_heads, self.head_dim).transpose(0, 1)  # (kv, S, d)
            v = attn.v_proj(x).view(s, self.kv_heads, self.head_dim).transpose(0, 1)
            kv[i, 0].index_copy_(1, slots, rotate(k, cos, sin))
            kv[i, 1].index_copy_(1, slots, v)
            out = F.scaled_dot_product_attention(
                rotate(q, cos, sin)[None],
                kv[i, 0, :, :end][None],
                kv[i, 1, :, :end][None],
                attn_mask=mask,
                scale=self.scaling,
                enable_gqa=self.heads != self.kv_heads,
            )  # (1, h, S, d)
            hidden = hidden + attn.o_proj(out[0].transpose(0, 1).reshape(s, self.heads * self.head_dim))
            x = layer.post_attention_layernorm(hidden)
            mlp = layer.mlp
            hidden = hidden + mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
        return hidden

    def norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm: (n, H) → the hidden states the head reads (and MTP heads start from)."""
        return self.decoder.norm(hidden)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The head on normed hidden states: (n, H) → (n, V)."""
        return self.head(normed)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (heads, S, d) with cos, sin (S, d) (the rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


ATTRIBUTE = "_mtp_viz_lean"


def lean_model(model: PreTrainedModel) -> LeanModel | None:
    """The model's LeanModel (made once per model object), or None when it is not supported."""
    if supports(model) is not None:
        return None
    if ATTRIBUTE not in model.__dict__:
        model.__dict__[ATTRIBUTE] = LeanModel(model)
    return model.__dict__[ATTRIBUTE]
