"""Our CPU kernels for the few-row products of decoding (kernels.cpp), as torch ops.

torch's own 4-bit CPU kernel has a fast path only with AVX-512 (on an AVX2-only AMD EPYC it ran a
1536x576 product in ~470 µs, 4x slower than float32's), and neither it nor MKL's sgemm gives a row
the same result at every row count, which lossless verification needs (mtp_viz.row_plan pads and
chunks calls to get there, in Python, per call). kernels.cpp computes each row by the same
instructions whatever the row count, reads GGUF's own 4-bit and 8-bit blocks with float32
activations (w = q·d + m exactly as llama.cpp's dequantizer), and is an op a compiled graph calls
(mtp_viz.static). AVX2, FMA and F16C only: never AVX-512 or AMX instructions, which some virtual
Intel Xeons advertise and fault on.

Built once per machine with its C++ compiler into the cache (~40 s on 2 cores), then loaded in
milliseconds; `unavailable()` says why not (no compiler, another architecture, a CPU without those
instructions, MTP_VIZ_NATIVE=0, a failed build), and everything then runs on torch's own kernels.

    torch.ops.mtp_viz.q4_linear(x, codes, d, m)   # x (M, K) f32; codes (N, K/2) u8; d, m (N, K/32) f16
    torch.ops.mtp_viz.q8_linear(x, codes, d)      # codes (N, K) i8; d (N, K/32) f16
    torch.ops.mtp_viz.f32_linear(x, weight)       # weight (N, K) f32
"""

import hashlib
import logging
import os
import platform
import shutil
import threading
from functools import cache
from pathlib import Path

import torch

from mtp_viz.machine import cpu_flags
from mtp_viz.paths import build_root

log = logging.getLogger(__name__)

ENV = "MTP_VIZ_NATIVE"  # 0 turns our kernels off (torch's own then run everywhere)
SOURCE = Path(__file__).with_name("kernels.cpp")
NEEDED_FLAGS = ("avx2", "fma", "f16c")
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
BLOCK = 32  # the blocks of 32 weights GGUF's Q4_1 and Q8_0 share a scale in

_lock = threading.Lock()
_failed: list[str] = []  # why the build failed, once per process


def source_key() -> str:
    """A short key of what the built kernels depend on: their source, flags and torch (and this file,
    which declares their shapes to compiled graphs)."""
    text = SOURCE.read_bytes() + Path(__file__).read_bytes() + " ".join(CFLAGS).encode() + torch.__version__.encode()
    return hashlib.sha256(text).hexdigest()[:12]


def unavailable() -> str | None:
    """Why our kernels cannot run here, or None (they are built and loaded)."""
    if os.environ.get(ENV, "").strip() in ("0", "false", "no"):
        return f"turned off ({ENV}=0)"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"written for x86 CPUs, this is {platform.machine()}"
    flags = set(cpu_flags().split())
    if missing := [f for f in NEEDED_FLAGS if f not in flags]:
        return f"this CPU lacks {', '.join(missing)}"
    if not (shutil.which("c++") or shutil.which("g++")):
        return "no C++ compiler on this machine"
    return _load()


def available() -> bool:
    return unavailable() is None


@cache
def _built() -> None:
    """Build (or find built) and load kernels.cpp; registers the ops' shapes for compilation."""
    from torch.utils import cpp_extension

    try:  # ninja from the venv (PyPI's ninja), which torch's builder looks for on PATH
        import ninja

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    except ImportError:
        pass
    key = source_key()
    folder = build_root() / "native" / key
    folder.mkdir(parents=True, exist_ok=True)
    if not any(folder.glob("*.so")):
        log.warning("building mtp-viz's CPU kernels for this machine once (~40 s)")
    cpp_extension.load(
        name=f"mtp_viz_native_{key}",
        sources=[str(SOURCE)],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        is_python_module=False,
        verbose=False,
    )
    _register_shapes()


def _load() -> str | None:
    with _lock:
        if _failed:
            return _failed[0]
        try:
            _built()
        except Exception as e:  # a compiler error, a missing header: said once, then torch's kernels
            reason = f"build failed: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            log.warning("mtp-viz's CPU kernels are unavailable (%s); torch's kernels run instead", reason)
            _failed.append(reason)
            return reason
    return None


def _register_shapes() -> None:
    """The ops' output shapes without running them (torch.export and torch.compile trace with these)."""

    def rows_by_outputs(x: torch.Tensor, weight: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], weight.shape[0])

    for name in ("q4_linear", "q4q8_linear", "q8_linear", "f32_linear"):
        torch.library.register_fake(f"mtp_viz::{name}", rows_by_outputs)

    def like_queries(q: torch.Tensor, *_) -> torch.Tensor:
        return q.new_empty(q.shape)  # contiguous, as the kernel returns it

    torch.library.register_fake("mtp_viz::attend", like_queries)


def pack_q4(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes 0..15 → (N, K/2) bytes in GGUF Q4_1's block layout (byte j of a block of 32:
    weight j in the low nibble, weight j+16 in the high one)."""
    n, k = codes.shape
    blocks = codes.to(torch.uint8).view(n, k // BLOCK, BLOCK)
    return (blocks[..., : BLOCK // 2] | (blocks[..., BLOCK // 2 :] << 4)).contiguous().view(n, k // 2)


def unpack_q4(packed: torch.Tensor) -> torch.Tensor:
    """pack_q4's inverse: (N, K/2) bytes → (N, K) codes."""
    n, half = packed.shape
    blocks = packed.view(n, half // (BLOCK // 2), BLOCK // 2)
    return torch.cat([blocks & 15, blocks >> 4], dim=-1).reshape(n, half * 2)


def q4_linear(x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.ops.mtp_viz.q4_linear(x, packed, d, m)


def q8_linear(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return torch.ops.mtp_viz.q8_linear(x, codes, d)


def f32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mtp_viz.f32_linear(x, weight)
