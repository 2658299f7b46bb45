"""Linear layers for the few-row products of decoding on a CPU.

Decoding multiplies a weight matrix by 1 to a few dozen rows (one token, a draft, a tree). On
the CPUs we measured (AMD EPYC, PyTorch's MKL), `F.linear` on 1-3 rows takes the matrix-vector
and small-matrix paths, which run at a third to a half of the memory bandwidth that the same
product gets when written as `W @ xᵀ` (the weight on the left). That product's own cost is not
monotone in the row count either (measured over all of SmolLM2-135M's weights: 1 row costs
about what 2 do, 3 more than 4, 6-15 more than 16), so rows are padded with zeros up to the
next of ROW_BUCKETS. `benchmarks/cpu_linear.py` measures both ways side by side.

`fast_linear` is that product; `use_fast_linears` switches a model's `nn.Linear` layers to it.
It only acts on float32 CPU tensors with at most the largest bucket of rows (prefill and training
batches, GPUs and other dtypes keep `F.linear`). Results equal `F.linear`'s up to float rounding. Set
MTP_VIZ_LINEAR=stock in the environment (or call `set_enabled(False)`) to measure without it.
"""

import os

import torch
from torch import nn
from torch.nn import functional as F

ROW_BUCKETS = (2, 4, 5, 16)  # rows are padded up to the next of these; more rows keep F.linear
MAX_ROWS = ROW_BUCKETS[-1]
ENV = "MTP_VIZ_LINEAR"
STOCK = "stock"

_PADDED = [next(b for b in ROW_BUCKETS if b >= rows) for rows in range(MAX_ROWS + 1)]  # rows → padded rows

_enabled = os.environ.get(ENV, "").strip().lower() != STOCK


def set_enabled(on: bool) -> None:
    global _enabled
    _enabled = on


def fast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ weightᵀ (+ bias) → (..., out), as `F.linear`."""
    rows = x.numel() // max(1, x.shape[-1])
    cpu_f32 = weight.device.type == "cpu" and weight.dtype == torch.float32 and x.dtype == torch.float32
    if not (_enabled and cpu_f32 and 0 < rows <= MAX_ROWS):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])  # (m, in)
    padded = _PADDED[rows]
    if padded > rows:
        flat = torch.cat([flat, flat.new_zeros(padded - rows, flat.shape[1])])
    y = torch.mm(weight, flat.t())[:, :rows].t().contiguous()  # (m, out)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


class FastLinear(nn.Linear):
    """An `nn.Linear` whose forward is `fast_linear` (same parameters and state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fast_linear(x, self.weight, self.bias)


def use_fast_linears(model: nn.Module) -> nn.Module:
    """Switch every plain `nn.Linear` in `model` to FastLinear, in place; returns the model."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = FastLinear
    return model
