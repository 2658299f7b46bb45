"""`eagle` served as vLLM's EAGLE-3 by the real vLLM server, started by our code, with a random
checkpoint we write: the output is the target's greedy output (transformers' own greedy generate),
its drafts and acceptances come back in the traces, and the server is gone afterwards.

The target is a tiny random Llama in the shapes vLLM's CPU attention takes (head size 32): it starts
in about a minute where the embedded model takes four, and the checkpoint is random either way.
tests/test_vllm_server.py serves the embedded model; a file of its own, so that the suite's other
worker starts this server meanwhile.

Needs .venv-vllm (`bash scripts/setup.sh --vllm`, which .ci/run does); skipped without it except
in CI, where a missing install is a failure."""

import json
import socket
from dataclasses import replace
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from conftest import hf_greedy, make_tokenizer, running, tiny_model
from optional import require

from mtp_viz.drafters.eagle3 import Eagle3Config, Eagle3Drafter, save_eagle3
from mtp_viz.runner import RunRequest
from mtp_viz.serving.backend import open_server, plan, prompt_ids, request_body, to_trace
from mtp_viz.serving.client import complete
from mtp_viz.serving.export import model_dir
from mtp_viz.serving.server import VLLM_VENV
from mtp_viz.strategies.base import GenerationSettings

pytestmark = pytest.mark.slow

MODEL = "vllm-tiny"
# 4 layers, 2 heads of 32: the smallest Llama vLLM's CPU attention serves. Peaked weights and this
# seed give varied greedy tokens whose top two logits part by ≥ 0.02 (never a near-tie).
SHAPES = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, intermediate_size=128)
SEED, INIT = 2, 0.2
CONTEXT = 4096
AUX_LAYERS = (0, 1, 3)  # low, mid, high, as EAGLE-3 taps them
PROMPTS = ["the cat sat on the mat", "def add ( a , b ) : return a + b"]
NEW_TOKENS = 24


@pytest.fixture
def vllm_tiny(tmp_path, monkeypatch):
    """A registry of the tiny target alone; returns the target (transformers)."""
    require((VLLM_VENV / "bin" / "python").is_file(), "vLLM (.venv-vllm)", "bash scripts/setup.sh --vllm")
    tok = make_tokenizer()
    model = tiny_model("llama-2l", seed=SEED, vocab_size=len(tok), initializer_range=INIT, **SHAPES)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.config.max_position_embeddings = CONTEXT  # vLLM's server context (plan's max_model_len) must fit
    model.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    entry = {"id": MODEL, "label": "Tiny (vLLM)", "sources": [{"kind": "local", "path": "target"}]}
    registry = {"defaults": {"cpu": MODEL, "cuda": MODEL}, "models": [entry]}
    (tmp_path / "models.yaml").write_text(json.dumps(registry))  # JSON is YAML
    monkeypatch.setenv("MTP_VIZ_MODELS", str(tmp_path / "models.yaml"))
    return model


def random_eagle3(target_dir: str, aux_layer_ids: tuple[int, ...], draft_vocab: int) -> Eagle3Drafter:
    """Seeded random EAGLE-3 weights in the target's shapes, with the norm before `fc`, its draft
    vocabulary every (V / draft_vocab)-th target id."""
    c = json.loads((Path(target_dir) / "config.json").read_text())
    heads = c["num_attention_heads"]
    config = Eagle3Config(
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=c["num_key_value_heads"],
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        rms_norm_eps=c["rms_norm_eps"],
        rope_theta=(c.get("rope_parameters") or {}).get("rope_theta") or c.get("rope_theta", 10000.0),
        max_position_embeddings=c["max_position_embeddings"],
        vocab_size=c["vocab_size"],
        draft_vocab_size=draft_vocab,
        aux_layer_ids=aux_layer_ids,
        norm_before_fc=True,  # what `train eagle` gives a fresh drafter: vLLM reads it as `input_norm`
    )
    torch.manual_seed(0)
    drafter = Eagle3Drafter(config)
    targets = torch.arange(draft_vocab) * (c["vocab_size"] // draft_vocab)
    drafter.d2t.copy_(targets - torch.arange(draft_vocab))  # target id = draft id + d2t[draft id]
    drafter.t2d.zero_()[targets] = True
    return drafter


def test_eagle3_on_vllm_writes_the_greedy_output_and_reports_its_drafts(vllm_tiny, tmp_path):
    generation = GenerationSettings(max_new_tokens=NEW_TOKENS)
    plain = plan(RunRequest(model=MODEL, generation=generation))
    checkpoint = tmp_path / "eagle3"
    save_eagle3(random_eagle3(model_dir(plain.target), AUX_LAYERS, vllm_tiny.config.vocab_size // 2), checkpoint)
    eagle = plan(replace(plain.request, strategy="eagle", eagle3=str(checkpoint), strategy_settings={"depth": 3}))
    assert eagle.speculative_config == {"method": "eagle3", "model": str(checkpoint), "num_speculative_tokens": 3}
    ids = [prompt_ids(eagle, text) for text in PROMPTS]
    with open_server(eagle) as server, httpx.Client() as client:
        top = psutil.Process(server.process.pid)
        started = [top, *top.children(recursive=True)]
        done = [complete(client, server.url, request_body(eagle, i)) for i in ids]
        traces = [to_trace(eagle, server, c) for c in done]
    assert not any(running(p) for p in started), "a vLLM process outlived its server"
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) != 0, "the server's port is still taken"
    eos = vllm_tiny.generation_config.eos_token_id
    for prompt, c, trace in zip(ids, done, traces, strict=True):
        assert trace.output_token_ids == hf_greedy(vllm_tiny, prompt, NEW_TOKENS, eos)  # lossless
        steps = [s for s in trace.steps if s.drafted]
        assert steps and all(len(s.drafted) == 3 for s in steps)
        assert {d.source for s in steps for d in s.drafted} == {"eagle3"}
        assert [s.accepted for s in steps] == c.spec["per_step_accepted"]  # a random drafter: mostly 0
        assert trace.summary["drafted_tokens"] == c.spec["num_draft_tokens"]
        assert trace.machine["speculative_config"]["method"] == "eagle3" and "chain" in trace.machine["served_note"]
        assert trace.machine["vllm_mean_acceptance_length"] is not None
