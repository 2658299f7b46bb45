"""A linear layer holding its weight in a format (mtp_viz.weights applies them), and the plain
formats: bf16 and int8. The 4-bit and 8-bit block formats are in mtp_viz.quant.

Activations stay float32 between layers. torch's low-bit CPU kernels run each product in bfloat16
(their fast path: with float32 activations and scales the int4 kernel reproduces the GGUF weights
exactly but runs ~25x slower, and the int8 one 1.5x), so those formats are not bit-identical to
fp32: their agreement with fp32 is measured (mtp_viz.weights_auto), and "lossless" means identical
to autoregressive decoding on the same weights. mtp-viz's own CPU kernels (mtp_viz.native) compute
the block formats with float32 activations instead.
"""

import torch
from torch import nn
from torch.nn import functional as F

from mtp_viz.kernels import RAW_ROWS, RowPlan

FP32, BF16, INT8, Q4, Q8 = "fp32", "bf16", "int8", "q4", "q8"
FORMATS = (FP32, BF16, INT8, Q4)  # what a model's layers can be held in (q8: a head's format)
AUTO = "auto"
CHOICES = (AUTO, *FORMATS)
COMPUTE = torch.bfloat16  # the dtype torch's low-bit kernels run each product in


class FormatLinear(nn.Linear):
    """An nn.Linear whose weight is held in a format (buffers with one row per output, so that
    linears reading one input fuse by concatenation: mtp_viz.weights.fuse). It has no weight
    parameter; `weight` gives the weights as the kernel sees them, in float32, for code that reads
    rows (a reduced head, peft's device check) or for tests, not for the forward."""

    fmt: str = FP32
    ROWS: tuple[str, ...] = ()  # the buffers, each with out_features rows
    fused_from: tuple[nn.Module, ...] = ()  # the linears `fuse` made this one of
    row_plan: RowPlan = RAW_ROWS  # how rows group into kernel calls on a CPU: measured (mtp_viz.row_plan)
    compute: torch.dtype = COMPUTE  # the dtype `product` takes its rows in

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None, **rows: torch.Tensor):
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        for name in self.ROWS:
            self.register_buffer(name, rows[name].contiguous())

    @property
    def weight(self) -> torch.Tensor:
        return self.dequantize()

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    def streamed_bytes(self) -> int:
        """Bytes one product reads of this layer's weights."""
        return sum(getattr(self, name).numel() * getattr(self, name).element_size() for name in self.ROWS)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, in) in `compute` → (M, out), one kernel call (the row plan groups the rows)."""
        raise NotImplementedError

    def rows(self) -> RowPlan:
        """The row plan this product runs under (a fused one: its first part's, set after fusing)."""
        return self.fused_from[0].rows() if self.fused_from else self.row_plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.compute)  # (M, in)
        y = self.rows()(self.product, flat) if flat.device.type == "cpu" else self.product(flat)
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def current(self) -> bool:
        """For a fused one (`fuse`): whether the linears it fused still hold views of its buffers.
        A storage check on purpose: their buffers can be replaced under it (`model.to`, a buffer
        assigned anew) while the modules, and so their types, stay."""
        ptr = getattr(self, self.ROWS[0]).untyped_storage().data_ptr()
        return all(getattr(m, self.ROWS[0]).untyped_storage().data_ptr() == ptr for m in self.fused_from)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, format={self.fmt}"


class Bf16Linear(FormatLinear):
    fmt = BF16
    ROWS = ("w",)  # (N, K) bfloat16
    # until measured here: oneDNN's one-row bf16 product sums in another order than its several-row
    # one (1536 inputs, 2-core EPYC); padded to two rows a row's result was the same at every count
    row_plan = RowPlan(pad_to=2)

    @classmethod
    def of(cls, weight: torch.Tensor, bias=None) -> "Bf16Linear":
        return cls(weight.shape[1], weight.shape[0], bias, w=weight.detach().to(COMPUTE))

    def dequantize(self) -> torch.Tensor:
        return self.w.float()

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w)


class Int8Linear(FormatLinear):
    fmt = INT8
    ROWS = ("q", "scales")  # (N, K) int8; (N,) in COMPUTE: w = q·scale

    @classmethod
    def of(cls, weight: torch.Tensor, bias=None) -> "Int8Linear":
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny).to(COMPUTE)
        q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(w.shape[1], w.shape[0], bias, q=q, scales=scales)

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scales.float()[:, None]

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scales)
        return F.linear(x, self.q.to(x.dtype)) * self.scales  # gpt-fast's WeightOnlyInt8Linear
