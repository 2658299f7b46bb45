"""The block formats: GGUF's Q4_1 for a model's layers, Q8_0 for its output head.

- `q4`: 4-bit codes with a scale d and a minimum m per block of 32 weights, w = q·d + m (Q4_1). A
  model that ships as a Q4_1 GGUF keeps the file's own codes (mtp_viz.gguf_codes); others are
  quantized here by the same rule. Held as the file holds them: two codes a byte, d and m float16.
- `q8`: 8-bit codes with a scale per block of 32, w = q·d (Q8_0): the embedded GGUF's own format
  for its embedding, which is also its (tied) output head, so quantizing the float32 head here
  gives back the file's codes exactly.

Where mtp-viz's CPU kernels run (mtp_viz.native), both compute with float32 activations, each row
alike at every row count. Elsewhere q4 runs torch's int4 CPU kernel with group 32, which computes
(q − 8)·scale + zero in bfloat16 (scale = d, zero = m + 8d), and the head stays float32."""

from dataclasses import dataclass
from functools import cache

import torch
from torch.nn import functional as F

from mtp_viz import native
from mtp_viz.errors import UserError
from mtp_viz.format_linear import COMPUTE, Q4, Q8, FormatLinear

GROUP = 32  # Q4_1's and Q8_0's block: 32 weights share a scale (and for Q4_1 a minimum)
LEVELS = 15  # 4-bit codes 0..15
ZERO_POINT = 8  # the int4 kernel's codes are centred: (q − 8)·scale + zero


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


def _blocks_of(weight: torch.Tensor, what: str) -> torch.Tensor:
    n, k = weight.shape
    if k % GROUP:
        raise UserError(f"{what} needs input sizes that are multiples of {GROUP}; this model has a linear with {k}")
    return weight.detach().float().view(n, k // GROUP, GROUP)


def quantize_q4(weight: torch.Tensor) -> Q4Codes:
    """Q4_1 of a float weight (N, K), as llama.cpp's reference quantizer does it: per block of 32,
    m = min, d = (max − min)/15 (both stored as float16), q = round((w − m)/d) in 0..15."""
    blocks = _blocks_of(weight, "q4")
    low, high = blocks.amin(-1), blocks.amax(-1)
    d = ((high - low) / LEVELS).half()
    m = low.half()
    inverse = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(low))
    q = ((blocks - low[..., None]) * inverse[..., None] + 0.5).to(torch.int16).clamp(0, LEVELS)
    return Q4Codes(q.view(weight.shape).to(torch.uint8), d, m)


def quantize_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 of a float weight (N, K): per block of 32, d = max|w|/127 (float16), q = round(w/d).
    Of weights that are a Q8_0 matrix dequantized, this gives back its codes and scales exactly."""
    blocks = _blocks_of(weight, "q8")
    d = (blocks.abs().amax(-1) / 127).half()
    safe = torch.where(d.float() > 0, d.float(), torch.ones_like(d.float()))
    q = torch.round(blocks / safe[..., None]).clamp(-127, 127).to(torch.int8)
    return q.view(weight.shape), d


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


class Q4Linear(FormatLinear):
    fmt = Q4
    ROWS = ("qs", "d", "m")  # (N, K/2) uint8, GGUF's block layout; (N, K/GROUP) float16 each: w = q·d + m

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None, **rows: torch.Tensor):
        super().__init__(in_features, out_features, bias, **rows)
        self.native = rows["qs"].device.type == "cpu" and native.available()  # else torch's int4 kernel
        self.compute = torch.float32 if self.native else COMPUTE

    @classmethod
    def of(cls, weight: torch.Tensor, bias=None) -> "Q4Linear":
        return cls.from_codes(quantize_q4(weight), bias)

    def on_torch_kernel(self) -> "Q4Linear":
        """This layer computing by torch's int4 kernel instead of ours (comparisons, tests)."""
        self.native, self.compute = False, COMPUTE
        return self

    @classmethod
    def from_codes(cls, codes: Q4Codes, bias=None) -> "Q4Linear":
        n, k = codes.codes.shape
        return cls(k, n, bias, qs=native.pack_q4(codes.codes), d=codes.d.half(), m=codes.m.half())

    def q4_codes(self) -> Q4Codes:
        return Q4Codes(native.unpack_q4(self.qs), self.d, self.m)

    def kernel_scales(self, dtype: torch.dtype = COMPUTE) -> torch.Tensor:
        """(K/GROUP, N, 2): the int4 kernel's scale d and zero m + 8d per group, in `dtype`."""
        d, m = self.d.float(), self.m.float()
        return torch.stack([d.t(), (m + ZERO_POINT * d).t()], dim=-1).to(dtype).contiguous()

    def dequantize(self) -> torch.Tensor:
        """The weights the product computes with: the file's q·d + m (our kernels), or (q − 8)·scale
        + zero with torch's kernel's bfloat16 scale and zero."""
        if self.native:
            return self.q4_codes().dequantize()
        n, k = self.out_features, self.in_features
        sz = self.kernel_scales().float().transpose(0, 1)  # (N, K/GROUP, 2)
        q = native.unpack_q4(self.qs).float().view(n, k // GROUP, GROUP) - ZERO_POINT
        return (q * sz[..., :1] + sz[..., 1:]).view(n, k)

    def kernel(self) -> tuple[torch.Tensor, torch.Tensor]:
        """torch's int4 kernel's packed codes and scales, made on first use, and again once the codes
        lie elsewhere (moved, assigned anew, or made views of a fused buffer by `fuse`): keyed by
        where they lie, as the module stays the same object through all of those. Eager only."""
        key = (self.qs.data_ptr(), self.d.data_ptr())
        if getattr(self, "_kernel_key", None) != key:
            self._kernel = (kernel_pack(native.unpack_q4(self.qs)), self.kernel_scales())
            self._kernel_key = key
        return self._kernel

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return native.q4_linear(x, self.qs, self.d, self.m)
        packed, scales = self.kernel()
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.native:
            return super().forward(x)
        y = self.product(x.reshape(-1, self.in_features).float()).view(*x.shape[:-1], self.out_features)
        return (y if self.bias is None else y + self.bias).to(x.dtype)

    def __getstate__(self):  # a copy (the mask-token view) shares the buffers and remakes the kernel form
        return {k: v for k, v in self.__dict__.items() if k not in ("_kernel", "_kernel_key")}


class Q8Linear(FormatLinear):
    """Q8_0 weights with float32 activations: an output head (mtp_viz.weights.head_format)."""

    fmt = Q8
    ROWS = ("qs", "d")  # (N, K) int8; (N, K/GROUP) float16: w = q·d
    compute = torch.float32

    @classmethod
    def of(cls, weight: torch.Tensor, bias=None) -> "Q8Linear":
        qs, d = quantize_q8(weight)
        return cls(weight.shape[1], weight.shape[0], bias, qs=qs, d=d)

    def dequantize(self) -> torch.Tensor:
        n, k = self.qs.shape
        return (self.qs.float().view(n, k // GROUP, GROUP) * self.d.float()[..., None]).view(n, k)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and native.available():
            return native.q8_linear(x, self.qs, self.d)
        return F.linear(x, self.dequantize())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x.reshape(-1, self.in_features).float()).view(*x.shape[:-1], self.out_features)
        return (y if self.bias is None else y + self.bias).to(x.dtype)
