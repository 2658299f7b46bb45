"""The CLI: a run writes a trace; bad input exits non-zero with one clear line and no traceback."""

import json
import subprocess
import sys

import pytest
from bad_inputs import CASES
from bad_inputs import argv as corpus_argv

from mtp_viz.__main__ import main
from mtp_viz.trace import Trace


def test_run_prints_a_summary_and_writes_the_trace(use_tiny_registry, tmp_path, capsys):
    out = tmp_path / "trace.json"
    code = main(
        [
            "run",
            "--model",
            "tiny",
            "--strategy",
            "speculative",
            "--prompt",
            "the cat sat on",
            "--max-new-tokens",
            "12",
            "--num-draft-tokens",
            "3",
            "--trace-out",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "tokens/s" in printed and "acceptance" in printed and "mean accepted tokens" in printed
    trace = Trace.load(out)
    assert trace.strategy == "speculative" and trace.draft_model == "tiny-draft"
    assert trace.settings["num_draft_tokens"] == 3 and len(trace.output_token_ids) <= 12


def test_model_may_be_a_local_directory(use_tiny_registry, tmp_path, capsys):
    target = use_tiny_registry.parent / "target"
    draft = use_tiny_registry.parent / "draft"
    out = tmp_path / "t.json"
    code = main(
        [
            "run",
            "--model",
            str(target),
            "--draft",
            str(draft),
            "--strategy",
            "speculative",
            "--prompt",
            "a bird",
            "--raw",
            "--max-new-tokens",
            "6",
            "--trace-out",
            str(out),
        ]
    )
    assert code == 0
    trace = Trace.load(out)
    assert trace.model == "target" and trace.draft_model == "draft" and trace.settings["raw"] is True


def test_check_distribution_writes_samples_and_a_verdict(use_tiny_registry, tmp_path, capsys):
    out = tmp_path / "dist.json"
    code = main(
        [
            "check-distribution",
            "--model",
            "tiny",
            "--strategy",
            "speculative",
            "--prompt",
            "the dog",
            "--tokens",
            "2",
            "--samples",
            "40",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert len(result["autoregressive"]) == len(result["speculative"]) == 40
    assert all(len(s) <= 2 for s in result["speculative"])
    verdict = result["verdict"]
    tests = [*verdict["first_token_vs_exact"].values(), verdict["sequences_two_sample"]]
    assert set(verdict["first_token_vs_exact"]) == {"autoregressive", "speculative"}
    for t in tests:  # each verdict is its p-value against the significance level
        assert t["verdict"] == ("consistent" if t["p_value"] >= t["alpha"] else "different"), t
    # speculative sampling is lossless and the seeds are fixed: this run must not reject it
    assert verdict["overall"] == "consistent", verdict
    out = capsys.readouterr().out
    assert out.count("p = ") == 3 and "verdict: consistent" in out


BAD = {
    "empty prompt": (["run", "--prompt", ""], "empty"),
    "whitespace prompt": (["run", "--prompt", "  \n\t "], "empty"),
    "zero tokens": (["run", "--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
    "negative tokens": (["run", "--prompt", "hi", "--max-new-tokens", "-1"], "max_new_tokens"),
    "huge tokens": (["run", "--prompt", "hi", "--max-new-tokens", "1000000000"], "max_new_tokens"),
    "non-integer tokens": (["run", "--prompt", "hi", "--max-new-tokens", "lots"], "invalid int"),
    "unknown model": (["run", "--prompt", "hi", "--model", "gpt-9"], "unknown model"),
    "unknown strategy": (["run", "--prompt", "hi", "--strategy", "telepathy"], "unknown strategy"),
    "other vocabulary": (
        ["run", "--prompt", "hi", "--strategy", "speculative", "--draft", "tiny-other"],
        "different vocabulary",
    ),
    "negative temperature": (["run", "--prompt", "hi", "--temperature", "-1"], "temperature"),
    "nan temperature": (["run", "--prompt", "hi", "--temperature", "nan"], "temperature"),
    "top-p zero": (["run", "--prompt", "hi", "--top-p", "0"], "top_p"),
    "top-p above one": (["run", "--prompt", "hi", "--top-p", "1.5"], "top_p"),
    "negative top-k": (["run", "--prompt", "hi", "--top-k", "-3"], "top_k"),
    "zero draft tokens": (
        ["run", "--prompt", "hi", "--strategy", "speculative", "--num-draft-tokens", "0"],
        "num_draft_tokens",
    ),
    "draft tokens 1000": (
        ["run", "--prompt", "hi", "--strategy", "prompt_lookup", "--num-draft-tokens", "1000"],
        "num_draft_tokens",
    ),
    "setting of another strategy": (["run", "--prompt", "hi", "--num-draft-tokens", "3"], "no setting"),
    "no draft registered": (
        ["run", "--prompt", "hi", "--model", "tiny-draft", "--strategy", "speculative"],
        "needs a draft",
    ),
    "unwritable trace path": (
        ["run", "--prompt", "hi", "--trace-out", "/nonexistent/dir/t.json"],
        "error: No such file or directory: /nonexistent/dir/t.json",
    ),
    "unknown setting": (["run", "--prompt", "hi", "--strategy", "lookahead", "--set", "speed=11"], "no setting"),
    "setting without a value": (["run", "--prompt", "hi", "--strategy", "lookahead", "--set", "window"], "key=value"),
    "setting of the wrong type": (
        ["run", "--prompt", "hi", "--strategy", "lookahead", "--set", "window=wide"],
        "whole",
    ),
    "window zero": (["run", "--prompt", "hi", "--strategy", "lookahead", "--set", "window=0"], "window"),
    "malformed tree": (["run", "--prompt", "hi", "--strategy", "mtp_heads", "--set", "tree=0,a"], "tree"),
    "tree without its parent": (["run", "--prompt", "hi", "--strategy", "mtp_heads", "--set", "tree=00"], "parent"),
    "no heads registered": (["run", "--prompt", "hi", "--strategy", "mtp_heads"], "no MTP heads"),
    "unknown heads": (["run", "--prompt", "hi", "--strategy", "mtp_heads", "--heads", "nope"], "unknown heads"),
    "bench with unknown heads": (
        [
            "bench",
            "--categories",
            "qa",
            "--limit",
            "1",
            "--strategies",
            "mtp_heads",
            "--heads",
            "nope",
            "--out",
            "/tmp/b",
        ],
        "unknown heads",
    ),
    "bench with an unknown EAGLE-3 drafter": (
        ["bench", "--categories", "qa", "--limit", "1", "--strategies", "eagle", "--eagle3", "nope", "--out", "/tmp/b"],
        "unknown EAGLE-3 drafter",
    ),
    "bench with a malformed tree": (
        ["bench", "--categories", "qa", "--limit", "1", "--strategies", "mtp_heads:tree=0,a", "--out", "/tmp/b"],
        "tree",
    ),
    "tau above one": (["run", "--prompt", "hi", "--strategy", "conf_adapt", "--set", "tau=1.5"], "tau"),
    "k too large": (["run", "--prompt", "hi", "--strategy", "conf_adapt", "--set", "k=99"], "k must"),
    "mask tokens on a model without": (
        ["run", "--prompt", "hi", "--strategy", "conf_adapt", "--set", "predictor=mask_tokens"],
        "mask token",
    ),
    "unknown schedule": (["run", "--prompt", "hi", "--strategy", "speculative", "--set", "schedule=fast"], "schedule"),
    "exit layer past the model": (
        ["run", "--prompt", "hi", "--strategy", "self_speculative", "--set", "exit_layer=2"],
        "exit_layer",
    ),
    "greedy distribution check": (
        ["check-distribution", "--prompt", "hi", "--temperature", "0", "--out", "/tmp/x.json"],
        "temperature",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_gets_one_clear_line(case, use_tiny_registry, capsys):
    argv, expected = BAD[case]
    with pytest.raises(SystemExit) if "invalid int" in expected else _no_raise() as exit_info:
        code = main(argv)
    code = exit_info.value.code if exit_info else code
    err = capsys.readouterr().err
    assert code != 0
    assert expected in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


class _no_raise:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_bad_input_in_a_real_process(use_tiny_registry):
    proc = subprocess.run(
        [sys.executable, "-m", "mtp_viz", "run", "--prompt", " ", "--model", "tiny"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: the prompt is empty"


def test_profile_writes_a_verify_cost_curve(use_tiny_registry, tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert (
        main(
            ["profile", "--model", "tiny", "--draft", "tiny-draft", "--max-k", "4", "--repeats", "2"]
            + ["--weights", "int8", "--out", str(out)]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert result["machine"]["weights"].startswith("int8") and "int8 weight-only" in result["machine"]["linear"]
    assert list(result["verify_cost"]) == ["1", "2", "3", "4"] and result["verify_cost"]["1"] == 1.0
    assert all(v > 0 for v in result["verify_cost"].values()) and result["c"] > 0
    assert list(result["exit_agreement"]) == ["1", "2"] and result["exit_agreement"]["2"] == 1.0
    printed = capsys.readouterr().out
    assert "verify cost" in printed and "early exit after layer L" in printed and "weights int8" in printed


@pytest.mark.parametrize("name", CASES)
def test_shared_bad_input_corpus_through_the_cli(name, use_tiny_registry, tmp_path, capsys):
    """The corpus test_app.py sends through the API: a one-line message, or (odd but valid) a run."""
    case = CASES[name]
    code = main([*corpus_argv(case), "--trace-out", str(tmp_path / "t.json")])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    if case.expect is None:
        assert code == 0, captured.err
        assert Trace.from_json((tmp_path / "t.json").read_text()).prompt_token_ids
    else:
        assert code != 0 and case.expect in captured.err, captured.err
        assert len(captured.err.strip().splitlines()) == 1, captured.err
