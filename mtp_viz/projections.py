"""The linear products a lean block calls, and the transforms that make them fast.

A block (mtp_viz.lean) calls four projections per layer: q|k|v and o in attention, gate|up and
down in the MLP. Each is an object called as `p(x)`, (S, in) → (S, out). What stands behind it is
chosen before the model runs, as gpt-fast's quantize.py swaps linears, so the block's forward
reads the same whatever it is:
- `plain`: the model's own modules (a FastLinear, or a peft adapter wrapping one, still applies);
- `fused`: q|k|v and gate|up as one weight each (the modules' weights become views of it), run
  by `fast_linear` under the plan of the modules it fused;
- `with_lora`: the layer's peft LoRA adapters stacked on those, so projections reading the same
  input share two small products, gated to mask tokens where the adapter is (mask-token MTP).
A weight format (mtp_viz.weights: bf16, int8, 4-bit codes) is one more such transform: its linears
hold their weights in that format and compute `p(x)` with the kernel for it; `fused` joins q|k|v
and gate|up in the format, and LoRA stacks on them as on any base.
"""

from dataclasses import dataclass, fields
from typing import Protocol

import torch
from torch import nn

from mtp_viz.kernels import RAW_ROWS, STOCK_PLAN, FastLinear, Plan, RowPlan, planned_linear
from mtp_viz.weights import FormatLinear, fuse

MIN_GATE_ROWS = 64


