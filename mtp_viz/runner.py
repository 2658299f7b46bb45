"""The thin runner between callers (CLI, UI, benchmarks) and strategies.

It resolves names to models and settings, warms the models up, runs a strategy's step generator
while timing it, attaches token texts, and assembles the Trace. It holds no decoding logic.
"""

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from mtp_viz.cache import LEAN, CachedModel, engine_for
from mtp_viz.clock import Clock
from mtp_viz.detok import TextTracker
from mtp_viz.eagle3_models import load_eagle3_for
from mtp_viz.errors import InvalidSettingsError, UserError
from mtp_viz.lean import CompileUnavailable, lean_model
from mtp_viz.machine import machine_info
from mtp_viz.models import (
    LoadedModel,
    encode_prompt,
    linear_path,
    load_heads_for,
    load_model,
    resolve_device,
    shared_vocab_size,
    weights_choice,
)
from mtp_viz.registry import load_registry
from mtp_viz.strategies import STRATEGIES, get_strategy
from mtp_viz.strategies.base import DecodeContext, GenerationSettings
from mtp_viz.strategies.settings import for_device
from mtp_viz.trace import STOP_CANCELLED, STOP_EOS, STOP_MAX_NEW_TOKENS, Step, Trace
from mtp_viz.weights import AUTO, CHOICES, FP32

log = logging.getLogger(__name__)

MAX_PROMPT_CHARS = 32_000
COMPILE_AUTO, COMPILE_ON, COMPILE_OFF = "auto", "on", "off"
COMPILE_CHOICES = (COMPILE_AUTO, COMPILE_ON, COMPILE_OFF)
RECORD_FULL = "full"
RECORD_MINIMAL = "minimal"  # no token texts, no probabilities: to measure what tracing costs


