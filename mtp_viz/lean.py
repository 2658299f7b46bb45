"""The lean forward: a Llama-family decoder run over a preallocated KV cache, without
transformers' per-call machinery (20 of ~75 ms a call, SmolLM2-135M on 2 CPU cores).

As in gpt-fast's model.py, a block is `h = x + attention(norm(x))` then `h + mlp(norm(h))`, over
the model's own norms, rotary tables and head; its four products are projections chosen before
the model runs (mtp_viz.projections: fused, LoRA stacked on, or the model's own modules). The cache
(mtp_viz.kv_slots.StaticKV) is one tensor per model: extend writes in place, rollback is a length.
Eager, a strategy's target attends one row at a time after the prompt (`run`'s exact_from): a
batched attention call's rows differ from one-token calls by ~1e-7, enough to tip a near-tie.
Compiled (`LeanModel.compile`), a CPU runs the static layer graph (mtp_viz.static: every row exact
by construction), a GPU the layer loop under CUDA graphs over the whole capacity under a mask.

Supported: decoder layers of the Llama family (Llama, Qwen2, Mistral without a sliding window) with
a static rotary embedding. Anything else runs on transformers' own forward (`supports` says why).
"""

import logging
import shutil
import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedModel

from mtp_viz import cuda_graphs, static
from mtp_viz.kv_slots import RowKeys, StaticKV, visibility
from mtp_viz.projections import Projections, StaticGate, held_modules, projections
from mtp_viz.static import CompileUnavailable

log = logging.getLogger(__name__)

SUPPORTED_ROPE = ("default", "linear", "llama3")  # position tables that do not depend on length
MIN_CAPACITY = 256

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin (S, head_dim)


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


def compile_unavailable(device: torch.device) -> str | None:
    """Why torch.compile cannot work on `device` here, or None."""
    if device.type == "cpu" and not (shutil.which("c++") or shutil.which("g++") or shutil.which("gcc")):
        return "no C++ compiler for inductor on this machine"
    if device.type not in ("cpu", "cuda"):
        return f"compilation is not set up for {device.type}"
    return None


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm: one fused op in float32; in half precision the module itself, whose
    roundings (normalise in float32, cast, then scale) transformers' greedy outputs rest on."""
    if x.dtype != torch.float32:
        return norm(x)
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


