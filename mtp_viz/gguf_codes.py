"""A GGUF file's own 4-bit codes, for the q4 weight format (mtp_viz.weights).

The embedded model ships as a Q4_1 GGUF: each 20-byte block holds d (float16), m (float16) and
16 bytes of codes (low nibbles: weights 0..15 of the block, high nibbles: 16..31), w = q·d + m.
transformers dequantizes it into the float32 model we run (mtp_viz.loading.sources.convert_gguf); the
codes read here are the same matrices before that, matched to the model's modules by gguf's own
tensor-name map, with the row order transformers gives q_proj and k_proj (llama.cpp's converter
permutes their rows for its rotary layout; transformers' loader reverses that, so do we).
Decoded once per file into the cache (safetensors beside the converted model's), so a second
load only maps the file in.
"""

import logging
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from mtp_viz.measured import write_atomically
from mtp_viz.weights import Q4Codes

log = logging.getLogger(__name__)

BLOCK_BYTES = 20  # d, m (2 bytes each), 16 bytes of codes
GROUP = 32
PERMUTED = {"attn_q": "num_attention_heads", "attn_k": "num_key_value_heads"}  # rows llama.cpp permutes
CACHE_VERSION = 1


def decode_q4_1(raw: np.ndarray) -> Q4Codes:
    """A Q4_1 tensor's bytes (N, K/32·20) uint8 → codes (N, K), d and m (N, K/32)."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    qs = blocks[..., 4:]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, -1)  # (N, K): low nibbles first
    return Q4Codes(torch.from_numpy(codes.astype(np.uint8)), torch.from_numpy(d.copy()), torch.from_numpy(m.copy()))


def unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' reverse of llama.cpp's q/k row permutation (per head: interleaved halves)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def read_q4_codes(gguf_path: Path, model: nn.Module) -> dict[str, Q4Codes]:
    """Module name → the file's Q4_1 codes, for every linear of `model` stored as Q4_1 (others,
    like a Q8_0 embedding, are absent)."""
    config = model.config
    arch = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == config.model_type), None)
    if arch is None:
        return {}
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tensors = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
    out = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        mapped = names.get_name(module_name)
        tensor = tensors.get(f"{mapped}.weight") if mapped else None
        if tensor is None or tensor.tensor_type != gguf.GGMLQuantizationType.Q4_1:
            continue
        codes = decode_q4_1(tensor.data)
        kind = mapped.rsplit(".", 1)[-1]
        if kind in PERMUTED and config.model_type in ("llama", "mistral"):
            heads = getattr(config, PERMUTED[kind])
            codes = Q4Codes(*(unpermute(t, heads) for t in (codes.codes, codes.d, codes.m)))
        out[module_name] = codes
    return out


def cached_q4_codes(gguf_path: Path, model: nn.Module, cache_dir: Path) -> dict[str, Q4Codes]:
    """read_q4_codes, decoded once into `cache_dir` (keyed by the file's name and size)."""
    path = cache_dir / f"q4-codes-v{CACHE_VERSION}-{gguf_path.stem}-{gguf_path.stat().st_size}.safetensors"
    if path.is_file():
        tensors = load_file(path)
        names = {k.rsplit(".", 1)[0] for k in tensors}
        return {n: Q4Codes(tensors[f"{n}.codes"], tensors[f"{n}.d"], tensors[f"{n}.m"]) for n in names}
    log.warning("reading the 4-bit codes of %s once into %s", gguf_path.name, path)
    codes = read_q4_codes(gguf_path, model)
    flat = {f"{n}.{part}": getattr(c, part).contiguous() for n, c in codes.items() for part in ("codes", "d", "m")}
    write_atomically(path, lambda tmp: save_file(flat, tmp), "the codes")
    return codes
