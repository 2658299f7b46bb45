"""Weight formats: a model's linear layers holding their weights as fp32, bf16, int8 or 4-bit codes.

On a CPU a small model's forward is mostly the stream of its weights through the memory bus, so
fewer bytes per weight is a faster forward. As in gpt-fast's quantize.py, a format is a transform
applied before the model runs: `apply_format` swaps each linear for a `FormatLinear` holding the
weight in that format and computing `x @ Wᵀ` with the kernel for it; the forward reads the same.
- `bf16`: the weights rounded to bfloat16 (mtp_viz.format_linear);
- `int8`: weight-only, symmetric per output channel (one scale a row), `_weight_int8pack_mm`;
- `q4`: GGUF's Q4_1 blocks of 32 (mtp_viz.quant): the file's own codes for a model that ships as
  a Q4_1 GGUF, quantized here by the same rule for others; its head in Q8_0 where mtp-viz's CPU
  kernels run (mtp_viz.native, float32 activations), else in float32 beside torch's int4 kernel.
Embeddings, norms and LoRA adapters stay float32, and so does the head of bf16 and int8 (both
low-bit torch kernels return bfloat16 logits, whose coarse steps, 0.06-0.12 at typical magnitudes,
turn close calls into exact ties that a one-token and a batched forward then break differently).
Formats other than fp32 and bf16 run on a CPU (int8 also anywhere, by gpt-fast's dequantizing
product); q4 is CPU-only here.
"""

from collections.abc import Mapping

import torch
from torch import nn

from mtp_viz import native
from mtp_viz.drafters.vocab import ReducedHead
from mtp_viz.errors import UserError
from mtp_viz.format_linear import (
    AUTO,
    BF16,
    CHOICES,
    COMPUTE,
    FORMATS,
    FP32,
    INT8,
    Q4,
    Q8,
    Bf16Linear,
    FormatLinear,
    Int8Linear,
)
from mtp_viz.kernels import replace_module
from mtp_viz.quant import GROUP, Q4Codes, Q4Linear, Q8Linear, kernel_pack, quantize_q4, quantize_q8

__all__ = [
    "AUTO",
    "BF16",
    "CHOICES",
    "COMPUTE",
    "FORMATS",
    "FP32",
    "GROUP",
    "INT8",
    "Q4",
    "Q8",
    "Bf16Linear",
    "FormatLinear",
    "Int8Linear",
    "Q4Codes",
    "Q4Linear",
    "Q8Linear",
    "apply_format",
    "check_format",
    "convert",
    "describe",
    "format_of",
    "fuse",
    "head_format",
    "kernel_pack",
    "quantize_q4",
    "quantize_q8",
]

FORMAT_CLASSES: dict[str, type[FormatLinear]] = {BF16: Bf16Linear, INT8: Int8Linear, Q4: Q4Linear, Q8: Q8Linear}


def head_format(fmt: str) -> str:
    """The format of a model's output head when its layers are in `fmt`: Q8_0 beside q4 where our
    CPU kernels run (float32 logits, the GGUF's own head codes), float32 otherwise."""
    return Q8 if fmt == Q4 and native.available() else FP32


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
    head_format(fmt)); q4 takes a matrix's codes from `codes` (module name → Q4Codes) where given.
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
                wanted = head_format(fmt) if child is head else fmt
                if wanted != FP32:
                    replace_module(module, child_name, convert(child, wanted, (codes or {}).get(full)))
        if isinstance(module, ReducedHead) and module.product is None and head_format(fmt) != FP32:
            module.product = FORMAT_CLASSES[head_format(fmt)].of(module.weight).to(module.weight.device)
    return model


def format_of(model: nn.Module) -> str:
    """The format `model`'s linears hold their weights in, read from their types (FormatLinear's
    `fmt`; the output head, in head_format, aside): fp32 when none is in a format."""
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
    products = "products in fp32 by mtp-viz's CPU kernels" if fmt == Q4 and native.available() else "products in bf16"
    return f"{fmt} ({what[fmt]}; head {head_format(fmt)}; {products})"
