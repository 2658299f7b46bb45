"""A RunRequest on vLLM: which server it needs (model, speculation), that server started and
always stopped, leased from a pool that keeps it for later runs (mtp_viz.serving.pool), or one
the user runs; and one completion per prompt as a Trace.

The prompt is tokenised here exactly as our engine does it (chat template included) and sent as
token ids, so both engines decode the same prompt; the trace's texts come from the same tokenizer.
The target's weights are never loaded in our process: vLLM loads them from the target's directory,
and the plan reads only its tokenizer and generation config (`ServedTarget`).
"""

import contextlib
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

import httpx
from transformers import AutoConfig, GenerationConfig, PreTrainedTokenizerBase

from mtp_viz.detok import TextTracker
from mtp_viz.errors import UserError
from mtp_viz.loading import eagle3_dir, eagle3_entry, encode_prompt, model_name, resolve_device
from mtp_viz.loading.loaded import eos_ids
from mtp_viz.loading.sources import described, locate, tokenizer_at
from mtp_viz.loading.spec import LoadSpec, load_spec
from mtp_viz.machine import machine_info
from mtp_viz.registry import load_registry
from mtp_viz.runner import MAX_PROMPT_CHARS, RunRequest, attach_text, valid_unicode
from mtp_viz.serving.client import Completion, complete, completion_body
from mtp_viz.serving.export import export_draft, model_dir
from mtp_viz.serving.methods import served, server_args
from mtp_viz.serving.pool import ServerPool
from mtp_viz.serving.server import Progress, ServerConfig, ServerError, StopAsked, VLLMServer
from mtp_viz.serving.traces import Served, trace_from_completion
from mtp_viz.strategies.variants import build_strategy_settings
from mtp_viz.trace import Trace

BACKEND_OURS, BACKEND_VLLM = "mtp-viz", "vllm"
BACKENDS = (BACKEND_OURS, BACKEND_VLLM)
CPU_KV_CACHE_GIB = "2"  # vLLM's CPU backend takes most of the memory for its KV cache unless told
WARM_UP_PROMPT = "Say hello."
THREADS_LINE = re.compile(r"Reducing Torch threads from (\d+) to (\d+)")


@dataclass(frozen=True)
class ServedTarget:
    """The target as a plan needs it (what `encode_prompt` and the trace read), its weights left
    to vLLM: `source` names where they lie as a LoadedModel's does (mtp_viz.serving.export.model_dir)."""

    name: str
    tokenizer: PreTrainedTokenizerBase | None
    chat: bool
    eos_token_ids: frozenset[int]
    source: str


@lru_cache(maxsize=8)
def served_target(spec: LoadSpec) -> ServedTarget:
    """The target's tokenizer, chat flag, EOS ids and directory, read once per process; its weights
    are left to vLLM."""
    where, source = locate(spec)
    tokenizer = tokenizer_at(where)
    name, chat = described(spec, tokenizer)
    return ServedTarget(name, tokenizer, chat, eos_ids(_generation_config(where), tokenizer), source)


def _generation_config(where: str) -> GenerationConfig:
    """The generation config the model would load with (its file, else its config's)."""
    local = {"local_files_only": True} if Path(where).is_dir() else {}  # else a hub id
    try:
        return GenerationConfig.from_pretrained(where, **local)
    except OSError:
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(where, **local))


@dataclass(frozen=True)
class VLLMPlan:
    """What a request needs from a vLLM server, and how to describe its runs."""

    request: RunRequest
    target: ServedTarget
    settings: Any  # the strategy's frozen settings
    draft_name: str | None
    speculative_config: dict | None
    server: ServerConfig
    note: str | None = None  # how vLLM's method differs from the strategy on our engine

    def served(self, server: VLLMServer) -> Served:
        r = self.request
        flat = {
            **{f.name: getattr(r.generation, f.name) for f in fields(r.generation)},
            **{f.name: getattr(self.settings, f.name) for f in fields(self.settings)},
            "raw": r.raw,
            "eos_token_ids": sorted(self.target.eos_token_ids),
            "max_model_len": self.server.max_model_len,
        }
        threads = _server_threads(server)
        engine = {
            "vllm": server.version,
            "vllm_url": server.url,
            "server_args": server.args or None,  # None: a server the user runs (its arguments unknown here)
            "speculative_config": self.speculative_config,
            "dtype": self.server.dtype,
        }
        if self.note:
            engine["served_note"] = self.note
        return Served(
            strategy=r.strategy,
            model=self.target.name,
            draft_model=self.draft_name,
            method=(self.speculative_config or {}).get("method"),
            speculative_config=self.speculative_config,
            settings=flat,
            eos_token_ids=self.target.eos_token_ids,
            machine={**machine_info(resolve_device(r.device)), "threads": threads, **engine},
        )