class Projection(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class Gate(Protocol):
    """Which rows of the current forward are mask tokens, written by the embedding (drafters.mask)."""

    value: torch.Tensor  # (S, 1): 1.0 at a mask token, else 0.0


class StaticGate:
    """The current forward's mask gate in a tensor that stays put, as CUDA graphs need (the
    embedding writes a new `source.value` each forward; `load` copies it into `rows`)."""

    def __init__(self, source: Gate):
        self.source = source
        self.rows = torch.zeros(0, 1)

    def load(self) -> torch.Tensor:
        """Copy the source's gate in (growing by doubling); returns it."""
        value = self.source.value  # (S, 1)
        rows = self.rows
        if len(value) > len(rows) or (rows.device, rows.dtype) != (value.device, value.dtype):
            self.rows = rows = value.new_zeros(max(MIN_GATE_ROWS, 2 * len(value)), 1)
        rows[: len(value)].copy_(value)
        return value


def base_linear(module: nn.Module) -> nn.Module:
    """The plain linear under an adapter wrapper (peft's `base_layer`), or the module itself."""
    return getattr(module, "base_layer", module)


def plan_of_linear(module: nn.Module) -> tuple[Plan, RowPlan]:
    """The linear path and row plan a module runs under now (FastLinear's; F.linear as is for a
    plain nn.Linear)."""
    return (module.plan, module.row_plan) if isinstance(module, FastLinear) else (STOCK_PLAN, RAW_ROWS)


@dataclass
class Concat:
    """Several of the model's own modules reading one input, their outputs side by side."""

    modules: tuple[nn.Module, ...]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([m(x) for m in self.modules], dim=-1)


@dataclass
class FusedLinear:
    """Linears reading one input, as one weight whose rows the modules' own weights are views of
    (no second copy: state dicts, training and FastLinear see what they saw before)."""

    weight: torch.Tensor  # (Σout, in)
    bias: torch.Tensor | None
    source: nn.Module  # the first fused linear: its plan now, and whether its weight still is ours

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # the plan is read at each call: switching the model's linear path switches this product too
        return planned_linear(x, self.weight, self.bias, *plan_of_linear(self.source))

    def current(self) -> bool:
        """Whether the first fused linear's weight still is a view of this one. A storage check on
        purpose: the weight can be replaced under the same module (`model.to`, `.data` assigned),
        which its type does not show; a module replaced outright shows in `held_modules`."""
        return self.source.weight.data_ptr() == self.weight.data_ptr()


@dataclass
class StackedLoRA:
    """A projection plus the LoRA terms of the modules it stands for (peft, one active adapter):
    x·Aᵀ (S, Σr), times the mask gate where there is one, then ·Bᵀ added to the base output in the
    same product (addmm), with B block-diagonal and the scalings folded in. A and B are copies,
    stored transposed so both products are plain ones, remade when the adapter changes (`current`)."""

    base: Projection
    a: torch.Tensor  # Aᵀ (in, Σr)
    b: torch.Tensor  # Bᵀ (Σr, Σout)
    gate: StaticGate | None
    sources: list[tuple[torch.Tensor, int]]  # each adapter matrix and its version when stacked

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        low = torch.mm(x, self.a)  # (S, Σr): the gate scales this, the narrow product
        if self.gate is not None:
            low = low * self.gate.rows[: x.shape[0]]
        return torch.addmm(self.base(x), low, self.b)

    def current(self) -> bool:
        return all(p._version == version for p, version in self.sources) and _current(self.base)


@dataclass
class Projections:
    """One layer's four products, as its block calls them."""

    qkv: Projection  # (S, H) → (S, q + 2·kv)
    o: Projection  # (S, q) → (S, H)
    gate_up: Projection  # (S, H) → (S, 2·I)
    down: Projection  # (S, I) → (S, H)

    def current(self) -> bool:
        """False once a transform's view or copy of the model's weights went stale."""
        return all(_current(getattr(self, f.name)) for f in fields(self))


def _current(p: Projection) -> bool:
    return p.current() if isinstance(p, (FusedLinear, StackedLoRA, FormatLinear)) else True


def groups(layer: nn.Module) -> tuple[tuple[nn.Module, ...], ...]:
    """The layer's linears by the projection they make up: q|k|v, o, gate|up, down."""
    attn, mlp = layer.self_attn, layer.mlp
    return (attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,), (mlp.gate_proj, mlp.up_proj), (mlp.down_proj,)


def held_modules(model: nn.Module) -> tuple[nn.Module, ...]:
    """The modules a lean forward (mtp_viz.lean) runs a Llama-style `model` by: its embedding,
    layers, their linears (and those under adapters) and its head. A transform that puts another
    module in one's place (a FastLinear, a weight format's linear) makes a lean view made before
    stale: compared by identity, as the modules' types say what they compute."""
    decoder = model.model
    linears = [m for layer in decoder.layers for group in groups(layer) for m in group]
    return (decoder.embed_tokens, *decoder.layers, *linears, *map(base_linear, linears), model.get_output_embeddings())


def plain(layer: nn.Module) -> Projections:
    """The layer's own modules, unchanged: what runs where no transform applies."""
    return Projections(*(group[0] if len(group) == 1 else Concat(group) for group in groups(layer)))


def projections(layer: nn.Module, gate: StaticGate | None) -> tuple[Projections, Projections | None]:
    """The layer's products for the lean forward: (without adapters, with its LoRA adapters stacked
    on, or None when it has none). Fused where it can be; otherwise the model's own modules, whose
    peft adapters then apply themselves."""
    modules = [m for group in groups(layer) for m in group]
    adapted = any(hasattr(m, "lora_A") for m in modules)
    base = None if adapted and not all(_single_lora(m) for m in modules) else fused(layer)
    if base is None:
        return plain(layer), None
    return base, with_lora(base, layer, gate) if adapted else None


def fused(layer: nn.Module) -> Projections | None:
    """q|k|v and gate|up fused in place (their modules' weights become views), o and down the
    plain linears under any adapter; None when the linears are not plain ones of one device and
    dtype, or their biases are mixed."""
    (q, k, v), (o,), (g, u), (down,) = [tuple(base_linear(m) for m in group) for group in groups(layer)]
    mods = (q, k, v, g, u)
    if any(isinstance(m, FormatLinear) for m in mods):  # a weight format: fused in it (mtp_viz.weights)
        qkv, gate_up = fuse((q, k, v)), fuse((g, u))
        return None if qkv is None or gate_up is None else Projections(qkv, o, gate_up, down)
    if not all(isinstance(m, nn.Linear) for m in mods) or g.bias is not None:
        return None
    if len({(m.weight.device, m.weight.dtype) for m in mods}) != 1:
        return None
    biases = [m.bias for m in (q, k, v)]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    with torch.no_grad():
        qkv = _fuse_into([m.weight for m in (q, k, v)])
        qkv_bias = None if biases[0] is None else _fuse_into(biases)
        gate_up = _fuse_into([g.weight, u.weight])
    return Projections(FusedLinear(qkv, qkv_bias, q), o, FusedLinear(gate_up, None, g), down)


def with_lora(base: Projections, layer: nn.Module, gate: StaticGate | None) -> Projections:
    """`base` (products of the plain linears) with the layer's LoRA adapters stacked on each."""
    stacked = []
    for p, group in zip((base.qkv, base.o, base.gate_up, base.down), groups(layer), strict=True):
        a, b = _stack(group)
        sources = [(t, t._version) for m in group for t in _single_lora(m)]
        stacked.append(StackedLoRA(p, a, b, gate, sources))
    return Projections(*stacked)


def _single_lora(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(A (r, in), B (out, r)) of a peft LoRA layer with exactly one plain adapter, else None."""
    names = list(getattr(module, "lora_A", {}))
    if len(names) != 1 or module.merged or list(module.active_adapters) != names:
        return None
    name = names[0]
    if not isinstance(module.lora_dropout[name], nn.Identity) or module.use_dora.get(name):
        return None
    if getattr(module.lora_B[name], "bias", None) is not None:
        return None
    return module.lora_A[name].weight, module.lora_B[name].weight


def _stack(modules: tuple[nn.Module, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(stacked A, block-diagonal B with the scalings folded in), each transposed, of LoRA layers
    reading one input."""
    pairs = [_single_lora(m) for m in modules]
    with torch.no_grad():
        a = torch.cat([a for a, _ in pairs])
        b = torch.block_diag(*[b * m.scaling[next(iter(m.lora_A))] for (_, b), m in zip(pairs, modules, strict=True)])
    return a.t().contiguous(), b.t().contiguous()


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
