"""A corpus build with its engine: answers by a vLLM server (started for the build and stopped
after it, or one already running) at high concurrency, or by our engine (the fallback without
vLLM, the same greedy text). The corpus's format, prompts and build: mtp_viz.training.corpus."""

import asyncio
from dataclasses import replace
from pathlib import Path

import httpx

from mtp_viz.errors import UserError
from mtp_viz.loading import model_name
from mtp_viz.loading.spec import load_spec
from mtp_viz.runner import RunRequest, run
from mtp_viz.serving.backend import open_server, plan, served_target
from mtp_viz.serving.client import complete_async, completion_body
from mtp_viz.serving.server import ServerError, vllm_python
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.trace import STOP_MAX_NEW_TOKENS
from mtp_viz.training.corpus import Answer, Answerer, CorpusConfig, Encoder, Item, build, default_folder

VLLM, OURS = "vllm", "ours"
AUTO = "auto"
ENGINES = (AUTO, VLLM, OURS)


def answer_with_vllm(server, encode: Encoder, cfg: CorpusConfig) -> Answerer:
    """Answers through a running vLLM server, `cfg.concurrency` requests in flight."""

    async def one(client: httpx.AsyncClient, gate: asyncio.Semaphore, item: Item) -> Answer:
        # no per-request seed: vLLM 0.32's CPU worker dies on a seeded request whose prefill is split
        # ("CPU Generator does not use offset"); the manifest says its sampled answers are unseeded
        body = completion_body(server.served_name, item.ids, cfg.max_new_tokens, item.temperature)
        async with gate:
            c = await complete_async(client, server.url, body)
        return c.token_ids, encode.decode(c.token_ids), c.finish_reason

    async def shard(items: list[Item]) -> list[Answer]:
        gate = asyncio.Semaphore(cfg.concurrency)
        limits = httpx.Limits(max_connections=cfg.concurrency)
        async with httpx.AsyncClient(limits=limits) as client:
            return list(await asyncio.gather(*(one(client, gate, i) for i in items)))

    return lambda items: asyncio.run(shard(items))


def answer_with_ours(model: str, encode: Encoder, cfg: CorpusConfig, device: str | None = None) -> Answerer:
    """Answers by our engine, autoregressive, one prompt at a time (the fallback without vLLM)."""

    def answer(items: list[Item]) -> list[Answer]:
        out = []
        for item in items:
            generation = GenerationSettings(cfg.max_new_tokens, temperature=item.temperature, seed=item.seed)
            trace = run(RunRequest(prompt_ids=tuple(item.ids), model=model, generation=generation, device=device))
            ids = list(trace.output_token_ids)
            out.append((ids, encode.decode(ids), "length" if trace.stop_reason == STOP_MAX_NEW_TOKENS else "stop"))
        return out

    return answer


# 64 requests of up to 1,536 + 256 tokens hold up to ~5 GB of KV cache (float32); the interactive
# server's 2 GiB would hold few. vLLM's CPU worker keeps a core for its scheduler unless told, and
# generating is compute-bound (2-core EPYC, B = 32: a decode step 370 → 251 ms with both cores).
CORPUS_SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "6", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def vllm_here() -> bool:
    """Whether a vLLM interpreter is installed beside us (.venv-vllm, or MTP_VIZ_VLLM_PYTHON)."""
    try:
        vllm_python()
    except ServerError:
        return False
    return True


def make(
    model: str | None, folder: Path | None, cfg: CorpusConfig, engine: str = AUTO, url: str | None = None
) -> tuple[Path, dict]:
    """Build (or finish) the corpus of `model`'s answers in `folder` (default: the repository's,
    `default_folder`) with `engine`: vLLM (a server started for the build and stopped after it, or
    the one at `url`) or ours; auto: vLLM where it is installed or `url` is given. The folder and
    its manifest."""
    if engine not in ENGINES:
        raise UserError(f"engine {engine!r} is not one of {', '.join(ENGINES)}")
    name = model_name(model, "cpu")
    target = served_target(load_spec(name, "cpu", "float32"))  # the tokenizer; no weights
    if target.tokenizer is None:
        raise UserError(f"{name} has no tokenizer: a corpus needs one")
    folder = folder or default_folder(target.name)
    encode = Encoder(target)
    use = engine if engine != AUTO else VLLM if url or vllm_here() else OURS
    if use == OURS:
        answer = answer_with_ours(name, encode, cfg)
        return folder, build(folder, cfg, encode, answer, target.name, {"engine": "mtp-viz"})
    served = plan(RunRequest(model=name))
    if served.server.env:  # a CPU server: room for CONCURRENCY long prompts in its KV cache
        served = replace(served, server=replace(served.server, env={**served.server.env, **CORPUS_SERVER_ENV}))
    with open_server(served, url) as server:
        engine_note = {"engine": "vllm", "version": server.version, "started_here": url is None, "seeded": False}
        return folder, build(folder, cfg, encode, answer_with_vllm(server, encode, cfg), target.name, engine_note)
