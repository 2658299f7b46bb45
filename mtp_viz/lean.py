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
transformers' static cache, a compiled forward (`LeanModel.compile`: CUDA graphs on a GPU, inductor
on a CPU) attends over the whole capacity under a mask, so its shapes stay fixed from step to step
(the capacity grows by doubling, rarely) and one graph serves every step.

Supported: decoder layers of the Llama family (Llama, Qwen2, Mistral without a sliding window) with
a static rotary embedding. Anything else runs on transformers' own forward (`supports` says why).
"""

import logging
import shutil
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedModel

from mtp_viz.kernels import STOCK_PLAN, FastLinear, fast_linear

log = logging.getLogger(__name__)

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
    if not hasattr(layers[0].input_layernorm, "variance_epsilon"):
        return f"{type(model).__name__}'s norms are not RMSNorms"
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
        self.device = device
        self.data = self._alloc(torch.zeros(layers, 2, kv_heads, capacity, head_dim, dtype=dtype, device=device))

    @staticmethod
    def _alloc(data: torch.Tensor) -> torch.Tensor:
        if data.device.type == "cuda":  # CUDA graphs replay against a fixed address
            torch._dynamo.mark_static_address(data)
        return data

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
        self.data = self._alloc(grown)

    def move(self, start: int, rows: list[int]) -> None:
        """Slots start..start+len(rows)−1 take the entries at start + r for r in rows (every layer)."""
        index = torch.tensor([start + r for r in rows], dtype=torch.long, device=self.device)
        self.data[:, :, :, start : start + len(rows)] = self.data.index_select(3, index)


@dataclass
class StackedLoRA:
    """A layer's LoRA terms (peft, one active adapter), stacked so that projections reading the
    same input share two small products: x·Aᵀ (S, Σr), gated, then ·Bᵀ added to the base output
    in the same product (addmm), with B block-diagonal and the scaling folded in. Copies of the
    adapter's matrices, stored transposed so both products are plain ones, remade when they
    change (`current`)."""

    qkv: tuple[torch.Tensor, torch.Tensor]  # Aᵀ (H, 3r), Bᵀ (3r, q + 2·kv)
    gate_up: tuple[torch.Tensor, torch.Tensor]  # Aᵀ (H, 2r), Bᵀ (2r, 2·I)
    o: tuple[torch.Tensor, torch.Tensor]
    down: tuple[torch.Tensor, torch.Tensor]
    sources: list[tuple[torch.Tensor, int]]  # each adapter matrix and its version when stacked

    def current(self) -> bool:
        return all(p._version == version for p, version in self.sources)


@dataclass
class Fused:
    """One layer's projections that read the same input, as one weight each: q|k|v and gate|up.

    The model's own modules keep their parameters, as views into these tensors (no second copy),
    so state dicts, training and FastLinear see what they saw before. Where the modules carry
    LoRA adapters (peft, e.g. a mask-token MTP model), their base weights are fused and the
    adapters' terms stacked (`lora`)."""

    qkv: torch.Tensor  # (q + 2·kv, H)
    qkv_bias: torch.Tensor | None
    gate_up: torch.Tensor  # (2·I, H)
    lora: StackedLoRA | None = None


def base_linear(module: nn.Module) -> nn.Module:
    """The plain linear under an adapter wrapper (peft's `base_layer`), or the module itself."""
    return getattr(module, "base_layer", module)


