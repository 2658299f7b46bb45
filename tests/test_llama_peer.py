"""llama.cpp as a peer: on the embedded model's shipped GGUF it decodes the same greedy tokens as
our engine (plain and with its prompt-lookup drafter), from the same prompt token ids, and sits in
the bench as a peer with its threads on the machine line; where it cannot run (llama-cpp-python
not installed, a model without a GGUF) the benchmarks skip it with one line.

The real runs need llama-cpp-python (`bash scripts/setup.sh --llama`, which .ci/run does);
skipped without it except in CI, where a missing install is a failure (tests/optional.py). They
run llama.cpp in its worker process, as the benchmarks do (tests/test_native_peers.py: its crashes)."""

import importlib.util
import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from optional import require

from mtp_viz import llama_peers
from mtp_viz.bench import load_suite, results_table, run_bench, save
from mtp_viz.labels import peer_kind
from mtp_viz.llama_peers import (
    LLAMA_CPP_AUTOREGRESSIVE,
    LLAMA_CPP_PEERS,
    LLAMA_CPP_PROMPT_LOOKUP,
    LlamaCppPeers,
    parting,
    shipped_gguf,
    unavailable,
)
from mtp_viz.loading import encode_prompt, load_model
from mtp_viz.machine import describe
from mtp_viz.prompts import BenchPrompt
from mtp_viz.quality import first_divergence
from mtp_viz.runner import RunRequest, run
from mtp_viz.strategies.base import GenerationSettings

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
MODEL = "smollm2-135m"
PROMPTS = [
    "What is the capital of France?",
    "Repeat this list exactly, twice: apples, bananas, cherries, dates, elderberries.",
    "List three colours of the rainbow.",
    "Rename the variable total to sum in this code:\ntotal = 0\nfor x in items:\n    total += x\nprint(total)",
]
MAX_NEW = 24
# Logits by which our model may prefer its own token where llama.cpp's greedy choice differs:
# their logits differ by ~0.1 (std, measured), and in the engine benchmark every first divergence
# came at a margin of at most 0.29 (docs/BENCHMARKS.md, "llama.cpp beside ours").
NEAR_TIE = 0.5
LLAMA_CPP_BATCH = 512  # llama-cpp-python's default n_batch


def pretend(monkeypatch, installed: bool) -> None:
    """llama_cpp importable or not, as far as the peers can tell."""
    real = importlib.util.find_spec
    found = object() if installed else None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: found if name == "llama_cpp" else real(name, *a))


def test_llama_cpp_rows_are_peers():
    assert {peer_kind(p) for p in LLAMA_CPP_PEERS} == {"peer (llama.cpp)"}


def test_bench_skips_llama_cpp_with_one_line_when_it_is_not_installed(use_tiny_registry, monkeypatch, caplog):
    pretend(monkeypatch, installed=False)
    prompts = load_suite("spec-bench", ["writing"], 1)
    base = RunRequest(model="tiny", generation=GenerationSettings(max_new_tokens=4))
    with caplog.at_level(logging.WARNING):
        traces, peer_runs = run_bench(prompts, ["autoregressive"], base, peers=list(LLAMA_CPP_PEERS))
    said = [r.getMessage() for r in caplog.records if "llama.cpp" in r.getMessage()]
    assert said == [f"llama.cpp peers skipped: llama-cpp-python is not installed ({llama_peers.INSTALL})"]
    assert peer_runs == {} and len(traces["autoregressive"]) == 1


def test_a_model_without_a_gguf_is_skipped_too(use_tiny_registry, monkeypatch):
    pretend(monkeypatch, installed=True)
    assert shipped_gguf("tiny") is None
    assert unavailable("tiny") == (
        "llama.cpp peers skipped: model tiny ships no GGUF here (they run on the same GGUF as ours)"
    )


def test_engine_benchmark_skips_llama_cpp_with_one_line(use_tiny_registry, monkeypatch, capsys, tmp_path):
    pretend(monkeypatch, installed=False)
    monkeypatch.setenv("MTP_VIZ_LINEAR", "fast")
    monkeypatch.setenv("MTP_VIZ_CACHE", str(tmp_path / "cache"))
    spec = importlib.util.spec_from_file_location("benchmarks_engine_llama", BENCHMARKS / "engine.py")
    engine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(engine)
    argv = ["--model", "tiny", "--prompts", "1", "--repeats", "1", "--max-new-tokens", "4"]
    monkeypatch.setattr(sys, "argv", ["engine.py", *argv, "--methods", "ours_ar,llama_cpp_ar,llama_cpp_pld"])
    assert engine.main() == 0
    out, err = capsys.readouterr()
    assert err.count("llama.cpp peers skipped") == 1 and "not installed" in err
    assert "llama.cpp" not in out  # no llama.cpp columns


@pytest.fixture(scope="module")
def smol():
    require(importlib.util.find_spec("llama_cpp") is not None, "llama-cpp-python", llama_peers.INSTALL)
    return load_model(MODEL)


