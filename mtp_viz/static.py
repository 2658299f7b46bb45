"""One static forward on a CPU: a decoder layer as one graph, compiled ahead of time once per machine
and model shape, run over every layer.

The eager lean forward (mtp_viz.lean) spends more of a one-token step between its products than in
them: about sixty ATen calls a layer, each through the dispatcher and Python. Here a layer is one
graph (norm, products, rotary, cache write, attention, MLP), exported with torch.export for any row
count 1..MAX_ROWS and any attention width, and compiled by AOTInductor (generated C++ with its C++
wrapper, fused loops in place of most calls) into a package kept in the cache: a later process
loads it in a fraction of a second, and nothing traces, guards or recompiles at run time. The
forward calls the package once per layer with that layer's weights, so an EAGLE-3 target's taps
and a self-speculative draft's layer range are where the loop reads and where it stops.

Every row is what a one-token forward at its position computes, bit for bit, compiled as it is:
- products are mtp-viz's CPU kernels (mtp_viz.native), the same instructions for a row at any row
  count: weights packed once, at load, into the buffers the graph reads (GGUF's q4 blocks as they
  are, float32 weights as they are);
- attention (mtp_viz.native's `attend`) takes each row's visible slots in order (`idx`, `counts`)
  and computes each head of each row alone, so a verify row, a tree node and a one-token forward at
  the same position attend over the same keys in the same order by the same instructions.
Which models: those the lean forward runs, in fp32 or q4 (`pack` says why not); the rest keeps the
eager forward. A model with LoRA adapters (the mask-token MTP view) gets a second graph with the
adapters' terms stacked on each product, x·Aᵀ times the forward's mask gate, then ·Bᵀ, added: a row
the gate closes adds an exact zero, so its result is the plain graph's, bit for bit, and the mask
rows a verify carries no longer send the whole forward to the eager path.
"""

import fcntl
import json
import logging
import os
import sys
import time
import weakref
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from mtp_viz import native, static_graph
from mtp_viz.child import exit_with_parent
from mtp_viz.format_linear import FP32, Q4, FormatLinear
from mtp_viz.kv_slots import StaticKV
from mtp_viz.machine import machine_key
from mtp_viz.measured import fingerprint
from mtp_viz.paths import build_root
from mtp_viz.projections import FusedLinear, StackedLoRA, base_linear
from mtp_viz.static_graph import MAX_ROWS, NAMES, Layer, LayerConfig, compile_package, example_layer

log = logging.getLogger(__name__)

PACKAGE_VERSION = 1


class CompileUnavailable(RuntimeError):
    """A compiled forward cannot run here; the eager lean forward is used."""


def _weights(p, fmt: str) -> tuple[torch.Tensor, ...] | None:
    """One projection's tensors as the graph reads them, or None when it is not a plain product
    in `fmt` (a LoRA stack, separate modules, another format)."""
    if fmt == Q4:
        return (p.qs, p.d, p.m) if isinstance(p, FormatLinear) and p.fmt == Q4 and p.native else None
    if isinstance(p, FusedLinear) and p.bias is None:
        return (p.weight,)
    linear = base_linear(p)
    if type(linear) is not FormatLinear and isinstance(linear, nn.Linear) and linear.bias is None:
        return (linear.weight,) if linear.weight.dtype == torch.float32 else None
    return None


def _qkv_bias(p) -> torch.Tensor | None:
    bias = p.bias if isinstance(p, (FusedLinear, FormatLinear)) else None
    return bias.detach().float() if bias is not None else None