def rotate(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotary embedding of x (heads, S, d) with cos, sin (S, d) (the rotate-half layout)."""
    cos, sin = rope
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Block(nn.Module):
    """One decoder layer, run lean: the model's own norms and activation around its projections. An
    nn.Module so that torch.compile takes its sizes as constants (a plain object's would be symbolic)."""

    def __init__(self, layer: nn.Module, proj: Projections, config):
        super().__init__()
        self.attn_norm, self.mlp_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.act, self.proj = layer.mlp.act_fn, proj
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.scaling = layer.self_attn.head_dim, layer.self_attn.scaling

    def forward(self, x: torch.Tensor, kv: torch.Tensor, rope: Rope, slots: torch.Tensor, mask) -> torch.Tensor:
        """x (S, H) → (S, H); the layer's keys/values go into kv (2, kv_heads, width, d) at `slots`."""
        h = x + self.attention(rms_norm(self.attn_norm, x), kv, rope, slots, mask)
        return h + self.mlp(rms_norm(self.mlp_norm, h))

    def attention(
        self, x: torch.Tensor, kv: torch.Tensor, rope: Rope, slots: torch.Tensor, mask: torch.Tensor | RowKeys | None
    ) -> torch.Tensor:
        """Attention of x (S, H) over the cache's slots: under mask (1, 1, S, width), none (every
        slot), or one row at a time (RowKeys)."""
        s, q_size, kv_size = x.shape[0], self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = self.proj.qkv(x).split((q_size, kv_size, kv_size), dim=-1)  # (S, q), (S, kv), (S, kv)
        q = q.reshape(s, self.heads, self.head_dim).transpose(0, 1)  # (h, S, d)
        k = k.reshape(s, self.kv_heads, self.head_dim).transpose(0, 1)  # (kv, S, d)
        v = v.reshape(s, self.kv_heads, self.head_dim).transpose(0, 1)
        kv[0].index_copy_(1, slots, rotate(k, rope))
        kv[1].index_copy_(1, slots, v)
        q = rotate(q, rope)
        if isinstance(mask, RowKeys):
            out = q.new_empty(q.shape)  # (h, S, d)
            if mask.batched is not None:
                index, seen = mask.batched
                out[:, index] = self.attend(q[:, index], kv[0], kv[1], seen)
            for i, keys in enumerate(mask.rows):
                if keys is not None:
                    out[:, i : i + 1] = self.attend(q[:, i : i + 1], *mask.keys(kv, i), None)
        else:
            out = self.attend(q, kv[0], kv[1], mask)  # (h, S, d)
        return self.proj.o(out.transpose(0, 1).reshape(s, q_size))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Scaled dot-product attention of q (h, S, d) over k, v (kv_heads, n, d): (h, S, d)."""
        out = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask, scale=self.scaling, enable_gqa=self.heads != self.kv_heads
        )
        return out[0]

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The gated MLP of x (S, H)."""
        gate, up = self.proj.gate_up(x).chunk(2, dim=-1)  # (S, I) each
        return self.proj.down(self.act(gate) * up)


class LeanModel:
    """A Llama-family model's modules, run lean; one per model (`lean_model`), holding the model
    only weakly. Stateless between calls but for the rotary tables, grown to the longest position."""

    def __init__(self, model: PreTrainedModel):
        config, decoder = model.config, model.model
        self.model_ref, self.held, self.name = weakref.ref(model), held_modules(model), type(model).__name__
        self.decoder, self.layers = decoder, list(decoder.layers)
        self.head = model.get_output_embeddings()
        self.device, self.dtype = model.device, model.dtype
        self.kv_heads, self.head_dim = config.num_key_value_heads, self.layers[0].self_attn.head_dim
        self.cos = self.sin = torch.empty(0, self.head_dim, device=self.device, dtype=self.dtype)
        gate = getattr(decoder.embed_tokens, "gate", None)  # mask-only adapters: set by each embedding
        self.gate = None if gate is None else StaticGate(gate)
        made = [projections(layer, self.gate) for layer in self.layers]
        self.blocks = [Block(layer, p, config) for layer, (p, _) in zip(self.layers, made, strict=True)]
        # the same blocks with the LoRA adapters stacked on; None without adapters
        stacked = [Block(layer, lora or p, config) for layer, (p, lora) in zip(self.layers, made, strict=True)]
        self.adapted = stacked if any(lora is not None for _, lora in made) else None
        self.compiled = False  # whether `run` uses a compiled form (made once, by `compile`):
        self.static: static.StaticForward | None = None  # on a CPU: the layer graph compiled ahead of time
        self.graph: Callable | None = None  # on a GPU: the `loop` under torch.compile and CUDA graphs

    def current(self) -> bool:
        """False once the model is gone, a module it runs by was replaced (`held_modules`), or the
        weights were moved or replaced under the fused products (their views went stale)."""
        model = self.model_ref()
        held = model is not None and model.device == self.device and held_modules(model) == self.held
        return held and all(b.proj.current() for b in self.blocks + (self.adapted or []))

    def new_cache(self, capacity: int = MIN_CAPACITY) -> StaticKV:
        return StaticKV(len(self.layers), self.kv_heads, self.head_dim, self.dtype, self.device, capacity)

    def rotary(self, positions: list[int]) -> Rope:
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
        exact_from: int | None = None,
        loose: tuple[int, ...] = (),
    ) -> torch.Tensor:
        """Run `layers` (first, last+1; default all) on hidden (S, H) at `positions`, writing their
        key/values into slots start..start+S−1 of `kv`; token i attends to the slots j < start+S
        that allowed[i, j] permits (None: every slot up to its own). Returns hidden (S, H).
        exact_from (eager only): rows at slots from there on attend one at a time (RowKeys), as a
        one-token forward does; rows before it (a prompt but its last token) run first, batched. A
        strategy's target passes the prompt's length − 1, so its verify rows equal autoregressive
        steps bit for bit where the products are row-invariant (mtp_viz.row_plan sees to that).
        `loose`: rows (indices into hidden) whose result decides nothing, attending batched."""
        return self.run_tapped(hidden, positions, kv, start, allowed, (), layers, exact_from, loose)[0]

    def run_tapped(
        self,
        hidden: torch.Tensor,
        positions: list[int],
        kv: StaticKV,
        start: int,
        allowed: torch.Tensor | None,
        taps: tuple[int, ...],
        layers: tuple[int, int] | None = None,
        exact_from: int | None = None,
        loose: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`run`, also returning the residual stream after each of `taps` layers (transformers'
        hidden_states[k]; an EAGLE-3 drafter's features): (S, H) each, in tap order. The loop runs in
        segments between the taps over the same mask and cache: each row as untapped, bit for bit."""
        s, end = hidden.shape[0], start + hidden.shape[0]
        adapted = self.adapters_on()
        static_fits = self.compiled and self.static is not None and self.static.fits(s)
        if static_fits and (not adapted or self.static.adapted_ready()):
            kv.ensure(end)  # every row exact by construction (mtp_viz.static), prompt rows included
            first_last = layers or (0, len(self.blocks))
            return self.static.run(hidden, positions, kv, start, allowed, *first_last, taps, adapted)
        exact = exact_from is not None and not (self.compiled and self.graph is not None)
        if exact and start < exact_from < end:  # the prompt's prefill first, batched
            m = exact_from - start
            seen = None if allowed is None else allowed[:m, : start + m]
            done, done_taps = self.run_tapped(hidden[:m], positions[:m], kv, start, seen, taps, layers, None)
            rest = None if allowed is None else allowed[m:]
            later = tuple(i - m for i in loose if i >= m)
            out, more = self.run_tapped(
                hidden[m:], positions[m:], kv, exact_from, rest, taps, layers, exact_from, later
            )
            return torch.cat([done, out]), [torch.cat(pair) for pair in zip(done_taps, more, strict=True)]
        kv.ensure(end)
        first, last = layers or (0, len(self.blocks))
        assert all(first <= k <= last for k in taps), f"taps {taps} outside layers {first}..{last}"
        # compiled: attend over the whole capacity, so shapes stay fixed and one graph serves every step
        width = kv.capacity if self.graph is not None and self.compiled else end
        if exact and start >= exact_from and s > 1:
            mask = RowKeys.of(allowed, start, s, self.device, loose)
        else:
            mask = visibility(allowed, s, end, width, self.device)
        slots = torch.arange(start, end, device=self.device)
        loop = self.graph if self.compiled and self.graph is not None else self.loop
        rope = self.rotary(positions)
        bounds = sorted({first, last, *taps})
        after = {first: hidden}  # layer count → the residual stream after it
        try:
            for a, b in zip(bounds, bounds[1:], strict=False):
                after[b] = loop(after[a], rope, slots, kv.data, mask, width, a, b, adapted)
            return after[last], [after[k] for k in taps]
        except RuntimeError as e:  # torch.compile's stack and CUDA graphs raise these; our own bugs are other types
            if not self.compiled:
                raise
            log.warning("the compiled forward failed (%s: %s); eager from here on", type(e).__name__, str(e)[:200])
            self.compiled = False
            return self.run_tapped(hidden, positions, kv, start, allowed, taps, layers, exact_from, loose)

    def loop(
        self,
        hidden: torch.Tensor,
        rope: Rope,
        slots: torch.Tensor,
        kv: torch.Tensor,
        mask: torch.Tensor | RowKeys | None,
        width: int,
        first: int,
        last: int,
        adapted: bool,
    ) -> torch.Tensor:
        """Blocks first..last−1 on hidden (S, H), over the first `width` slots of kv (layers, 2,
        kv_heads, capacity, d); adapted: the blocks with the stacked LoRA terms. What `compile` compiles."""
        blocks = self.adapted if adapted else self.blocks
        kv = kv[:, :, :, :width]  # (layers, 2, kv_heads, width, d)
        for i in range(first, last):
            hidden = blocks[i](hidden, kv[i], rope, slots, mask)
        return hidden

    def adapters_on(self) -> bool:
        """Whether this forward adds the LoRA terms: not while peft's adapters are off; a gated one
        (mask-token MTP) only when the input has a mask token, which the embedding just marked."""
        if self.adapted is None or self.layers[0].self_attn.q_proj.disable_adapters:
            return False
        return self.gate is None or bool(self.gate.load().any())

    def compile(self, build_adapted: bool = True) -> float:
        """Compile the forward once per model and process: on a CPU the static layer graph
        (mtp_viz.static: compiled ahead of time once per machine, then loaded from the cache), on a
        GPU the layer loop under torch.compile and CUDA graphs, both shape families (one token;
        several) run once on a scratch cache. Returns the seconds it took; CompileUnavailable (eager
        stays in use) when it cannot work here. build_adapted: on a CPU, build the adapted graph of a
        model with LoRA adapters now (else its forwards with adapters on stay eager until a build
        elsewhere leaves it in the cache)."""
        if self.static is not None or self.graph is not None:
            self.compiled = True
            return 0.0
        if reason := compile_unavailable(self.device):
            raise CompileUnavailable(reason)
        if self.device.type == "cpu":
            try:
                self.static = static.load_or_compile(self, build_adapted)
            except Exception as e:  # no kernels, an unsupported model, a toolchain piece missing: said, not hidden
                raise CompileUnavailable(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
            self.compiled = True
            return self.static.seconds
        self.graph = cuda_graphs.compile_loop(self)
        self.compiled = True
        return cuda_graphs.warm_up(self)

    def decompile(self) -> None:
        """Back to the eager forward (the compiled one is kept for a later `compile`)."""
        self.compiled = False

    def norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm: (n, H) → the hidden states the head reads (and MTP heads start from)."""
        return self.decoder.norm(hidden)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The head on normed hidden states: (n, H) → (n, V)."""
        return self.head(normed)


_leans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → its LeanModel, gone with the model


def lean_model(model: PreTrainedModel) -> LeanModel | None:
    """The model's LeanModel (made once per model object, again once stale), None if unsupported."""
    if supports(model) is not None:
        return None
    lean = _leans.get(model)
    if lean is None or not lean.current():
        lean = _leans[model] = LeanModel(model)
    return lean
