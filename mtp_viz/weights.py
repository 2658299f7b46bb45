"""Weight formats: a model's linear layers holding their weights as fp32, bf16, int8 or 4-bit codes.

On a CPU a small model's forward is mostly the stream of its weights through the memory bus, so
fewer bytes per weight is a faster forward. As in gpt-fast's quantize.py, a format is a transform
applied before the model runs: `apply_format` swaps each linear for a `FormatLinear` holding the
weight in that format and computing `x @ Wᵀ` with the kernel for it; the forward reads the same.
- `bf16`: the weights rounded to bfloat16;
- `int8`: weight-only, symmetric per output channel (one scale a row), `_weight_int8pack_mm`;
- `q4`: 4-bit codes with a scale d and a minimum m per block of 32 weights, w = q·d + m (GGUF's
  Q4_1). A model that ships as a Q4_1 GGUF keeps the file's own codes (mtp_viz.gguf_codes);
  others are quantized here by the same rule. The kernel is torch's int4 weight-only CPU kernel
  with group 32, which computes (q − 8)·scale + zero: scale = d, zero = m + 8d.
Activations stay float32 between layers; each product runs in bfloat16 (the kernels' fast path:
with float32 activations and scales the int4 kernel reproduces the GGUF weights exactly but runs
~25x slower, and the int8 one 1.5x). So a format is not bit-identical to fp32: its agreement with
fp32 is measured (mtp_viz.weights_auto), and "lossless" means identical to autoregressive
decoding on the same weights. The output head (HEAD_FORMAT), embeddings, norms and LoRA adapters
stay float32. Formats other than fp32 and bf16 run on a CPU (int8 also
anywhere, by gpt-fast's dequantizing product); q4 is CPU-only here.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache

import torch
from torch import nn
from torch.nn import functional as F

from mtp_viz.drafters.vocab import ReducedHead
from mtp_viz.errors import UserError
from mtp_viz.kernels import RAW_ROWS, RowPlan, replace_module

FP32, BF16, INT8, Q4 = "fp32", "bf16", "int8", "q4"
AUTO = "auto"
FORMATS = (FP32, BF16, INT8, Q4)
CHOICES = (AUTO, *FORMATS)
GROUP = 32  # Q4_1's block: 32 weights share a scale and a minimum
LEVELS = 15  # 4-bit codes 0..15
ZERO_POINT = 8  # the int4 kernel's codes are centred: (q − 8)·scale + zero
COMPUTE = torch.bfloat16  # the dtype each product runs in
# The output head in each format: float32 in all. Measured for the 49k × 576 head, one row, 2-core
# EPYC: int8 16.0 ms, bf16 8.0 ms, fp32 9.1 ms (docs/BENCHMARKS.md); and both low-bit kernels return
# bfloat16 logits, whose coarse steps (0.06-0.12 at typical magnitudes) turn close calls into exact
# ties that a one-token and a batched forward then break differently.
HEAD_FORMAT = {BF16: FP32, INT8: FP32, Q4: FP32}


@dataclass(frozen=True)
class Q4Codes:
    """One matrix as Q4_1: codes (N, K) uint8 in 0..15, d and m (N, K/GROUP) float16."""

    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """w = q·d + m in float32 (what llama.cpp's and gguf's dequantizers compute): (N, K)."""
        n, k = self.codes.shape
        q = self.codes.float().view(n, k // GROUP, GROUP)
        return (q * self.d.float()[..., None] + self.m.float()[..., None]).view(n, k)


def quantize_q4(weight: torch.Tensor) -> Q4Codes:
    """Q4_1 of a float weight (N, K), as llama.cpp's reference quantizer does it: per block of 32,
    m = min, d = (max − min)/15 (both stored as float16), q = round((w − m)/d) in 0..15."""
    n, k = weight.shape
    if k % GROUP:
        raise UserError(f"q4 needs input sizes that are multiples of {GROUP}; this model has a linear with {k}")
    blocks = weight.detach().float().view(n, k // GROUP, GROUP)
    low, high = blocks.amin(-1), blocks.amax(-1)
    d = ((high - low) / LEVELS).half()
    m = low.half()
    inverse = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(low))
    q = ((blocks - low[..., None]) * inverse[..., None] + 0.5).to(torch.int16).clamp(0, LEVELS)
    return Q4Codes(q.view(n, k).to(torch.uint8), d, m)


KERNEL_BLOCK = 64  # the int4 CPU kernel's layout: blocks of 64 rows, (K, 32) bytes each, row n | row n+32 << 4


@cache
def blocked_layout_holds() -> bool:
    """Whether torch's int4 CPU packing is the blocked layout kernel_pack writes (checked once)."""
    codes = torch.randint(0, LEVELS + 1, (2 * KERNEL_BLOCK, 2 * GROUP), generator=torch.Generator().manual_seed(0))
    return torch.equal(
        _blocked(codes.to(torch.uint8)), torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
    )