def pack(lean, adapted: bool = False) -> tuple[LayerConfig, list[Layer]] | str:
    """The lean model's layers as the graph reads them (views of the model's own tensors: nothing
    copied but the norms' float32 form), or why the static forward cannot run it. adapted: its
    blocks with the LoRA terms stacked on (`lean.adapted`), for the adapted graph."""
    if lean.device.type != "cpu" or lean.dtype != torch.float32:
        return "the static forward runs float32 models on a CPU"
    if reason := native.unavailable():
        return f"mtp-viz's CPU kernels are unavailable ({reason})"
    first = lean.blocks[0]
    projections = first.proj
    fmt = Q4 if isinstance(projections.qkv, FormatLinear) else FP32
    model = lean.model_ref()
    act = getattr(model.config, "hidden_act", None) if model is not None else None
    if act not in ("silu", "swish"):
        return f"its activation is {act}, not SiLU"
    gate_up = _weights(projections.gate_up, fmt)
    if gate_up is None:
        return "its products are not fused plain ones (adapters, or a format without our kernels)"
    config = LayerConfig(
        hidden=lean.layers[0].input_layernorm.weight.shape[0],
        heads=first.heads,
        kv_heads=first.kv_heads,
        head_dim=first.head_dim,
        intermediate=gate_up[0].shape[0] // 2,
        eps=float(first.attn_norm.variance_epsilon),
        scaling=float(first.scaling),
        fmt=fmt,
    )
    if adapted:
        if lean.adapted is None:
            return "it has no LoRA adapters"
        stacks = [[getattr(b.proj, name) for name in NAMES] for b in lean.adapted]
        if not all(isinstance(p, StackedLoRA) for stack in stacks for p in stack):
            return "not every projection of every layer has one plain LoRA adapter"
        ranks = tuple(p.a.shape[1] for p in stacks[0])
        if any(tuple(p.a.shape[1] for p in stack) != ranks for stack in stacks):
            return "its layers' LoRA ranks differ"
        config = replace(config, lora=ranks)
    layers = []
    for i, block in enumerate(lean.blocks):
        parts = [_weights(getattr(block.proj, name), fmt) for name in NAMES]
        if any(p is None for p in parts):
            return "its products are not fused plain ones (adapters, or a format without our kernels)"
        lora = tuple(t for p in stacks[i] for t in (p.a, p.b)) if adapted else ()
        if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in lora):
            return "its LoRA adapters are not float32 on the CPU"
        bias = _qkv_bias(block.proj.qkv)
        q_rows = config.heads * config.head_dim + 2 * config.kv_heads * config.head_dim
        layers.append(
            Layer(
                block.attn_norm.weight.detach().float(),
                block.mlp_norm.weight.detach().float(),
                bias if bias is not None else torch.zeros(q_rows),
                tuple(t for part in parts for t in part),
                lora,
            )
        )
    return config, layers


