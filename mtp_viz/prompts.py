"""Benchmark and example prompts: the Spec-Bench questions shipped in mtp_viz/data (see its README)."""

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

SPEC_BENCH = Path(__file__).resolve().parent / "data" / "spec_bench_questions.jsonl"


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
