"""The forward benchmark (benchmarks/forward.py, issue 40 §3) runs on a tiny model at the smallest
settings and prints every table it promises, eager alone and with the compiled engine (its cold
and warm start in processes of their own); and llama.cpp's own k-row verify timing, against the
real llama.cpp on the embedded model's GGUF, scores each new row after the same context every time.
The figures themselves mean nothing here."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from optional import require

from mtp_viz import llama_peers
from mtp_viz.errors import UserError
from mtp_viz.lean import compile_unavailable
from mtp_viz.llama_peers import LLAMA_CPP_AUTOREGRESSIVE, LlamaCppPeers
from mtp_viz.loading import encode_prompt, load_model
from mtp_viz.machine import machine_info, machine_label

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
TINY = ["--model", "tiny", "--rounds", "1", "--ks", "1,2", "--prompts", "1", "--repeats", "1", "--max-new-tokens", "4"]
EMBEDDED = "smollm2-135m"
# a prompt whose continuation llama.cpp is sure of, so that a batched row and a one-token step agree
CLEAR = "Repeat this list exactly, twice: apples, bananas, cherries, dates, elderberries."


@pytest.fixture
def forward(use_tiny_registry, monkeypatch, tmp_path):
    """benchmarks/forward.py as a module, on the tiny registry with a cache of its own."""
    monkeypatch.setenv("MTP_VIZ_LINEAR", "fast")
    monkeypatch.setenv("MTP_VIZ_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it imports its sibling engine.py
    spec = importlib.util.spec_from_file_location("benchmarks_forward", BENCHMARKS / "forward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_forward(module, monkeypatch, *argv: str) -> int:
    monkeypatch.setattr(sys, "argv", [module.__file__, *argv])
    return module.main()


def table(printed: str, title: str) -> list[str]:
    """The rows of the markdown table under the heading that starts with `title`."""
    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"### {title}"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows[2:]  # under the header and its rule


def test_eager_split_verify_and_ar_tables_name_the_machine(forward, monkeypatch, capsys, tmp_path):
    out = tmp_path / "forward.json"
    code = run_forward(forward, monkeypatch, *TINY, "--no-compiled", "--parts", "forward,ar", "--out", str(out))
    assert code == 0
    printed, err = capsys.readouterr()
    assert "llama.cpp peers skipped" in err  # the tiny model ships no GGUF: one line, no llama.cpp columns
    label = machine_label(machine_info())
    headings = [line for line in printed.splitlines() if line.startswith("### ")]
    assert len(headings) == 3 and all(f"on {label}" in h for h in headings)  # every table names machine and threads
    (split,) = table(printed, "One-token forward, split")
    cells = [c.strip() for c in split.split("|")[1:-1]]
    assert cells[0] == "ours eager" and len(cells) == 8
    assert sum(int(c.rstrip("%")) for c in cells[3::2]) in (99, 100, 101)  # shares of products, head, rest (rounded)
    (verify,) = table(printed, "k-row verify cost")
    assert verify.startswith("| ours eager |") and verify.count("x (") == 1  # k = 2, relative to one row
    ar = table(printed, "Autoregressive tokens/s")
    assert [r.split("|")[1].strip() for r in ar] == ["code-edit", "all prompts"]
    assert "llama.cpp" not in "".join(ar)
    record = json.loads(out.read_text())
    assert set(record["forward"]["split"]) == {"eager"} and set(record["forward"]["verify"]["eager"]) == {"1", "2"}
    assert all(len(v) == 1 for v in record["forward"]["split"]["eager"].values())  # one timed round
    assert record["machine"]["threads"] == torch.get_num_threads() and "start" not in record
    assert set(record["ar"]["code-edit"]["tokens_per_s"]) == {"ours_ar"}


def test_bad_options_are_one_line(forward, monkeypatch, capsys):
    for argv, said in (
        (["--parts", "forward,speed"], "--parts: unknown speed"),
        (["--ks", "1,two"], "--ks takes integers"),
        (["--ks", "0,2"], "--ks must lie in 1..64"),
    ):
        with pytest.raises(SystemExit):
            run_forward(forward, monkeypatch, *argv)
        assert said in capsys.readouterr().err


@pytest.mark.slow  # builds our kernels and compiles the tiny model's layer in a new build folder: ~2 min on 2 cores
def test_compiled_engine_cold_and_warm_start_and_its_rows(forward, monkeypatch, capsys, tmp_path):
    require(compile_unavailable(torch.device("cpu")) is None, "a C++ compiler for inductor", "apt-get install g++")
    out = tmp_path / "forward.json"
    assert run_forward(forward, monkeypatch, *TINY, "--out", str(out)) == 0
    printed = capsys.readouterr().out
    start = json.loads(out.read_text())["start"]
    assert start["cold"]["built"] is True and start["warm"]["built"] is False  # compiled once, then loaded
    assert start["warm"]["compile_s"] < start["cold"]["compile_s"]
    cold, warm = table(printed, "Compiled engine's start")
    assert cold.startswith("| cold: an empty build folder |") and "(compiled)" in cold and "(loaded)" in warm
    assert [r.split("|")[1].strip() for r in table(printed, "One-token forward, split")] == [
        "ours eager",
        "ours compiled",
    ]
    assert [r.split("|")[1].strip() for r in table(printed, "k-row verify cost")] == ["ours eager", "ours compiled"]
    (row, _) = table(printed, "Autoregressive tokens/s")
    assert row.endswith("| yes |")  # the compiled engine wrote the eager one's tokens
    record = json.loads(out.read_text())
    assert set(record["ar"]["code-edit"]["tokens_per_s"]) == {"ours_ar", "ours_ar_compiled"}


@pytest.fixture(scope="module")
def smol():
    require(importlib.util.find_spec("llama_cpp") is not None, "llama-cpp-python", llama_peers.INSTALL)
    return load_model(EMBEDDED)


@pytest.mark.slow
def test_llama_cpp_verify_scores_each_new_row_after_the_same_context(smol):
    """llama.cpp's own greedy tokens fed back as k new rows after the prompt: each row's top token
    is the next one of that greedy run, in every round and at every k, and the cache is back at the
    prompt's length after: each timed evaluation started where the first did."""
    ids = encode_prompt(smol, CLEAR)
    ks = [1, 2, 4, 8]
    with LlamaCppPeers([LLAMA_CPP_AUTOREGRESSIVE], smol, torch.get_num_threads()) as peers:
        greedy = peers.run(LLAMA_CPP_AUTOREGRESSIVE, ids, max(ks) + 1).output_token_ids
        assert len(greedy) == max(ks) + 1
        first = peers.verify_times(ids, greedy, ks, rounds=2)
        again = peers.verify_times(ids, greedy, ks, rounds=1)  # the context kept from the previous request
        with pytest.raises(UserError, match="must lie in 1..9"):
            peers.verify_times(ids, greedy, [16])
    for times in (first, again):
        assert times.n_tokens == len(ids)
        assert all(times.rows[k][: k - 1] == greedy[1:k] for k in ks), (times.rows, greedy)
    assert all(len(first.seconds[k]) == 2 and min(first.seconds[k]) > 0 for k in ks)