def _blocked(codes: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    b = codes.view(n // KERNEL_BLOCK, KERNEL_BLOCK, k).transpose(1, 2)  # (N/64, K, 64)
    half = KERNEL_BLOCK // 2
    return (b[..., :half] | (b[..., half:] << 4)).contiguous().view(n, k // 2)


def kernel_pack(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes 0..15 → the int4 CPU kernel's packed (N, K/2) uint8. torch's own packer runs
    ~10 s over the embedded model's layers; where its layout is the blocked one (checked against
    it once), the same bytes come from a few tensor ops."""
    if codes.shape[0] % KERNEL_BLOCK == 0 and blocked_layout_holds():
        return _blocked(codes)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)


class FormatLinear(nn.Linear):
    """An nn.Linear whose weight is held in a format (buffers with one row per output, so that
    linears reading one input fuse by concatenation: `fuse`). It has no weight parameter;
    `weight` gives the weights as the kernel sees them, in float32, for code that reads rows (a
    reduced head, peft's device check) or for tests, not for the forward."""

    fmt: str = FP32
    ROWS: tuple[str, ...] = ()  # the buffers, each with out_features rows
    fused_from: tuple[nn.Module, ...] = ()  # the linears `fuse` made this one of
    row_plan: RowPlan = RAW_ROWS  # how rows group into kernel calls on a CPU: measured (mtp_viz.row_plan)

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
        """Bytes one product reads of this layer's weights (the kernel's form: q4's packed codes)."""
        return sum(getattr(self, name).numel() * getattr(self, name).element_size() for name in self.ROWS)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, in) in COMPUTE → (M, out), one kernel call (the row plan groups the rows)."""
        raise NotImplementedError

    def rows(self) -> RowPlan:
        """The row plan this product runs under (a fused one: its first part's, set after fusing)."""
        return self.fused_from[0].rows() if self.fused_from else self.row_plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(COMPUTE)  # (M, in)
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


class Q4Linear(FormatLinear):
    fmt = Q4
    ROWS = ("codes", "d", "m")  # (N, K) uint8 in 0..15; (N, K/GROUP) float16 each: w = q·d + m

    @classmethod
    def of(cls, weight: torch.Tensor, bias=None) -> "Q4Linear":
        return cls.from_codes(quantize_q4(weight), bias)

    @classmethod
    def from_codes(cls, codes: Q4Codes, bias=None) -> "Q4Linear":
        n, k = codes.codes.shape
        return cls(k, n, bias, codes=codes.codes.to(torch.uint8), d=codes.d.half(), m=codes.m.half())

    def q4_codes(self) -> Q4Codes:
        return Q4Codes(self.codes, self.d, self.m)

    def kernel_scales(self, dtype: torch.dtype = COMPUTE) -> torch.Tensor:
        """(K/GROUP, N, 2): the int4 kernel's scale d and zero m + 8d per group, in `dtype`."""
        d, m = self.d.float(), self.m.float()
        return torch.stack([d.t(), (m + ZERO_POINT * d).t()], dim=-1).to(dtype).contiguous()

    def dequantize(self) -> torch.Tensor:
        """(q − 8)·scale + zero with the kernel's bfloat16 scale and zero (q4_codes().dequantize()
        is the file's own w = q·d + m)."""
        n, k = self.out_features, self.in_features
        sz = self.kernel_scales().float().transpose(0, 1)  # (N, K/GROUP, 2)
        q = self.codes.float().view(n, k // GROUP, GROUP) - ZERO_POINT
        return (q * sz[..., :1] + sz[..., 1:]).view(n, k)

    def streamed_bytes(self) -> int:
        """Two codes a byte, and a bfloat16 scale and zero per group of 32 (what the kernel reads)."""
        return self.out_features * self.in_features // 2 + self.out_features * self.in_features // GROUP * 2 * 2

    def kernel(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's packed codes and scales, made on first use, and again once the codes or
        scales lie elsewhere (moved, assigned anew, or made views of a fused buffer by `fuse`):
        keyed by where they lie, as the module stays the same object through all of those."""
        key = (self.codes.data_ptr(), self.d.data_ptr())
        if getattr(self, "_kernel_key", None) != key:
            self._kernel = (kernel_pack(self.codes), self.kernel_scales())
            self._kernel_key = key
        return self._kernel

    def product(self, x: torch.Tensor) -> torch.Tensor:
        packed, scales = self.kernel()
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales)

    def __getstate__(self):  # a copy (the mask-token view) shares the buffers and remakes the kernel form
        return {k: v for k, v in self.__dict__.items() if k not in ("_kernel", "_kernel_key")}


FORMAT_CLASSES: dict[str, type[FormatLinear]] = {BF16: Bf16Linear, INT8: Int8Linear, Q4: Q4Linear}


def check_format(fmt: str, device: torch.device | str) -> None:
    """UserError when `fmt` is not a format or cannot run on `device`."""
    if fmt not in FORMATS:
        raise UserError(f"unknown weight format {fmt!r}; use one of {', '.join(CHOICES)}")
    if fmt == Q4 and torch.device(device).type != "cpu":
        raise UserError("q4 runs on a CPU here (torch's int4 CPU kernel); on a GPU use bf16 or int8")


def convert(linear: nn.Linear, fmt: str, codes: Q4Codes | None = None) -> FormatLinear:
    """`linear` in format `fmt` (q4: from `codes` when given, else quantized from its weight)."""
    if isinstance(linear, FormatLinear):
        if linear.fmt != fmt:
            raise ValueError(f"a {linear.fmt} linear cannot become {fmt}")
        return linear
    if fmt == Q4 and codes is not None:
        made = Q4Linear.from_codes(codes, linear.bias)
    else:
        made = FORMAT_CLASSES[fmt].of(linear.weight, linear.bias)
    return made.to(linear.weight.device)


def apply_format(model: nn.Module, fmt: str, codes: Mapping[str, Q4Codes] | None = None) -> nn.Module:
    """Every linear of `model` replaced in its parent by one in `fmt` (the output head: in
    HEAD_FORMAT[fmt]); q4 takes a matrix's codes from `codes` (module name → Q4Codes) where given.
    A reduced drafter head (drafters.vocab) gets its product in the head's format. Linears already
    in `fmt` (a derived model sharing its base's modules) stay. Returns the model (the new linear
    when `model` itself is one); `format_of` reads the format back from the modules' types."""
    if fmt == FP32:
        return model
    check_format(fmt, next(model.parameters()).device)
    if isinstance(model, nn.Linear):
        return convert(model, fmt)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.Linear) and "lora_" not in full:  # LoRA adapters stay float32
                wanted = HEAD_FORMAT[fmt] if child is head else fmt
                if wanted != FP32:
                    replace_module(module, child_name, convert(child, wanted, (codes or {}).get(full)))
        if isinstance(module, ReducedHead) and module.product is None and HEAD_FORMAT[fmt] != FP32:
            module.product = FORMAT_CLASSES[HEAD_FORMAT[fmt]].of(module.weight).to(module.weight.device)
    return model


def format_of(model: nn.Module) -> str:
    """The format `model`'s linears hold their weights in, read from their types (FormatLinear's
    `fmt`; the output head, in HEAD_FORMAT, aside): fp32 when none is in a format."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return next((m.fmt for m in model.modules() if isinstance(m, FormatLinear) and m is not head), FP32)


def fuse(linears: tuple[nn.Module, ...]) -> FormatLinear | None:
    """Linears of one format reading one input, as one FormatLinear whose buffers the linears' own
    are row views of (no second copy; linears that another model sharing these buffers fused
    already keep theirs), or None when they are not FormatLinears of one class and bias kind."""
    first = linears[0]
    if not isinstance(first, FormatLinear) or any(type(m) is not type(first) for m in linears):
        return None
    biases = [m.bias for m in linears]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    with torch.no_grad():
        rows = {name: _joined([getattr(m, name) for m in linears]) for name in first.ROWS}
        bias = None if biases[0] is None else torch.cat(biases)
    made = type(first)(first.in_features, sum(m.out_features for m in linears), bias, **rows)
    made.fused_from = linears
    return made


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts (row blocks) as one tensor, each part becoming a view of its rows (in place, so
    every module holding it sees the view); parts that already are consecutive views stay."""
    first = parts[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    shape = (sum(len(p) for p in parts), *first.shape[1:])
    if all(
        p.is_contiguous()
        and p.untyped_storage().data_ptr() == storage
        and p.storage_offset() == offset + sum(q.numel() for q in parts[:i])
        for i, p in enumerate(parts)
    ):
        return first.new_empty(0).set_(first.untyped_storage(), offset, shape, first.stride())
    whole = torch.cat(parts)
    row = 0
    for p in parts:
        p.set_(whole.untyped_storage(), row * whole[0].numel(), p.shape, whole.stride())
        row += len(p)
    return whole


def describe(fmt: str, q4_source: str | None = None) -> str:
    """ "q4 (GGUF Q4_1 codes …, group 32; head fp32; products in bf16)" for records and figures."""
    if fmt == FP32:
        return FP32
    what = {BF16: "bf16 weights", INT8: "int8 per-channel", Q4: f"{q4_source or 'Q4_1 quantized here'}, group 32"}
    return f"{fmt} ({what[fmt]}; head {HEAD_FORMAT[fmt]}; products in bf16)"
