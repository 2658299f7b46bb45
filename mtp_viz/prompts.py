"""Benchmark and example prompts: the Spec-Bench questions shipped in mtp_viz/data (see its README),
and a user's own suite file in Spec-Bench's format or one prompt a line (`read_suite`)."""

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from mtp_viz.errors import UserError

SPEC_BENCH = Path(__file__).resolve().parent / "data" / "spec_bench_questions.jsonl"
CUSTOM = "custom"  # the category of a prompt whose suite file names none
JSONL_SUFFIXES = (".jsonl", ".json")
MAX_SUITE_BYTES = 64 * 2**20
SAFE_ID = re.compile(r"[A-Za-z0-9._-]+")  # a question id names its trace files
SUITE_FORMATS = (
    'Spec-Bench\'s JSONL, one {"question_id", "category", "turns": ["prompt", ...]} a line, '
    "or plain text, one prompt a line"
)


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark question: its id and category in the suite, its first turn, and its reference's answer."""

    id: str
    category: str
    text: str
    answer: str | None = None  # the reference's final answer, where it has one (GSM8K: after "####")


@cache
def spec_bench() -> tuple[dict, ...]:
    with SPEC_BENCH.open(encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f)


def read_suite(path: Path) -> tuple[dict, ...]:
    """A user's own prompts as Spec-Bench questions ({"question_id", "category", "turns", and a
    "reference" where given}), from Spec-Bench's JSONL (a .jsonl or .json file, or one whose first
    line is a JSON object) or plain text, one prompt a line (its line number its id, its category
    "custom"). Blank lines are skipped. UserError says what is wrong, and where."""
    try:
        if path.stat().st_size > MAX_SUITE_BYTES:
            raise UserError(f"{path} is larger than {MAX_SUITE_BYTES // 2**20} MiB: not a suite of prompts")
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text; a suite is {SUITE_FORMATS}") from None
    lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not lines:
        raise UserError(f"{path} holds no prompts; a suite is {SUITE_FORMATS}")
    jsonl = path.suffix.lower() in JSONL_SUFFIXES or isinstance(_json(lines[0][1]), dict)
    questions = [_question(path, n, line) if jsonl else _plain(n, line) for n, line in lines]
    seen: set[str] = set()
    for q in questions:
        if q["question_id"] in seen:
            raise UserError(f"{path}: question_id {q['question_id']} appears twice; each question needs its own")
        seen.add(q["question_id"])
    return tuple(questions)


def _json(line: str):
    try:
        return json.loads(line)
    except ValueError:
        return None


def _plain(number: int, line: str) -> dict:
    return {"question_id": str(number), "category": CUSTOM, "turns": [line]}


def _question(path: Path, number: int, line: str) -> dict:
    """One JSONL line as a question, or UserError naming the line and what it lacks."""
    where = f"{path} line {number}"
    try:
        q = json.loads(line)
    except ValueError as e:
        raise UserError(f"{where} is not JSON ({e}); a suite is {SUITE_FORMATS}") from None
    if not isinstance(q, dict):
        raise UserError(f"{where} is not a JSON object; a suite is {SUITE_FORMATS}")
    turns = q.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns) or not turns[0].strip():
        raise UserError(f'{where}: "turns" must be a list of strings, the prompt first')
    category = q.get("category", CUSTOM)
    if not isinstance(category, str) or not category.strip():
        raise UserError(f'{where}: "category" must be a non-empty string (or left out: "{CUSTOM}")')
    qid = q.get("question_id", number)
    if isinstance(qid, bool) or not isinstance(qid, (str, int)) or not SAFE_ID.fullmatch(str(qid)):
        raise UserError(f'{where}: "question_id" must be a number or a name of letters, digits, ".", "_" and "-"')
    reference = q.get("reference")
    if reference is not None and not isinstance(reference, list):
        raise UserError(f'{where}: "reference" must be a list, one reference answer per turn')
    return {"question_id": str(qid), "category": category.strip(), "turns": turns} | (
        {"reference": reference} if reference else {}
    )


def spec_bench_prompt(question_id: int) -> str:
    """The first turn of one Spec-Bench question."""
    for q in spec_bench():
        if q["question_id"] == question_id:
            return q["turns"][0]
    raise KeyError(question_id)


CODE_EDIT_PROMPT = '''Rename the function `mean` to `average` everywhere in this code and return the whole file:

```python
def mean(values):
    """Arithmetic mean of a non-empty list."""
    total = 0.0
    for v in values:
        total += v
    return total / len(values)


def variance(values):
    m = mean(values)
    return mean([(v - m) ** 2 for v in values])


def report(values):
    print("mean:", mean(values))
    print("variance:", variance(values))
```'''