def _single_lora(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(A (r, in), B·scaling (out, r)) of a peft LoRA layer with exactly one plain adapter, else None."""
    names = list(getattr(module, "lora_A", {}))
    if len(names) != 1 or module.merged or list(module.active_adapters) != names:
        return None
    name = names[0]
    if not isinstance(module.lora_dropout[name], nn.Identity) or module.use_dora.get(name):
        return None
    if getattr(module.lora_B[name], "bias", None) is not None:
        return None
    return module.lora_A[name].weight, module.lora_B[name].weight


def stack_lora(modules: tuple[nn.Module, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(stacked A, block-diagonal B with the scalings folded in), each transposed, of LoRA layers
    reading one input."""
    pairs = [_single_lora(m) for m in modules]
    if any(p is None for p in pairs):
        return None
    with torch.no_grad():
        a = torch.cat([a for a, _ in pairs])
        b = torch.block_diag(*[b * m.scaling[next(iter(m.lora_A))] for (_, b), m in zip(pairs, modules, strict=True)])
    return a.t().contiguous(), b.t().contiguous()


def layer_lora(layer) -> StackedLoRA | None | bool:
    """The layer's stacked LoRA terms; None without adapters; False when they cannot be stacked."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj), (attn.o_proj,), (mlp.down_proj,))
    wrapped = [m for group in groups for m in group if hasattr(m, "lora_A")]
    if not wrapped:
        return None
    stacked = [stack_lora(group) for group in groups]
    if len(wrapped) != sum(map(len, groups)) or any(x is None for x in stacked):
        return False
    sources = [
        (p, p._version)
        for m in wrapped
        for p in (m.lora_A[next(iter(m.lora_A))].weight, m.lora_B[next(iter(m.lora_B))].weight)
    ]
    return StackedLoRA(*stacked, sources=sources)


def plus_lora(
    out: torch.Tensor, x: torch.Tensor, ab: tuple[torch.Tensor, torch.Tensor], gate: torch.Tensor | None
) -> torch.Tensor:
    """out (S, Σout) + the stacked adapters' terms of x (S, in), times the mask gate (S, 1) where
    there is one: the gate scales the small (S, Σr) product, and the second product adds itself
    to `out` (three ops, none as wide as `out` but the last)."""
    low = torch.mm(x, ab[0])
    return torch.addmm(out, low if gate is None else low * gate, ab[1])


def fuse(layer) -> Fused | None:
    """Fuse a layer's q/k/v and gate/up weights in place (their modules' weights become views);
    None when they cannot be (other wrappers on them, adapters it cannot stack, mixed biases or
    placements)."""
    attn, mlp = layer.self_attn, layer.mlp
    mods = tuple(base_linear(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj))
    qkv_mods, gu_mods = mods[:3], mods[3:]
    lora = layer_lora(layer)
    if lora is False or not all(isinstance(m, nn.Linear) for m in mods):
        return None
    if len({(m.weight.device, m.weight.dtype) for m in mods}) != 1 or gu_mods[0].bias is not None:
        return None
    biases = [m.bias for m in qkv_mods]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    with torch.no_grad():
        qkv = _fuse_into([m.weight for m in qkv_mods])
        qkv_bias = None if biases[0] is None else _fuse_into(biases)
        gate_up = _fuse_into([m.weight for m in gu_mods])
    return Fused(qkv, qkv_bias, gate_up, lora)


def _fuse_into(params: list[nn.Parameter]) -> torch.Tensor:
    """Concatenate parameters along dim 0 and make each one a view of its rows of the result;
    parameters that already are consecutive views of one tensor (another model sharing these
    weights fused them) keep it."""
    first = params[0].data
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    if all(
        p.data.is_contiguous()
        and p.data.untyped_storage().data_ptr() == storage
        and p.data.storage_offset() == offset + sum(q.numel() for q in params[:i])
        for i, p in enumerate(params)
    ):
        shape = (sum(len(p) for p in params), *first.shape[1:])
        return first.new_empty(0).set_(first.untyped_storage(), offset, shape, first.stride())
    whole = torch.cat([p.data for p in params])
    row = 0
    for p in params:
        p.data = whole[row : row + p.shape[0]]
        row += p.shape[0]
    return whole


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
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.fused = [fuse(layer) for layer in self.layers]
        self.adapted = any(f is not None and f.lora is not None for f in self.fused)
        self.gate = getattr(decoder.embed_tokens, "gate", None)  # mask-only adapters: set by each embedding
        self._compiled = None  # the compiled layer loop, once made (see `compile`)
        self.use_compiled = False

    def current(self) -> bool:
        """False once the model's weights were moved or replaced (the fused views went stale)."""
        return (
            all(
                f is None
                or base_linear(layer.self_attn.q_proj).weight.data_ptr() == f.qkv.data_ptr()
                and (f.lora is None or f.lora.current())
                for layer, f in zip(self.layers, self.fused, strict=True)
            )
            and self.device == self.model.device
        )

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
        if self.compiled is None:  # eager: attend over the filled slots only
            mask = None if allowed is None else allowed.to(self.device)[None, None]  # (1, 1, S, end)
            return self.core(hidden, cos, sin, slots, kv.data, mask, end, first, last, *self.adapter_state())
        # compiled: fixed shapes, so every step reuses one graph; attend over the whole capacity
        full = torch.zeros(s, kv.capacity, dtype=torch.bool)
        full[:, :end] = True if allowed is None else allowed
        mask = full.to(self.device)[None, None]
        try:
            return self.compiled(
                hidden, cos, sin, slots, kv.data, mask, kv.capacity, first, last, *self.adapter_state()
            )
        except Exception as e:  # a shape or op the warm-up did not meet: eager from here on, never a crash
            log.warning("the compiled forward failed (%s: %s); running eager", type(e).__name__, str(e)[:200])
            self._compiled, self.use_compiled = None, False
            mask = None if allowed is None else allowed.to(self.device)[None, None]
            return self.core(hidden, cos, sin, slots, kv.data, mask, end, first, last, *self.adapter_state())

    def adapter_state(self) -> tuple[bool, torch.Tensor | None]:
        """(whether this forward adds the LoRA terms, the mask gate (S, 1) or None): a gated
        adapter (mask-token MTP) only when the input has a mask, which the embedding just marked;
        none while peft's adapters are switched off."""
        if not self.adapted or self.layers[0].self_attn.q_proj.disable_adapters:
            return False, None
        if self.gate is None:
            return True, None
        gate = self.gate.value
        return bool(gate.any()), gate

    @property
    def compiled(self):
        """The compiled layer loop when compilation is on, else None (eager)."""
        return self._compiled if self.use_compiled else None

    def compile(self) -> float:
        """Compile the layer loop (CUDA graphs on a GPU, inductor on a CPU) and run both shape
        families (one token; several) once, on a scratch cache; once per model and process.
        Returns the seconds it took now. Raises CompileUnavailable (eager stays in use) when it
        cannot work here."""
        if self._compiled is not None:
            self.use_compiled = True
            return 0.0
        reason = compile_unavailable(self.device)
        if reason:
            raise CompileUnavailable(reason)
        log.warning("compiling the forward of %s once for this process (%s)", type(self.model).__name__, self.device)
        start = time.perf_counter()
        cuda = self.device.type == "cuda"
        self._compiled = torch.compile(self.core, mode="reduce-overhead" if cuda else "default", dynamic=True)
        self.use_compiled = True
        try:
            with torch.inference_mode():
                scratch = self.new_cache()
                for n in (1, 2, 3):  # 1 is its own graph; 2 and 3 make the row count symbolic
                    ids = torch.zeros(n, dtype=torch.long, device=self.device)
                    self.run(self.embed(ids), list(range(n)), scratch, 0, None if n == 1 else causal(n))
            if cuda:
                torch.cuda.synchronize(self.device)
        except Exception as e:  # an op it cannot trace, a missing toolchain piece, an old torch
            self._compiled, self.use_compiled = None, False
            raise CompileUnavailable(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
        return time.perf_counter() - start

    def decompile(self) -> None:
        """Back to the eager forward (the compiled one is kept for a later `compile`)."""
        self.use_compiled = False

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
        adapters: bool = False,
        gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Layers first..last−1 on hidden (S, H); k/v written at `slots` of kv (layers, 2, kv_heads,
        capacity, d); attention over slots 0..end−1 under mask (1, 1, S, end) or none. adapters:
        add the stacked LoRA terms, times gate (S, 1) where the adapter is gated to mask tokens."""
        s = hidden.shape[0]
        for i in range(first, last):
            layer, fused = self.layers[i], self.fused[i]
            attn, mlp = layer.self_attn, layer.mlp
            lora = fused.lora if fused is not None and adapters else None
            x = rms_norm(layer.input_layernorm, hidden)  # (S, H)
            if fused is not None:
                qkv = fast_linear(x, fused.qkv, fused.qkv_bias, plan_of_linear(base_linear(attn.q_proj)))
                if lora is not None:
                    qkv = plus_lora(qkv, x, lora.qkv, gate)
                q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)  # (S, q), (S, kv), (S, kv)
            else:
                q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            q = q.reshape(s, self.heads, self.head_dim).transpose(0, 1)  # (h, S, d)
            k = k.reshape(s, self.kv_heads, self.head_dim).transpose(0, 1)  # (kv, S, d)
            v = v.reshape(s, self.kv_heads, self.head_dim).transpose(0, 1)
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
            o_in = out[0].transpose(0, 1).reshape(s, self.q_size)
            o_proj = attn.o_proj if fused is None else base_linear(attn.o_proj)
            hidden = hidden + o_proj(o_in)
            if lora is not None:
                hidden = plus_lora(hidden, o_in, lora.o, gate)
            x = rms_norm(layer.post_attention_layernorm, hidden)
            if fused is not None:
                gate_up = fast_linear(x, fused.gate_up, None, plan_of_linear(base_linear(mlp.gate_proj)))
                if lora is not None:
                    gate_up = plus_lora(gate_up, x, lora.gate_up, gate)
                g, up = gate_up.chunk(2, dim=-1)  # (S, I) each
            else:
                g, up = mlp.gate_proj(x), mlp.up_proj(x)
            d_in = mlp.act_fn(g) * up
            down = mlp.down_proj if fused is None else base_linear(mlp.down_proj)
            hidden = hidden + down(d_in)
            if lora is not None:
                hidden = plus_lora(hidden, d_in, lora.down, gate)
        return hidden

    def norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm: (n, H) → the hidden states the head reads (and MTP heads start from)."""
        return self.decoder.norm(hidden)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The head on normed hidden states: (n, H) → (n, V)."""
        return self.head(normed)


class CompileUnavailable(RuntimeError):
    """torch.compile cannot run here; the eager lean forward is used."""


def compile_unavailable(device: torch.device) -> str | None:
    """Why torch.compile cannot work on `device` here, or None."""
    if device.type == "cpu" and not (shutil.which("c++") or shutil.which("g++") or shutil.which("gcc")):
        return "no C++ compiler for inductor on this machine"
    if device.type not in ("cpu", "cuda"):
        return f"compilation is not set up for {device.type}"
    return None


def causal(n: int) -> torch.Tensor:
    """(n, n) bool lower triangle."""
    return torch.ones(n, n, dtype=torch.bool).tril()


def plan_of_linear(module: nn.Module):
    """The linear path a module runs under now (FastLinear's plan; F.linear for a plain nn.Linear)."""
    return module.plan if isinstance(module, FastLinear) else STOCK_PLAN


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm: one fused op in float32; in half precision the module itself, whose
    roundings (normalise in float32, cast, then scale) transformers' greedy outputs rest on."""
    if x.dtype != torch.float32:
        return norm(x)
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


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
    lean = model.__dict__.get(ATTRIBUTE)
    if lean is None or not lean.current():
        lean = model.__dict__[ATTRIBUTE] = LeanModel(model)
    return lean