def plan(request: RunRequest) -> VLLMPlan:
    """Check a request can run on vLLM and work out its server (exporting the draft if needed;
    `eagle`: `request.eagle3` names the EAGLE-3 drafter, as on our engine, default the model's first registered)."""
    strategy = served(request.strategy)
    device = resolve_device(request.device)
    values = strategy.served_values(request.strategy_settings)
    settings = build_strategy_settings(request.strategy, values, device.type)
    name = model_name(request.model, request.device)
    target = served_target(load_spec(name, "cpu", "float32"))  # no weights: vLLM loads them
    draft_name, draft_dir = None, None
    if strategy.method is not None and request.strategy == "speculative":
        entry = load_registry().models.get(name)
        draft_name = request.draft or (entry.drafts[0] if entry and entry.drafts else None)
        if draft_name is None:
            raise UserError(f"speculative on vLLM needs a draft model; none is registered for {name}: pass --draft")
        draft_dir = str(export_draft(draft_name))
    if request.strategy == "eagle":  # our checkpoint is in vLLM's format already: served as it is
        drafter = eagle3_entry(target.name, request.eagle3)
        draft_name, draft_dir = drafter.id, str(eagle3_dir(drafter))
    spec = strategy.speculative_config(settings, draft_dir)
    dtype = (
        request.dtype if request.dtype not in (None, "auto") else ("bfloat16" if device.type == "cuda" else "float32")
    )
    config = ServerConfig(
        model_dir=model_dir(target),
        served_name=target.name,
        extra_args=tuple(server_args(spec)),
        dtype=dtype,
        env={"VLLM_CPU_KVCACHE_SPACE": CPU_KV_CACHE_GIB} if device.type == "cpu" else {},
    )
    return VLLMPlan(request, target, settings, draft_name, spec, config, strategy.note)


def open_server(
    p: VLLMPlan, url: str | None = None, progress: Progress | None = None, cancelled: StopAsked | None = None
) -> VLLMServer:
    """The plan's server: started as a child (stop it: use `with`), or the one at `url`."""
    if url:
        return VLLMServer.connect(url, p.target.name)
    return VLLMServer.start(p.server, progress=progress, cancelled=cancelled)


@contextlib.contextmanager
def server_for(
    p: VLLMPlan,
    url: str | None = None,
    pool: ServerPool | None = None,
    progress: Progress | None = None,
    cancelled: StopAsked | None = None,
) -> Iterator[tuple[VLLMServer, bool]]:
    """The plan's server for one run and whether it has answered runs before: the user's at `url`,
    else one leased from `pool` (kept after the run), else one started for the run and stopped after it."""
    if pool is not None and not url:
        with pool.lease(p.server, progress, cancelled) as lease:
            yield lease.server, lease.reused
        return
    with open_server(p, url, progress, cancelled) as server:
        yield server, False


def prompt_ids(p: VLLMPlan, prompt: str | None = None) -> list[int]:
    r = p.request
    if r.prompt_ids is not None and prompt is None:
        return [int(t) for t in r.prompt_ids]
    text = valid_unicode(prompt if prompt is not None else r.prompt or "")
    if not text.strip():
        raise UserError("the prompt is empty")
    if len(text) > MAX_PROMPT_CHARS:
        raise UserError(f"the prompt has {len(text)} characters; the limit is {MAX_PROMPT_CHARS}")
    return encode_prompt(p.target, text, raw=r.raw)


def request_body(p: VLLMPlan, ids: list[int]) -> dict[str, Any]:
    g = p.request.generation
    if len(ids) + g.max_new_tokens > p.server.max_model_len:
        raise UserError(
            f"prompt ({len(ids)} tokens) plus max_new_tokens ({g.max_new_tokens}) exceeds the server's "
            f"context of {p.server.max_model_len}"
        )
    return completion_body(p.target.name, ids, g.max_new_tokens, g.temperature, g.top_k, g.top_p, g.seed)


def to_trace(p: VLLMPlan, server: VLLMServer, c: Completion, prompt_text: str = "") -> Trace:
    trace = trace_from_completion(c, p.served(server), prompt_text)
    attach_texts(trace, p.target)
    return trace


def attach_texts(trace: Trace, target: ServedTarget) -> None:
    """Token texts as our runner writes them (drafted ids vLLM did not report stay without text)."""
    if target.tokenizer is None:
        return
    texts = TextTracker(target.tokenizer, trace.prompt_token_ids)
    for step in trace.steps:
        attach_text(step, texts)
    trace.output_text = target.tokenizer.decode(trace.output_token_ids, skip_special_tokens=False)


def run_vllm(
    request: RunRequest,
    url: str | None = None,
    progress: Progress | None = None,
    cancelled: StopAsked | None = None,
    pool: ServerPool | None = None,
) -> Trace:
    """One prompt on vLLM, start to end, on `server_for`'s server. The trace's machine says whether
    the server had answered before and when the first token came counted from the run's start
    (`run_ttft_s`: planning, the server's start or wait, warm-up and the request's own `ttft_s`)."""
    began = time.perf_counter()
    p = plan(request)
    ids = prompt_ids(p)
    body = request_body(p, ids)
    with server_for(p, url, pool, progress, cancelled) as (server, reused), httpx.Client() as client:
        try:
            if not reused:
                warm_up(client, server, p)
            before = time.perf_counter() - began
            completion = complete(client, server.url, body)
        except httpx.HTTPError as e:
            raise ServerError(f"the vLLM request failed: {e}") from None
        trace = to_trace(p, server, completion, request.prompt or "")
    first = None if completion.ttft_s is None else before + completion.ttft_s
    trace.machine.update(server_reused=reused, run_ttft_s=first)
    return trace


def warm_up(client: httpx.Client, server: VLLMServer, p: VLLMPlan) -> None:
    """A short untimed request first (a fresh server's first request pays one-off costs), on
    another prompt so that no cache it leaves helps the timed one."""
    complete(client, server.url, completion_body(p.target.name, prompt_ids(p, WARM_UP_PROMPT), 8))


def _server_threads(server: VLLMServer) -> int | str | None:
    """Torch threads vLLM's CPU worker runs with (it reduces them to leave a core for serving)."""
    for line in server.log_lines():
        found = THREADS_LINE.search(line)
        if found:
            return int(found.group(2))
    return None