def attention_inputs(allowed: torch.Tensor | None, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's visible slots in slot order: idx (S, W) slot numbers, W the most any row sees, and
    counts (S,): row s sees idx[s, :counts[s]]. `allowed` (S, start+S) says which slots each row
    sees; None: causal (row i sees slots 0..start+i)."""
    if allowed is None:
        counts = torch.arange(start + 1, start + rows + 1)
        return torch.arange(start + rows).expand(rows, start + rows).contiguous(), counts
    counts = allowed.sum(dim=1)
    order = torch.argsort((~allowed).to(torch.int8), dim=1, stable=True)  # seen slots first, in order
    return order[:, : int(counts.max())].contiguous(), counts


@dataclass
class Adapted:
    """The adapted graph of a model with LoRA adapters: its config and layers, and its package once
    loaded (`StaticForward.adapted_ready`)."""

    config: LayerConfig
    layers: list[Layer]
    runner: object = None


class StaticForward:
    """A lean model's layers run by the compiled layer graph (`load_or_compile`)."""

    def __init__(
        self, lean, config: LayerConfig, layers: list[Layer], runner, seconds: float, built: bool, adapted=None
    ):
        self.lean, self.config, self.layers, self.runner = lean, config, layers, runner
        self.seconds, self.built = seconds, built  # what getting the package cost, and whether it was compiled now
        self.adapted: Adapted | None = adapted
        self._views: tuple[weakref.ref, list[tuple[torch.Tensor, torch.Tensor]]] | None = None

    def fits(self, rows: int) -> bool:
        return 1 <= rows <= MAX_ROWS

    def adapted_ready(self) -> bool:
        """Whether the forwards with the adapters on can run here: the adapted graph's package
        loaded, or loaded now once a build (in the background, say) has left it in the cache."""
        if self.adapted is None:
            return False
        if self.adapted.runner is None and ready(self.adapted.config):
            self.adapted.runner = torch._inductor.aoti_load_package(str(package_path(self.adapted.config)))
        return self.adapted.runner is not None

    def views(self, kv: StaticKV) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's keys and values (kv_heads, capacity, d) in the cache, made again for another
        cache or when it grew. Known by a weak reference to the cache's tensor: an id() would be
        reused by the next cache allocated once this one is freed, and its views would then read
        freed memory (garbage tokens from a run's first one)."""
        if self._views is None or self._views[0]() is not kv.data:
            self._views = (weakref.ref(kv.data), [(kv.data[i, 0], kv.data[i, 1]) for i in range(len(self.layers))])
        return self._views[1]

    def run(
        self,
        hidden: torch.Tensor,
        positions: list[int],
        kv: StaticKV,
        start: int,
        allowed: torch.Tensor | None,
        first: int,
        last: int,
        taps: tuple[int, ...],
        adapted: bool = False,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Layers first..last−1 on hidden (S, H) at `positions`, keys and values into slots
        start..start+S−1; returns the hidden states after `last` and after each tap. adapted: with
        the LoRA terms, through the adapted graph (`adapted_ready` first), gated as the embedding
        just marked the rows."""
        rows = hidden.shape[0]
        cos, sin = self.lean.rotary(positions)
        slots = torch.arange(start, start + rows)
        idx, counts = attention_inputs(allowed, start, rows)
        views = self.views(kv)
        runner, layers, gate = self.runner, self.layers, ()
        if adapted:
            runner, layers = self.adapted.runner, self.adapted.layers
            gate = (self.lean.gate.rows[:rows] if self.lean.gate is not None else torch.ones(rows, 1),)
        after = {first: hidden}
        for i in range(first, last):
            layer = layers[i]
            hidden = runner(
                hidden, cos, sin, slots, idx, counts, *views[i], layer.attn_norm, layer.mlp_norm, layer.qkv_bias,
                *layer.products, *gate, *layer.lora,
            )  # fmt: skip
            after[i + 1] = hidden
        return hidden, [after[k] for k in taps]


def package_path(config: LayerConfig) -> Path:
    """Where this machine's compiled layer for `config` is kept (machine: CPU model and flags,
    threads, torch; the kernels' source and the graph's version too)."""
    code = Path(__file__).read_text() + Path(static_graph.__file__).read_text()
    kernels = f"{native.source_key()}{fingerprint(code)}"  # the kernels' and the graph's code
    return build_root() / "compiled" / f"{machine_key()}-layer-{config.key()}-{kernels}-v{PACKAGE_VERSION}.pt2"


def ready(config: LayerConfig) -> bool:
    """Whether this machine's compiled layer for `config` is in the build cache (loads in seconds)."""
    return package_path(config).is_file()


def build(config: LayerConfig) -> bool:
    """This machine's compiled layer for `config` in the build cache: compiled now unless there
    (once per machine and model shape; another process building it is waited for). Returns whether
    it was compiled here."""
    if reason := native.unavailable():  # builds (once) and loads the kernels the graph calls
        raise RuntimeError(f"mtp-viz's CPU kernels are unavailable ({reason})")
    path = package_path(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process compiles; the others then load its package
        if path.is_file():
            return False
        log.warning("compiling the static forward (%s) for this machine once (~1 min)", config.fmt)
        compile_package(config, example_layer(config), path)
        return True


def load_or_compile(lean, build_adapted: bool = True) -> StaticForward:
    """The lean model's static forward: its compiled layer read from the cache, or compiled now
    (`build`); with LoRA adapters the adapted graph too, built now if `build_adapted` (else used
    once a build leaves it in the cache). RuntimeError says why not."""
    packed = pack(lean)
    if isinstance(packed, str):
        raise RuntimeError(packed)
    config, layers = packed
    started = time.perf_counter()
    built = build(config)
    runner = torch._inductor.aoti_load_package(str(package_path(config)))
    adapted = pack(lean, adapted=True) if lean.adapted is not None else None
    if isinstance(adapted, str):
        log.warning("the forwards with adapters on stay eager: %s", adapted)
        adapted = None
    elif adapted is not None:
        adapted = Adapted(*adapted)
        built = (build(adapted.config) if build_adapted else False) or built
    forward = StaticForward(lean, config, layers, runner, 0.0, built, adapted)
    forward.adapted_ready()
    forward.seconds = time.perf_counter() - started
    return forward


if __name__ == "__main__":  # a build in a process of its own (mtp_viz.compiled_choice): LayerConfig JSON, threads
    exit_with_parent()
    torch.set_num_threads(int(sys.argv[2]))  # the starting process's: machine_key, hence the package's path, has them
    os.nice(10)  # the user's runs first
    build(LayerConfig(**json.loads(sys.argv[1])))
