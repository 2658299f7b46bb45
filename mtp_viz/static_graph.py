"""The decoder layer as mtp_viz.static compiles it: what a graph is specialised on (`LayerConfig`),
the graph (`LayerGraph`: every tensor an input, weights included, so one package serves every
layer), the tensors a layer hands it (`Layer`), and its export and compilation into a package.

The plain graph computes norm, q|k|v, rotary, cache write, attention, o, norm, gate|up and down
with mtp-viz's CPU kernels (mtp_viz.native), so each row is what a one-token forward computes. The
adapted graph (`LayerConfig.lora`) adds each projection's stacked LoRA terms, gated per row.
"""

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from mtp_viz import native
from mtp_viz.format_linear import Q4
from mtp_viz.measured import fingerprint

MAX_ROWS = 64  # a forward of more rows (a long prompt's prefill) runs eager
EXAMPLE = {"rows": 3, "width": 200, "capacity": 512}  # shapes traced (all symbolic)
NAMES = ("qkv", "o", "gate_up", "down")  # a layer's projections, in the graph's order


@dataclass(frozen=True)
class LayerConfig:
    """What a layer's graph is specialised on: its sizes and the format its products read."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scaling: float
    fmt: str  # fp32 | q4
    lora: tuple[int, ...] = ()  # the adapted graph: Σr of each projection's stacked LoRA (q|k|v, o, gate|up, down)

    def __post_init__(self):  # a list from JSON (the build process's argument) keys as the tuple does
        object.__setattr__(self, "lora", tuple(self.lora))

    def key(self) -> str:
        return fingerprint(repr(sorted(asdict(self).items())))


def product(fmt: str, x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """x (S, in) times one projection's packed weights: (S, out)."""
    if fmt == Q4:
        return torch.ops.mtp_viz.q4_linear(x, *weights)
    return torch.ops.mtp_viz.f32_linear(x, *weights)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (heads, S, d) with cos, sin (S, d) (the rotate-half layout)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LayerGraph(nn.Module):
    """One decoder layer as the graph exports it: every tensor an input, weights included, so one
    compiled package serves every layer."""

    def __init__(self, config: LayerConfig):
        super().__init__()
        self.config = config
        self.parts = 3 if config.fmt == Q4 else 1  # tensors per projection

    def forward(self, hidden, cos, sin, slots, idx, counts, keys, values, attn_norm, mlp_norm, qkv_bias, *weights):
        """hidden (S, H); cos, sin (S, d); slots (S,) where the rows' keys go; idx (S, W), counts (S,):
        each row's visible slots in order, the first counts[s] of row s; keys, values (kv_heads,
        capacity, d), written at `slots`; weights: each projection's packed tensors, then, in the
        adapted graph, the gate (S, 1) and each projection's Aᵀ (in, Σr) and Bᵀ (Σr, out). Returns
        hidden (S, H)."""
        c, n = self.config, self.parts
        qkv_w, o_w, gate_up_w, down_w = (tuple(weights[i * n : (i + 1) * n]) for i in range(4))
        lora = weights[4 * n :]

        def project(i: int, x: torch.Tensor, packed: tuple[torch.Tensor, ...]) -> torch.Tensor:
            out = product(c.fmt, x, packed)
            if not c.lora:
                return out
            gate, a, b = lora[0], lora[1 + 2 * i], lora[2 + 2 * i]
            return out + torch.mm(torch.mm(x, a) * gate, b)  # a closed row: + exactly 0

        s, q_size, kv_size = hidden.shape[0], c.heads * c.head_dim, c.kv_heads * c.head_dim
        x = F.rms_norm(hidden, (c.hidden,), attn_norm, c.eps)
        q, k, v = (project(0, x, qkv_w) + qkv_bias).split((q_size, kv_size, kv_size), dim=-1)
        q = rotate(q.view(s, c.heads, c.head_dim).transpose(0, 1), cos, sin)  # (h, S, d)
        keys.index_copy_(1, slots, rotate(k.view(s, c.kv_heads, c.head_dim).transpose(0, 1), cos, sin))
        values.index_copy_(1, slots, v.view(s, c.kv_heads, c.head_dim).transpose(0, 1))
        out = torch.ops.mtp_viz.attend(q, keys, values, idx, counts, c.scaling)  # (h, S, d)
        out = out.transpose(0, 1).reshape(s, q_size)
        hidden = hidden + project(1, out, o_w)
        x = F.rms_norm(hidden, (c.hidden,), mlp_norm, c.eps)
        gate, up = project(2, x, gate_up_w).chunk(2, dim=-1)
        return hidden + project(3, F.silu(gate) * up, down_w)


