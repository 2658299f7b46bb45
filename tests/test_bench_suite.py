"""`bench --suite FILE`: an architect's own prompts, in Spec-Bench's JSONL or one prompt a line,
selected by category and limit like Spec-Bench's; a bad file is one line saying what is wrong and
where, never a traceback; and the bench runs on them end to end (tiny models)."""

import json

import pytest

from mtp_viz.__main__ import main
from mtp_viz.bench import load_suite
from mtp_viz.errors import UserError
from mtp_viz.prompts import CUSTOM, spec_bench

QUESTIONS = [
    {"question_id": 7, "category": "support", "turns": ["How do I reset my password?", "And my username?"]},
    {"question_id": "faq-2", "category": "support", "turns": ["Where is my invoice?"]},
    {"question_id": 9, "category": "math", "turns": ["What is 6 times 7?"], "reference": ["6 * 7 = 42 #### 42"]},
    {"turns": ["A question with neither id nor category."]},
]


def write_jsonl(path, questions) -> str:
    path.write_text("\n".join(json.dumps(q) for q in questions) + "\n", encoding="utf-8")
    return str(path)


def test_a_spec_bench_jsonl_file_is_a_suite(tmp_path):
    suite = write_jsonl(tmp_path / "mine.jsonl", QUESTIONS)
    prompts = load_suite(suite)
    assert [(p.id, p.category, p.text) for p in prompts] == [
        ("7", "support", "How do I reset my password?"),  # the first turn is the prompt
        ("faq-2", "support", "Where is my invoice?"),
        ("9", "math", "What is 6 times 7?"),
        ("4", CUSTOM, "A question with neither id nor category."),  # its line number, category custom
    ]
    assert [p.answer for p in prompts] == [None, None, "42", None]  # the reference's answer after "####"
    assert [p.id for p in load_suite(suite, ["support"], limit=1)] == ["7"]
    with pytest.raises(UserError, match=r"unknown categories poetry; mine.jsonl has: custom, math, support"):
        load_suite(suite, ["poetry"])


def test_the_shipped_questions_read_as_a_suite_file_are_spec_bench(tmp_path):
    """Spec-Bench's own file, handed over as a file of one's own, gives the same prompts."""
    suite = write_jsonl(tmp_path / "spec_bench_questions.txt", spec_bench())  # detected by its first line
    assert load_suite(suite) == load_suite("spec-bench")  # every question, its reference answer included
    assert load_suite(suite, ["coding", "rag"], 2) == load_suite("spec-bench", ["coding", "rag"], 2)


def test_plain_lines_are_prompts_of_their_own_category(tmp_path):
    suite = tmp_path / "prompts.txt"
    suite.write_text(
        "Summarise this ticket: printer on fire.\n\n   \n{not json} Explain braces in C.\r\nLast one", "utf-8"
    )
    prompts = load_suite(str(suite))
    assert [(p.id, p.category, p.text) for p in prompts] == [
        ("1", CUSTOM, "Summarise this ticket: printer on fire."),
        ("4", CUSTOM, "{not json} Explain braces in C."),  # ids are line numbers; blank lines skipped
        ("5", CUSTOM, "Last one"),
    ]
    assert [p.id for p in load_suite(str(suite), [CUSTOM], limit=2)] == ["1", "4"]


@pytest.mark.parametrize(
    ("name", "content", "said"),
    [
        ("empty.txt", " \n\n", "holds no prompts"),
        ("bad.jsonl", '{"turns": ["ok"]}\n{"turns": ["missing brace"]\n', "bad.jsonl line 2 is not JSON"),
        ("list.jsonl", '["a prompt"]\n', "line 1 is not a JSON object"),
        ("noturns.jsonl", '{"question_id": 1, "category": "x"}\n', 'line 1: "turns" must be a list of strings'),
        ("emptyturn.jsonl", '{"turns": [""]}\n', '"turns" must be a list of strings, the prompt first'),
        ("cat.jsonl", '{"turns": ["a"], "category": 3}\n', '"category" must be a non-empty string'),
        ("id.jsonl", '{"turns": ["a"], "question_id": "../x"}\n', '"question_id" must be a number or a name'),
        ("twice.jsonl", '{"turns": ["a"], "question_id": 1}\n{"turns": ["b"], "question_id": 1}\n', "appears twice"),
        ("ref.jsonl", '{"turns": ["a"], "reference": "42"}\n', '"reference" must be a list'),
    ],
)
def test_a_bad_suite_file_says_what_and_where(tmp_path, name, content, said):
    (tmp_path / name).write_text(content, encoding="utf-8")
    with pytest.raises(UserError) as caught:
        load_suite(str(tmp_path / name))
    assert said in str(caught.value)


def test_bench_reports_a_bad_or_missing_suite_in_one_line(tmp_path, capsys):
    binary = tmp_path / "prompts.bin"
    binary.write_bytes(b"\xff\xfe\x00prompts")
    for suite, said in ((binary, "is not UTF-8 text"), (tmp_path / "nowhere.jsonl", "unknown suite")):
        assert main(["bench", "--suite", str(suite), "--model", "tiny", "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and said in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1


def test_bench_runs_on_ones_own_prompts(use_tiny_registry, tmp_path, capsys):
    suite = tmp_path / "traffic.txt"
    suite.write_text("the cat sat on the mat\nthe dog ran to the park\n", encoding="utf-8")
    out = tmp_path / "bench"
    argv = ["bench", "--suite", str(suite), "--model", "tiny", "--strategies", "prompt_lookup"]
    assert main([*argv, "--max-new-tokens", "4", "--out", str(out)]) == 0
    rows = json.loads((out / "summary.json").read_text())["rows"]
    assert {(r["category"], r["strategy"]) for r in rows} == {
        (c, s) for c in (CUSTOM, "overall") for s in ("autoregressive", "prompt_lookup")
    }
    assert sorted(p.name for p in (out / "traces" / "prompt_lookup").glob("*.json")) == ["1.json", "2.json"]
    assert "overall" in capsys.readouterr().out
