"""The thin runner between callers (CLI, UI, benchmarks) and strategies.

It resolves names to models and settings, warms the models up, runs a strategy's step generator
while timing it, attaches token texts, and assembles the Trace. It holds no decoding logic.
"""

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from mtp_viz.clock import Clock
from mtp_viz.detok import TextTracker
from mtp_viz.errors import InvalidSettingsError, UserError
from mtp_viz.loading import (
    DrafterRequest,
    LoadedModel,
    encode_prompt,
    load_drafting,
    load_model,
    resolve_device,
    shared_vocab_size,
)
from mtp_viz.machine import DRAFTER_WEIGHTS, machine_info
from mtp_viz.prepare import prepare_engine, warm_up
from mtp_viz.strategies import get_strategy
from mtp_viz.strategies.base import DecodeContext, GenerationSettings
from mtp_viz.strategies.variants import (  # noqa: F401 TEMP
    build_strategy_settings,
    coerce,
    parse_variant,
    setting_names,
    settings_of,
    split_variants,
)
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
    compile: str = COMPILE_AUTO  # auto | on | off: the compiled lean forward (mtp_viz.compiled_choice)
    # the weight format of every model of the run (mtp_viz.weights): fp32 | bf16 | int8 | q4, or auto
    # (measured on this machine; the CLI's and the app's default)
    weights: str = FP32


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
        target = load_model(request.model, request.device, request.dtype, request.weights)
        drafters = DrafterRequest(
            self.spec.name, request.draft, request.heads, request.eagle3, request.device, request.dtype, request.weights
        )
        self.drafting = load_drafting(target, self.spec.drafters(self.settings), drafters)
        self.settings = self.spec.fitted(self.settings, self.drafting)
        self.vocab_size = (
            shared_vocab_size(self.target, self.draft) if self.draft else self.target.model.config.vocab_size
        )
        self.prompt_ids = self._prompt_ids()
        self._check_length()
        self.trace: Trace | None = None
        self._cancelled = False
        self.engine: dict[str, Any] | None = None  # set by prepare()

    @property
    def target(self) -> LoadedModel:
        """The model the strategy decodes with (a mask-token model where its drafter is masks)."""
        return self.drafting.target

    @property
    def draft(self) -> LoadedModel | None:
        return self.drafting.draft

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
            models = [m for m in (self.target, self.draft) if m is not None]
            self.engine = prepare_engine(models, self.request.compile)
            if self.request.weights == AUTO:
                self.engine["weights_choice"] = self.target.weights_why
            if self.drafting.weights is not None:  # the format its drafter ran in (mtp_viz.loading.drafters)
                self.engine[DRAFTER_WEIGHTS] = self.drafting.weights
            eagle3 = self.drafting.eagle3
            taps = tuple(eagle3.config.aux_layer_ids) if eagle3 is not None else ()
            for m in (self.target, self.draft):
                if m is not None:
                    warm_up(m, self.prompt_ids, taps if m is self.target else ())
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
            heads=self.drafting.heads,
            eagle3=self.drafting.eagle3,
            mask_token_id=self.drafting.mask_token_id,
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
            draft_model=self.drafting.name,
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
