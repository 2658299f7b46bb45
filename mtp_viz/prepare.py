"""Engine preparation, outside the timed region: each model's lean forward compiled or eager, what
the trace records of the engine, and warm-up forwards through the paths decoding will use."""

import logging
import time
from typing import Any

import torch

from mtp_viz import compiled_choice
from mtp_viz.cache import LEAN, CachedModel, engine_for
from mtp_viz.lean import CompileUnavailable, lean_model
from mtp_viz.loading import LoadedModel

log = logging.getLogger(__name__)


def prepare_engine(models: list[LoadedModel], compile_mode: str) -> dict[str, Any]:
    """Set each model's lean forward to compiled or eager (`compile_mode`: on, off, or auto:
    compiled on a GPU, and on a CPU where it measured faster here, mtp_viz.compiled_choice); what
    the trace records of the engine: the forward (lean or transformers'), the linear path, compiled
    or not, why, and what it cost."""
    target = models[0]
    engine: dict[str, Any] = {
        "forward": engine_for(target.model),
        "linear": target.linear,
        "weights": target.weights_detail,
        "compiled": False,
        "compile_s": 0.0,
    }
    for m in models:
        lean = lean_model(m.model) if engine_for(m.model) == LEAN else None
        if lean is None:
            continue
        began = time.perf_counter()
        try:
            if compile_mode == "auto" and lean.device.type == "cpu":
                wanted, why = compiled_choice.choose(lean, m.model)
                if m is target:
                    engine["compile_note"] = why
            else:
                wanted = compile_mode == "on" or (compile_mode == "auto" and lean.device.type == "cuda")
                if wanted:
                    lean.compile()
        except CompileUnavailable as e:
            log.warning("torch.compile unavailable, running eager: %s", e)
            engine["compile_note"], wanted = str(e), False
        if wanted:
            engine["compiled"] = True
            engine["compile_s"] += time.perf_counter() - began
        else:
            lean.decompile()
    if compile_mode == "on" and engine["forward"] != LEAN:
        engine["compile_note"] = "the model runs on transformers' forward, which is not compiled here"
    return engine


@torch.inference_mode()
def warm_up(loaded: LoadedModel, prompt_ids: list[int], taps: tuple[int, ...] = ()) -> None:
    """Short forwards outside the timed region, through the engine decoding will use (its lean
    view, rotary tables, allocations, lazy kernels): two tokens, then one; with `taps` (an EAGLE-3
    target) the same again through the tapped forward, whose layer segments compile apart."""
    first, then = prompt_ids[:2], prompt_ids[:3] if len(prompt_ids) > 2 else prompt_ids[:2] + prompt_ids[:1]
    cached = CachedModel(loaded.model)
    cached.forward(first)
    cached.forward(then)
    if taps:
        cached = CachedModel(loaded.model)
        cached.forward_features(first, taps)
        cached.forward_features(then, taps)
