"""Peer baselines: transformers' own `generate` on the same model, prompt and settings, so every
benchmark row can say "ours vs transformers". Greedy, batch size 1, timed like our runs.

Peers run the plain model, as transformers loads it (our measured linear path switched off), and
`hf_static_compile` is what transformers offers for speed: its static cache with `torch.compile`
of the forward (on a CPU too). Its compilation, once per prompt length, runs in an untimed
warm-up call, as it would in a server that serves many requests."""

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from transformers import CompileConfig

from mtp_viz.clock import Clock
from mtp_viz.kernels import stock_linears
from mtp_viz.loading import LoadedModel

HF_GENERATE = "hf_generate"  # plain greedy generate
HF_STATIC_COMPILE = "hf_static_compile"  # transformers' own fast path: static cache + torch.compile
HF_ASSISTED = "hf_assisted"  # assisted generation with the same draft model (assistant_model)
HF_PROMPT_LOOKUP = "hf_prompt_lookup"  # prompt_lookup_num_tokens
PEERS = (HF_GENERATE, HF_STATIC_COMPILE, HF_ASSISTED, HF_PROMPT_LOOKUP)


@dataclass(frozen=True)
class PeerRun:
    peer: str
    output_token_ids: list[int]
    output_text: str
    wall_time_s: float
    machine: dict | None = None  # what the peer ran with, where it differs from ours (llama.cpp: threads, build)

    @property
    def tokens_per_s(self) -> float:
        return len(self.output_token_ids) / self.wall_time_s if self.wall_time_s > 0 else 0.0


@torch.inference_mode()
def run_peer(
    peer: str,
    target: LoadedModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    draft: LoadedModel | None = None,
    num_draft_tokens: int = 5,
    max_ngram_size: int = 3,
) -> PeerRun:
    extra = {}
    if peer == HF_ASSISTED:
        if draft is None:
            raise ValueError("hf_assisted needs a draft model")
        extra = {"assistant_model": draft.model, "num_assistant_tokens": num_draft_tokens}
    elif peer == HF_PROMPT_LOOKUP:
        extra = {"prompt_lookup_num_tokens": num_draft_tokens, "max_matching_ngram_size": max_ngram_size}
    elif peer == HF_STATIC_COMPILE:
        config = CompileConfig(fullgraph=False, mode="reduce-overhead" if target.device.type == "cuda" else "default")
        config._compile_all_devices = True  # transformers compiles on accelerators only unless told
        extra = {"cache_implementation": "static", "compile_config": config}
    elif peer != HF_GENERATE:
        raise ValueError(f"unknown peer {peer!r}; choose one of {', '.join(PEERS)}")
    ids = torch.tensor([prompt_ids], device=target.device)
    clock = Clock(target.device)

    def generate():
        return target.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=sorted(target.eos_token_ids),
            pad_token_id=0,
            **extra,
        )

    with stock_linears(target.model), stock_linears(draft.model) if draft else nullcontext():
        if peer == HF_STATIC_COMPILE:
            generate()  # compiles for this prompt and cache length, untimed
        start = clock.now()
        out = generate()
        wall = clock.now() - start
    new = out[0, len(prompt_ids) :].tolist()
    eos = [i for i, t in enumerate(new) if t in target.eos_token_ids]
    new = new[: eos[0] + 1] if eos else new
    text = target.tokenizer.decode(new, skip_special_tokens=False) if target.tokenizer else ""
    return PeerRun(peer, new, text, wall)