def valid_unicode(text: str) -> str:
    """`text` with unpaired surrogates (which JSON and argv can carry, and tokenizers refuse)
    replaced by U+FFFD; pairs written as two code points become the one character they encode."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


@dataclass(frozen=True)
class RunRequest:
    prompt: str | None = None  # text, or give prompt_ids
    prompt_ids: tuple[int, ...] | None = None
    model: str | None = None  # registry id or local model directory; None: the device's default
    strategy: str = "autoregressive"
    draft: str | None = None  # None: the model's first registered draft, if the strategy needs one
    heads: str | None = None  # None: the model's first registered MTP heads, if the strategy needs them
    eagle3: str | None = None  # None: the model's first registered EAGLE-3 drafter, if the strategy needs one
    raw: bool = False  # True: no chat template
    generation: GenerationSettings = field(default_factory=GenerationSettings)
    strategy_settings: dict[str, Any] = field(default_factory=dict)
    device: str | None = None
    dtype: str | None = None
    record: str = RECORD_FULL
    compile: str = COMPILE_AUTO  # auto (on a GPU) | on | off: torch.compile of the lean forward
    # the weight format of every model of the run (mtp_viz.weights): fp32 | bf16 | int8 | q4, or auto
    # (measured on this machine; the CLI's and the app's default)
    weights: str = FP32


def setting_names(strategy: str) -> set[str]:
    return {f.name for f in fields(get_strategy(strategy).settings_cls)}


def settings_of(strategy: str, offered: dict[str, Any]) -> dict[str, Any]:
    """The offered values this strategy has a setting for (None means unset): for callers, like the
    UI and the bench, that hold one set of controls for every strategy."""
    known = setting_names(strategy)
    return {k: v for k, v in offered.items() if k in known and v is not None}


def coerce(strategy: str, name: str, value: Any) -> Any:
    """A setting value as typed by a person (text) or a UI (floats for integers) → the setting's type."""
    field = next((f for f in fields(get_strategy(strategy).settings_cls) if f.name == name), None)
    if field is None:
        allowed = ", ".join(sorted(setting_names(strategy))) or "none"
        raise InvalidSettingsError(f"strategy {strategy} has no setting {name} (settings: {allowed})")
    kind = type(field.default)
    if kind is bool and isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    if kind is int and isinstance(value, (str, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except ValueError:
            raise InvalidSettingsError(f"{name} must be a whole number, got {value!r}") from None
        if not number.is_integer():
            raise InvalidSettingsError(f"{name} must be a whole number, got {value}")
        return int(number)
    if kind is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise InvalidSettingsError(f"{name} must be a number, got {value!r}") from None
    return value


def split_variants(text: str) -> list[str]:
    """ "a,b:tree=0,1,00,c" → ["a", "b:tree=0,1,00", "c"]: a comma starts a new variant only
    where a strategy name follows, so settings whose values hold commas (MTP trees) survive."""
    variants: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part.split(":")[0] in STRATEGIES or not variants:
            variants.append(part)
        else:
            variants[-1] += "," + part
    return variants


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """ "conf_adapt:tau=0.8:k=4" → ("conf_adapt", {"tau": 0.8, "k": 4}); a plain name has no settings."""
    name, *pairs = text.strip().split(":")
    get_strategy(name)
    values = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise InvalidSettingsError(f"expected key=value after {name}:, got {pair!r}")
        values[key.strip()] = coerce(name, key.strip(), value.strip())
    return name, values


def build_strategy_settings(strategy: str, values: dict[str, Any], device_type: str):
    """Keyword values → the strategy's frozen settings, the device's defaults for the rest
    ("cpu", "cuda", ...); unknown keys are an error."""
    spec = get_strategy(strategy)
    known = setting_names(strategy)
    unknown = sorted(set(values) - known)
    if unknown:
        allowed = ", ".join(sorted(known)) or "none"
        raise InvalidSettingsError(f"strategy {strategy} has no setting {', '.join(unknown)} (settings: {allowed})")
    return for_device(spec.settings_cls, device_type, values)


class Run:
    """One decoding run. Iterate `steps()` to stream; afterwards `trace` holds the result."""

    def __init__(self, request: RunRequest):
        if request.prompt is not None:
            request = replace(request, prompt=valid_unicode(request.prompt))
        self.request = request
        if request.prompt_ids is None and (request.prompt is None or not request.prompt.strip()):
            raise UserError("the prompt is empty")  # before any model loads or any measurement
        self.spec = get_strategy(request.strategy)
        device = resolve_device(request.device)
        self.settings = build_strategy_settings(request.strategy, request.strategy_settings, device.type)
        if request.record not in (RECORD_FULL, RECORD_MINIMAL):
            raise InvalidSettingsError(f"record must be {RECORD_FULL} or {RECORD_MINIMAL}")
        if request.compile not in COMPILE_CHOICES:
            raise InvalidSettingsError(f"compile must be one of {', '.join(COMPILE_CHOICES)}, got {request.compile!r}")
        if request.weights not in CHOICES:
            raise InvalidSettingsError(f"weights must be one of {', '.join(CHOICES)}, got {request.weights!r}")
        model_name = request.model or load_registry().default_for(device.type)
        self.target = load_model(model_name, request.device, request.dtype, request.weights)
        self.draft = self._load_draft(model_name) if self.spec.needs_draft else None
        entry = load_registry().models.get(model_name)
        self.mask_token_id = entry.mask_token_id if entry else None
        if self.mask_token_id is None and entry and entry.mask_model and self.spec.masks_wanted(self.settings):
            # the model's mask-token MTP model: the same weights with a mask token and its adapter
            self.target = load_model(entry.mask_model, request.device, request.dtype, request.weights)
            self.mask_token_id = load_registry().get(entry.mask_model).mask_token_id
        self.heads_name, self.heads = (
            load_heads_for(self.target, request.heads)
            if self.spec.heads_needed(self.settings, self.mask_token_id)
            else (None, None)
        )
        self.eagle3_name, self.eagle3 = (
            load_eagle3_for(self.target, request.eagle3) if self.spec.needs_eagle3 else (None, None)
        )
        self.vocab_size = (
            shared_vocab_size(self.target, self.draft) if self.draft else self.target.model.config.vocab_size
        )
        self.prompt_ids = self._prompt_ids()
        self._check_length()
        self.trace: Trace | None = None
        self._cancelled = False
        self.engine: dict[str, Any] | None = None  # set by prepare()

    def _load_draft(self, model_name: str) -> LoadedModel:
        name = self.request.draft
        if name is None:
            entry = load_registry().models.get(model_name)
            if entry is None or not entry.drafts:
                raise UserError(
                    f"strategy {self.spec.name} needs a draft model; none is registered for "
                    f"{model_name}, so name one with --draft"
                )
            name = entry.drafts[0]
        return load_model(name, self.request.device, self.request.dtype, self.request.weights)

    def _prompt_ids(self) -> list[int]:
        r = self.request
        if r.prompt_ids is not None:
            ids = [int(t) for t in r.prompt_ids]
            if not ids or any(t < 0 or t >= self.vocab_size for t in ids):
                raise UserError(f"prompt_ids must be a non-empty list of ids below {self.vocab_size}")
            return ids
        if r.prompt is None or not r.prompt.strip():
            raise UserError("the prompt is empty")
        if len(r.prompt) > MAX_PROMPT_CHARS:
            raise UserError(f"the prompt has {len(r.prompt)} characters; the limit is {MAX_PROMPT_CHARS}")
        return encode_prompt(self.target, r.prompt, raw=r.raw)

    def _check_length(self) -> None:
        limit = getattr(self.target.model.config, "max_position_embeddings", None)
        needed = len(self.prompt_ids) + self.request.generation.max_new_tokens
        if limit and needed > limit:
            raise UserError(
                f"prompt ({len(self.prompt_ids)} tokens) plus max_new_tokens "
                f"({self.request.generation.max_new_tokens}) exceeds the model's context of {limit}"
            )

    def cancel(self) -> None:
        """Stop after the step in progress; the strategy's caches are released."""
        self._cancelled = True

    def prepare(self) -> dict[str, Any]:
        """Compile (when asked) and warm the models up, outside the timed region. Returns what the
        trace records of the engine; `steps()` calls it when the caller has not."""
        if self.engine is None:
            wanted = self.request.compile == COMPILE_ON or (
                self.request.compile == COMPILE_AUTO and self.target.device.type == "cuda"
            )
            self.engine = prepare_engine([m for m in (self.target, self.draft) if m is not None], wanted)
            if self.request.weights == AUTO:
                self.engine["weights_choice"] = weights_choice(self.target.name)
            taps = tuple(self.eagle3.config.aux_layer_ids) if self.eagle3 is not None else ()
            for m in (self.target, self.draft):
                if m is not None:
                    _warm_up(m, self.prompt_ids, taps if m is self.target else ())
        return self.engine

    def steps(self) -> Iterator[Step]:
        self.prepare()
        gen = self.request.generation
        device = self.target.device
        clock = Clock(device)
        generator = None
        if not gen.warp.greedy:
            generator = torch.Generator(device=device).manual_seed(gen.seed)
        ctx = DecodeContext(
            target=self.target.model,
            draft=self.draft.model if self.draft else None,
            heads=self.heads,
            eagle3=self.eagle3,
            mask_token_id=self.mask_token_id,
            prompt_ids=self.prompt_ids,
            generation=gen,
            eos_token_ids=self.target.eos_token_ids,
            vocab_size=self.vocab_size,
            clock=clock,
            generator=generator,
            record_probs=self.request.record == RECORD_FULL,
        )
        texts = TextTracker(self.target.tokenizer, self.prompt_ids) if self._records_text else None
        steps: list[Step] = []
        paused = paused_before_last = 0.0
        stop_reason = STOP_MAX_NEW_TOKENS
        strategy = self.spec.run(ctx, self.settings)
        start = last = clock.now()
        try:
            for step in strategy:
                if texts is not None:
                    attach_text(step, texts)
                steps.append(step)
                last, paused_before_last = clock.now(), paused
                yield step
                paused += clock.now() - last  # time the consumer held the stream is not decoding
                if self._cancelled:
                    stop_reason = STOP_CANCELLED
                    break
        finally:
            strategy.close()
        if stop_reason != STOP_CANCELLED and ctx.output and ctx.output[-1] in ctx.eos_token_ids:
            stop_reason = STOP_EOS
        self.trace = self._trace(steps, ctx.output, last - start - paused_before_last, stop_reason)

    @property
    def _records_text(self) -> bool:
        return self.target.tokenizer is not None and self.request.record == RECORD_FULL

    def _trace(self, steps: list[Step], output: list[int], wall: float, stop_reason: str) -> Trace:
        r = self.request
        tok = self.target.tokenizer
        settings = {
            **{f.name: getattr(r.generation, f.name) for f in fields(r.generation)},
            **{f.name: getattr(self.settings, f.name) for f in fields(self.settings)},
            "raw": r.raw,
            "eos_token_ids": sorted(self.target.eos_token_ids),
            "record": r.record,
            "compile": r.compile,
            "weights": r.weights,
        }
        return Trace(
            strategy=self.spec.name,
            model=self.target.name,
            draft_model=self.draft.name if self.draft else self.heads_name or self.eagle3_name,
            settings=settings,
            prompt_token_ids=list(self.prompt_ids),
            output_token_ids=list(output),
            steps=steps,
            wall_time_s=wall,
            stop_reason=stop_reason,
            output_text=tok.decode(output, skip_special_tokens=False) if tok is not None else "",
            prompt_text=r.prompt or "",
            device=str(self.target.device),
            dtype=self.target.dtype,
            machine={**machine_info(self.target.device), **self.engine},
        )


def run(request: RunRequest) -> Trace:
    """Run to the end and return the trace."""
    r = Run(request)
    for _ in r.steps():
        pass
    return r.trace


def attach_text(step: Step, texts: TextTracker) -> None:
    """The text each token of a step adds (drafted ones as if appended; ids an engine did not
    report have none)."""
    known = [d for d in step.drafted if d.token_id is not None]
    if known:
        for d, t in zip(known, texts.peek([d.token_id for d in known]), strict=True):
            d.text = t
    for e, t in zip(step.emitted, texts.commit([e.token_id for e in step.emitted]), strict=True):
        e.text = t


def prepare_engine(models: list[LoadedModel], compile_wanted: bool) -> dict[str, Any]:
    """Set each model's lean forward to compiled or eager; what the trace records of the engine:
    the forward (lean or transformers'), the linear path, compiled or not and what it cost."""
    target = models[0]
    engine: dict[str, Any] = {
        "forward": engine_for(target.model),
        "linear": linear_path(target),
        "weights": target.weights_detail,
        "compiled": False,
        "compile_s": 0.0,
    }
    for m in models:
        lean = lean_model(m.model) if engine_for(m.model) == LEAN else None
        if lean is None:
            continue
        if not compile_wanted:
            lean.decompile()
            continue
        try:
            engine["compile_s"] += lean.compile()
            engine["compiled"] = True
        except CompileUnavailable as e:
            log.warning("torch.compile unavailable, running eager: %s", e)
            engine["compile_note"] = str(e)
    if compile_wanted and engine["forward"] != LEAN:
        engine["compile_note"] = "the model runs on transformers' forward, which is not compiled here"
    return engine


@torch.inference_mode()
def _warm_up(loaded: LoadedModel, prompt_ids: list[int], taps: tuple[int, ...] = ()) -> None:
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
