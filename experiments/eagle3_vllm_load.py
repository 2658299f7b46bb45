"""Does vLLM load and serve an EAGLE-3 checkpoint that `save_eagle3` writes, and stay lossless?

    nice .venv/bin/python experiments/eagle3_vllm_load.py 2>&1 | tee docs/results/eagle3-vllm-load.log

Sends greedy completions (32 tokens) of four fixed prompts to a plain vLLM server (.venv-vllm,
float32 on CPU), then to one started with `--speculative-config {"method": "eagle3", ...}` for
each of two drafters that `save_eagle3` writes for the embedded target (smollm2-135m; sizes read
from its converted model directory), 8192 draft ids, aux layers (2, 15, 27), one server at a time:
1. seeded random weights, draft vocabulary every 6th target id (so d2t is not all zeros): vLLM
   loads it and the output stays the target's; it accepts almost nothing.
2. a zero head whose ties make it always draft the plain outputs' most frequent token, reachable
   only through d2t: the accepted counts vLLM reports should equal those the plain outputs
   predict, which checks the d2t direction (target = draft + d2t[draft]).
Prints per prompt whether the outputs are token-identical and the drafted/accepted counts.

Wrote docs/results/eagle3-vllm-load.log (2026-12-05), quoted in docs/eagle3.md "Checked against
vLLM": both loaded, 4/4 prompts identical each; accepted 0 of 297, then 5 of 282 as predicted.
"""

import collections
import json
import tempfile
import time
from pathlib import Path

import httpx
import torch

from mtp_viz.drafters.eagle3 import Eagle3Config, Eagle3Drafter, save_eagle3
from mtp_viz.loading import encode_prompt, load_model
from mtp_viz.serving.backend import CPU_KV_CACHE_GIB
from mtp_viz.serving.client import complete, completion_body, spec_counters
from mtp_viz.serving.export import model_dir
from mtp_viz.serving.methods import server_args
from mtp_viz.serving.server import ServerConfig, VLLMServer

MODEL = "smollm2-135m"
DRAFT_VOCAB = 8192
AUX_LAYERS = (2, 15, 27)
NUM_SPECULATIVE_TOKENS = 3
MAX_NEW_TOKENS = 32
SEED = 0
PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 10.",
)


def build_drafter(target_config: dict, targets: torch.Tensor) -> Eagle3Drafter:
    """Seeded random weights; `targets` (draft_V,): the target id of each draft id."""
    c = target_config
    config = Eagle3Config(
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"],
        head_dim=c["head_dim"],
        rms_norm_eps=c["rms_norm_eps"],
        rope_theta=(c.get("rope_parameters") or {}).get("rope_theta") or c["rope_theta"],
        max_position_embeddings=c["max_position_embeddings"],
        vocab_size=c["vocab_size"],
        draft_vocab_size=len(targets),
        aux_layer_ids=AUX_LAYERS,
    )
    torch.manual_seed(SEED)
    drafter = Eagle3Drafter(config)
    drafter.d2t.copy_(targets - torch.arange(len(targets)))  # target id = draft id + d2t[draft id]
    drafter.t2d.zero_()[targets] = True
    return drafter