@pytest.mark.slow
def test_llama_cpp_tokenizes_our_chat_prompt_to_the_same_ids(smol):
    """Both engines are handed our token ids; llama.cpp's own tokenizer of the GGUF agrees with them."""
    import llama_cpp

    vocab = llama_cpp.Llama(model_path=str(shipped_gguf(MODEL)), vocab_only=True, verbose=False)
    try:
        for prompt in PROMPTS:
            ids = encode_prompt(smol, prompt)
            text = smol.tokenizer.decode(ids)
            assert vocab.tokenize(text.encode(), add_bos=False, special=True) == ids
    finally:
        vocab.close()


@pytest.mark.slow
def test_llama_cpp_writes_our_greedy_tokens_until_a_near_tie(smol):
    """Same GGUF, same prompt ids, greedy: llama.cpp (4-bit weights, 8-bit activations) and our
    engine (fp32 on the dequantized weights) write the same tokens, plain and with llama.cpp's
    prompt-lookup drafter, or part where our model preferred its token by under NEAR_TIE logits. Where they part here
    (2-core AMD EPYC, AVX-512 build): "What is the capital of France?" at the first token, ours
    "The" by 0.08 logits over "L'" (llama.cpp's logits: "L'" by 0.09); "List three colours of the
    rainbow." at token 9, by 0.04. The other two prompts: all 24 tokens identical."""
    identical = []
    with LlamaCppPeers(list(LLAMA_CPP_PEERS), smol, torch.get_num_threads()) as peers:
        for prompt in PROMPTS:
            ours = run(RunRequest(prompt=prompt, model=MODEL, generation=GenerationSettings(max_new_tokens=MAX_NEW)))
            parted = {}
            for name in LLAMA_CPP_PEERS:
                theirs = peers.run(name, ours.prompt_token_ids, MAX_NEW)
                parted[name] = parting(
                    smol.model, ours.prompt_token_ids, ours.output_token_ids, theirs.output_token_ids
                )
                assert theirs.wall_time_s > 0
                if parted[name] is None:
                    assert theirs.output_text == ours.output_text
            for name, p in parted.items():
                assert p is None or abs(p[1]) < NEAR_TIE, (prompt, name, p)  # a near-tie, never a clear margin
            identical.append(all(p is None for p in parted.values()))
        machine = peers.machine()
    assert any(identical), "llama.cpp parted from our greedy tokens on every prompt"
    assert machine["threads"] == torch.get_num_threads() and machine["gguf"] == shipped_gguf(MODEL).name


@pytest.mark.slow
def test_llama_cpp_is_a_peer_in_our_benchmark_with_its_threads_recorded(smol, tmp_path):
    prompts = [BenchPrompt("1", "writing", PROMPTS[1])]
    base = RunRequest(model=MODEL, generation=GenerationSettings(max_new_tokens=MAX_NEW))
    traces, peer_runs = run_bench(prompts, ["prompt_lookup"], base, peers=[LLAMA_CPP_PROMPT_LOOKUP])
    table = results_table(prompts, traces, peer_runs).set_index("strategy")
    ours, theirs = traces["autoregressive"][0].output_token_ids, peer_runs[LLAMA_CPP_PROMPT_LOOKUP][0].output_token_ids
    parted = first_divergence(ours, theirs)
    assert table.loc[LLAMA_CPP_PROMPT_LOOKUP, "new_tokens"] == len(theirs) > 0
    assert table.loc[LLAMA_CPP_PROMPT_LOOKUP, "agreement"] == (1.0 if parted is None else parted / len(ours))
    assert table.loc[LLAMA_CPP_PROMPT_LOOKUP, "identical"] == (parted is None)
    save(tmp_path, prompts, traces, peer_runs)
    machine = json.loads((tmp_path / "summary.json").read_text())["machine"]
    assert machine["peers"][LLAMA_CPP_PROMPT_LOOKUP]["threads"] == torch.get_num_threads()
    line = describe(machine)
    assert "beside llama.cpp (llama-cpp-python 0.3.36, " in line and line.endswith(f"{torch.get_num_threads()} threads")
    assert LLAMA_CPP_AUTOREGRESSIVE not in peer_runs


@pytest.mark.slow
def test_prompt_lookup_runs_on_a_prompt_longer_than_llama_cpps_batch(smol):
    """llama-cpp-python sizes its logits buffer by the batch (512) unless told to keep them all,
    which its drafter needs: a longer prompt must still decode."""
    ids = encode_prompt(smol, " ".join(PROMPTS * 12))  # ~790 tokens: past the batch, and a short prefill
    assert len(ids) > LLAMA_CPP_BATCH + 64
    with LlamaCppPeers([LLAMA_CPP_PROMPT_LOOKUP], smol, torch.get_num_threads()) as peers:
        assert len(peers.run(LLAMA_CPP_PROMPT_LOOKUP, ids, 4).output_token_ids) == 4