@dataclass
class Layer:
    """One layer's inputs to the graph beside the activations: its norms, q|k|v bias and products."""

    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv_bias: torch.Tensor
    products: tuple[torch.Tensor, ...]
    lora: tuple[torch.Tensor, ...] = ()  # the adapted graph's: each projection's Aᵀ and Bᵀ, in turn


def _example(config: LayerConfig, layer: Layer) -> tuple:
    rows, width, capacity = EXAMPLE["rows"], EXAMPLE["width"], EXAMPLE["capacity"]
    positions = torch.arange(rows)
    cache = torch.zeros(config.kv_heads, capacity, config.head_dim)
    gate = (torch.ones(rows, 1),) if config.lora else ()
    return (
        torch.zeros(rows, config.hidden), torch.ones(rows, config.head_dim), torch.zeros(rows, config.head_dim),
        positions, torch.arange(width).expand(rows, width).contiguous(), torch.full((rows,), width),
        cache, cache.clone(), layer.attn_norm, layer.mlp_norm, layer.qkv_bias, *layer.products, *gate, *layer.lora,
    )  # fmt: skip


def compile_package(config: LayerConfig, layer: Layer, path: Path) -> None:
    """Export the layer graph for any rows, width and capacity, and compile it into `path` (atomically)."""
    rows = torch.export.Dim("rows", min=1, max=MAX_ROWS)
    width = torch.export.Dim("width", min=2, max=2**20)
    capacity = torch.export.Dim("capacity", min=2, max=2**22)
    example = _example(config, layer)
    dims = [{0: rows}, {0: rows}, {0: rows}, {0: rows}, {0: rows, 1: width}, {0: rows}]
    products = len(layer.products)  # *weights: the products' tensors, then the gate (rows) and A, B of each
    weights = (None,) * products + (({0: rows},) + (None,) * len(layer.lora) if config.lora else ())
    dims += [{1: capacity}, {1: capacity}, None, None, None, weights]
    with torch.no_grad():
        program = torch.export.export(LayerGraph(config), example, dynamic_shapes=dims)
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.pt2")
    torch._inductor.aoti_compile_and_package(program, package_path=str(partial))
    os.replace(partial, path)


def example_layer(config: LayerConfig) -> Layer:
    """A layer of zeros in `config`'s shapes: all a build needs (the graph takes weights as inputs)."""
    q_rows = (config.heads + 2 * config.kv_heads) * config.head_dim
    shapes = ((q_rows, config.hidden), (config.hidden, config.heads * config.head_dim))
    shapes += ((2 * config.intermediate, config.hidden), (config.hidden, config.intermediate))
    products: list[torch.Tensor] = []
    for n, k in shapes:
        if config.fmt == Q4:
            blocks = torch.zeros(n, k // native.BLOCK, dtype=torch.float16)
            products += [torch.zeros(n, k // 2, dtype=torch.uint8), blocks, blocks.clone()]
        else:
            products.append(torch.zeros(n, k))
    norm = torch.ones(config.hidden)
    lora = tuple(
        t for (n, k), r in zip(shapes, config.lora, strict=False) for t in (torch.zeros(k, r), torch.zeros(r, n))
    )
    return Layer(norm, norm.clone(), torch.zeros(q_rows), tuple(products), lora)