def constant_drafter(target_config: dict, token: int) -> Eagle3Drafter:
    """Always drafts `token`, through d2t: a zero head ties every draft logit, vLLM's argmax over
    the target vocabulary takes the lowest target id, and `token` is the lowest, at draft id
    DRAFT_VOCAB // 2. Without d2t applied as target = draft + d2t[draft] it would draft another."""
    targets = token + 1 + torch.arange(DRAFT_VOCAB)
    targets[DRAFT_VOCAB // 2] = token
    drafter = build_drafter(target_config, targets)
    torch.nn.init.zeros_(drafter.lm_head.weight)
    return drafter


def expected_accepted(tokens: list[int], token: int) -> int:
    """Drafted tokens a constant-`token` drafter gets accepted on a greedy output (the first token
    comes from the prefill; each step keeps the leading matches of its draft, then one more)."""
    accepted, i = 0, 1
    while i < len(tokens):
        a = 0
        while a < NUM_SPECULATIVE_TOKENS and i + a < len(tokens) and tokens[i + a] == token:
            a += 1
        accepted, i = accepted + a, i + a + 1
    return accepted


def run_prompts(config: ServerConfig, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list, dict]:
    """Greedy completions of every prompt on a fresh server, and its spec counters at the end."""
    start = time.monotonic()
    with VLLMServer.start(config) as server, httpx.Client() as client:
        print(f"  vLLM {server.version} ready after {time.monotonic() - start:.0f} s", flush=True)
        done = [
            complete(client, server.url, completion_body(config.served_name, ids, MAX_NEW_TOKENS)) for ids in prompt_ids
        ]
        return [c.token_ids for c in done], [c.spec or {} for c in done], spec_counters(server.url)


def serve_drafter(drafter: Eagle3Drafter, target_dir: str, prompt_ids, env) -> tuple[list[list[int]], list, dict]:
    with tempfile.TemporaryDirectory(prefix="eagle3-") as draft_dir:
        save_eagle3(drafter, Path(draft_dir))
        print(f"  checkpoint: {sorted(p.name for p in Path(draft_dir).iterdir())}", flush=True)
        spec = {"method": "eagle3", "model": draft_dir, "num_speculative_tokens": NUM_SPECULATIVE_TOKENS}
        print(f"  --speculative-config {json.dumps(spec)}", flush=True)
        config = ServerConfig(target_dir, MODEL, extra_args=tuple(server_args(spec)), env=env)
        return run_prompts(config, prompt_ids)


def report(plain, eagle, per_request, counters, expected=None) -> None:
    for i, (a, b, m) in enumerate(zip(plain, eagle, per_request, strict=True)):
        metrics = {k: m.get(k) for k in ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens")}
        if expected is not None:
            metrics["expected_accepted"] = expected[i]
        print(f"  prompt {i}: {'identical' if a == b else 'DIFFERENT'} ({len(a)} vs {len(b)} tokens) {metrics}")
    print(f"  /metrics: {json.dumps(counters)}")
    same = sum(a == b for a, b in zip(plain, eagle, strict=True))
    print(f"  token-identical: {same}/{len(plain)} prompts", flush=True)


def main() -> None:
    target = load_model(MODEL, "cpu", "float32")  # tokenizer and the converted directory only
    target_dir = model_dir(target)
    target_config = json.loads((Path(target_dir) / "config.json").read_text())
    prompt_ids = [encode_prompt(target, p) for p in PROMPTS]
    env = {"VLLM_CPU_KVCACHE_SPACE": CPU_KV_CACHE_GIB}

    print(f"plain vLLM (no speculation), target {target_dir}", flush=True)
    plain, _, _ = run_prompts(ServerConfig(target_dir, MODEL, env=env), prompt_ids)
    for prompt, ids in zip(PROMPTS, plain, strict=True):
        print(f"  {prompt!r} -> {target.tokenizer.decode(ids)!r}")

    stride = target_config["vocab_size"] // DRAFT_VOCAB
    print(f"\n1. random drafter, draft vocabulary every {stride}th target id, aux layers {AUX_LAYERS}")
    drafter = build_drafter(target_config, torch.arange(DRAFT_VOCAB) * stride)
    report(plain, *serve_drafter(drafter, target_dir, prompt_ids, env))

    token = collections.Counter(t for ids in plain for t in ids).most_common(1)[0][0]
    print(
        f"\n2. constant drafter: always {target.tokenizer.decode([token])!r} (id {token}, draft id {DRAFT_VOCAB // 2})"
    )
    expected = [expected_accepted(ids, token) for ids in plain]
    report(plain, *serve_drafter(constant_drafter(target_config, token), target_dir, prompt_ids, env), expected)


if __name__ == "__main__":
    main()
