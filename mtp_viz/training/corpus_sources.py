"""Where the training corpus's prompts come from: sources we can read offline, never Spec-Bench.

Each prompt names its source family and a `key`, the thing it was made from (a template's topic,
a module of the standard library, an installed package's description); the validation split is
drawn by key, so no document, module or topic is on both sides of it (mtp_viz.training.corpus).

- `templates`: the instruction templates of mtp_viz.training.prompts (its twelve categories);
- `code`: tasks over functions of the Python standard library read from this interpreter's files
  (explain, document, test, type, review, simplify);
- `documents`: extraction and summarization over the descriptions of the packages installed here
  and the standard library's module docstrings;
- `math`: word problems, mostly step by step;
- `subjects`: everyday genres (news, letters, dialogues, explanations, stories, advice, comparisons)
  about a subject drawn from the target tokenizer's common whole words, so the answers range as
  widely as the words the target knows, not over the templates' hundred topics;
- `chat`: a second turn after a first answer (made by the corpus once the first turns are answered).

Prompts that share a run of SHINGLE words with a Spec-Bench question are dropped (`Dedup`), so
the held-out set stays held out; so are exact repeats.
"""

import ast
import hashlib
import importlib.metadata
import random
import re
import sysconfig
import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from mtp_viz.prompts import spec_bench
from mtp_viz.training.prompts import TOPICS, instruction_prompts, math_prompts

SHINGLE = 8  # words in a run two prompts share before one counts as a copy of the other
CODE_TASKS = (
    "Explain what this Python function does, step by step:\n\n```python\n{code}\n```",
    "Write a clear docstring for this Python function:\n\n```python\n{code}\n```",
    "Write pytest unit tests for this Python function:\n\n```python\n{code}\n```",
    "Add type hints to this Python function and return the whole function:\n\n```python\n{code}\n```",
    "Review this Python function: what could go wrong, and how would you fix it?\n\n```python\n{code}\n```",
    "Rewrite this Python function to be simpler and easier to read:\n\n```python\n{code}\n```",
)
DOCUMENT_TASKS = (
    "Summarize the following text in three sentences.\n\n{doc}",
    "List the key points of the following text as bullet points.\n\n{doc}",
    "Extract every name of a tool, library, function or standard mentioned in this text, one per line.\n\n{doc}",
    "Write three questions that the following text answers, each with its answer.\n\n{doc}",
    "{doc}\n\nWhat is the main purpose of what this text describes, in one paragraph?",
    "Turn the following text into a short FAQ.\n\n{doc}",
)
FOLLOW_UPS = (
    "Can you make that shorter?",
    "Give me a concrete example.",
    "Explain that to a ten-year-old.",
    "What are the main caveats or exceptions?",
    "Can you put that in a table?",
    "What would be a good next step?",
    "Summarize your answer in one sentence.",
    "What is the most common mistake people make here?",
)
SUBJECT_TASKS = (
    "Write a short news article about a recent event involving {subject}.",
    "Write a letter to a friend telling them about {subject}.",
    "Write a dialogue between two people who disagree about {subject}.",
    "Explain {subject} to someone who has never heard of it.",
    "What are some interesting facts about {subject}?",
    "Write a short story in which {subject} plays an important part.",
    'What does the word "{subject}" mean? Use it in three example sentences.',
    "Give practical advice to a beginner who wants to learn about {subject}.",
    "What are the advantages and disadvantages of {subject}?",
    "Write a short poem about {subject}, then explain what it says.",
    "Write a short history of {subject}.",
    "Write a persuasive paragraph arguing that {subject} matters more than most people think.",
    "List five questions people often ask about {subject}, and answer each briefly.",
    "Pretend you are a teacher. Plan a short lesson about {subject} for a class of teenagers.",
    "Describe a typical day for someone whose job involves {subject}.",
    "Write a short product review or opinion piece about {subject}.",
)
SUBJECT_WORDS = (5, 14)  # letters in a subject word (shorter are mostly function words)
_STOPWORDS = """about above after again against along among around because before behind below beneath beside
    between beyond could during every first further however might never often other others quite rather
    really should since still their there these thing things those though three through under until
    where whether which while whose within without would always another become being cannot"""
STOPWORDS = frozenset(_STOPWORDS.split())
CODE_LINES = (6, 40)  # functions of this many lines (shorter say little, longer crowd the context)
DOC_WORDS = (80, 300)  # documents of this many words


@dataclass(frozen=True)
class CorpusPrompt:
    source: str  # templates | code | documents | math | chat | subjects
    key: str  # what it was made from: the split is drawn by it
    messages: tuple[dict, ...]  # the chat so far, ending with the user's turn

    @property
    def id(self) -> str:
        text = "\n".join(f"{m['role']}:{m['content']}" for m in self.messages)
        return hashlib.sha256(f"{self.source}\n{text}".encode()).hexdigest()[:16]

    @property
    def text(self) -> str:
        return self.messages[-1]["content"]


def user(text: str) -> tuple[dict, ...]:
    return ({"role": "user", "content": text},)


def template_prompts(n: int, seed: int) -> list[CorpusPrompt]:
    """The instruction templates; the key is the topic a prompt is about (or its own text)."""
    out = []
    for text in instruction_prompts(n, seed):
        topic = next((t for t in TOPICS if t in text), None)
        out.append(CorpusPrompt("templates", f"topic:{topic}" if topic else f"prompt:{text[:40]}", user(text)))
    return out


def stdlib_files(rng: random.Random) -> list[Path]:
    """The standard library's top-level modules (this interpreter's), in an order drawn by `rng`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))
    rng.shuffle(files)
    return files


@cache
def _functions(path: Path) -> tuple[str, ...]:
    """The sources of a file's functions of CODE_LINES lines (decorators included, dedented)."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return ()
    lines, found = text.splitlines(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if CODE_LINES[0] <= node.end_lineno - first + 1 <= CODE_LINES[1]:
                found.append(textwrap.dedent("\n".join(lines[first - 1 : node.end_lineno])))
    return tuple(found)


def code_prompts(n: int, seed: int) -> list[CorpusPrompt]:
    """n tasks over standard-library functions: modules in a drawn order, a few functions from
    each in turn (rounds over the modules until n), so one module does not dominate."""
    rng = random.Random(seed + 101)
    per_module = [(path.stem, list(fs)) for path in stdlib_files(rng) if (fs := _functions(path))]
    for _, fs in per_module:
        rng.shuffle(fs)
    out: list[CorpusPrompt] = []
    for round_ in range(max((len(fs) for _, fs in per_module), default=0)):
        for module, fs in per_module:
            if round_ < len(fs) and len(out) < n:
                task = rng.choice(CODE_TASKS).format(code=fs[round_])
                out.append(CorpusPrompt("code", f"module:{module}", user(task)))
        if len(out) >= n:
            break
    return out


@cache
def documents() -> tuple[tuple[str, str], ...]:
    """(name, text) of local documents of DOC_WORDS words: the installed packages' descriptions,
    cut to whole paragraphs, and the standard library modules' docstrings (read once a process)."""
    return tuple(_documents())


def _documents() -> Iterator[tuple[str, str]]:
    for dist in importlib.metadata.distributions():
        name = dist.metadata.get("Name") or "?"
        body = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        text = _paragraphs(re.sub(r"(?m)^\s*(\.\. |<|!\[|\[!).*$", "", str(body)))  # no directives, badges, HTML
        if text:
            yield f"package:{name.lower()}", text
    for module, code in _stdlib_module_docs():
        yield f"module:{module}", code


def _stdlib_module_docs() -> Iterator[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        text = _paragraphs(doc or "")
        if text:
            yield path.stem, text


def _paragraphs(text: str) -> str:
    """Whole paragraphs of `text` up to DOC_WORDS[1] words; '' when fewer than DOC_WORDS[0]."""
    kept, words = [], 0
    for para in re.split(r"\n\s*\n", text.strip()):
        n = len(para.split())
        if words + n > DOC_WORDS[1]:
            break
        kept.append(para.strip())
        words += n
    return "\n\n".join(kept) if words >= DOC_WORDS[0] else ""


def document_prompts(n: int, seed: int) -> list[CorpusPrompt]:
    rng = random.Random(seed + 202)
    docs = sorted(dict(documents()).items())
    rng.shuffle(docs)
    out = []
    for i in range(min(n, len(docs) * len(DOCUMENT_TASKS))):  # each document, each task in turn
        name, doc = docs[i % len(docs)]
        task = DOCUMENT_TASKS[(i // len(docs) + i % len(docs)) % len(DOCUMENT_TASKS)]  # another task a round
        out.append(CorpusPrompt("documents", name, user(task.format(doc=doc))))
    return out


def math_corpus_prompts(n: int, seed: int) -> list[CorpusPrompt]:
    return [CorpusPrompt("math", f"problem:{i % 97}", user(text)) for i, text in enumerate(math_prompts(n, seed))]


def subject_words(tokenizer: PreTrainedTokenizerBase, limit: int) -> list[str]:
    """Up to `limit` common words of `tokenizer`'s vocabulary, in id order (a BPE's early ids are
    its frequent merges): lowercase, SUBJECT_WORDS letters long, a single token after a space, used
    as a word in English prose (`prose_words`: a BPE's word pieces, e.g. "includ", are not), not a
    function word (STOPWORDS), nor ending in -ly or -ed (mostly adverbs and past participles, poor
    subjects; a few nouns, e.g. family, speed, go with them)."""
    words: dict[str, None] = {}
    english = prose_words()
    for i in range(len(tokenizer)):
        word = tokenizer.decode([i]).strip()
        if word not in english or word in STOPWORDS or word.endswith(("ly", "ed")):
            continue
        one_token = len(tokenizer.encode(f" {word}", add_special_tokens=False)) == 1
        if SUBJECT_WORDS[0] <= len(word) <= SUBJECT_WORDS[1] and one_token:
            words[word] = None
            if len(words) >= limit:
                break
    return list(words)


@cache
def prose_words() -> frozenset[str]:
    """The lowercase words of SUBJECT_WORDS letters in the standard library's docstrings and
    comments (this interpreter's): English prose we can read offline, standing in for a dictionary."""
    prose = re.compile(r'"""(.*?)"""|#([^\n]*)', re.S)
    word = re.compile(rf"(?<![\w.])[a-z]{{{SUBJECT_WORDS[0]},{SUBJECT_WORDS[1]}}}(?![\w(.])")
    words: set[str] = set()
    for path in Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for m in prose.finditer(text):
            words.update(word.findall(m.group(1) or m.group(2) or ""))
    return frozenset(words)


def subject_prompts(n: int, seed: int, words: list[str]) -> list[CorpusPrompt]:
    """n prompts, each a task of SUBJECT_TASKS about a word of `words` (each word once, in a drawn
    order, before any word is used again); the key is the word's as a topic, so a word that is also
    a template's topic (coffee, chess) is on that topic's side of the split."""
    rng = random.Random(seed + 404)
    order = list(words)
    rng.shuffle(order)
    out = []
    for i in range(min(n, len(order) * len(SUBJECT_TASKS))):
        subject = order[i % len(order)]
        text = rng.choice(SUBJECT_TASKS).format(subject=subject)
        out.append(CorpusPrompt("subjects", f"topic:{subject}", user(text)))  # a template topic's key
    return out


def follow_up(first: CorpusPrompt, answer: str, rng: random.Random) -> CorpusPrompt:
    """A second user turn after `first` was answered with `answer`: the same key (the same side of
    the split as the first turn)."""
    messages = (*first.messages, {"role": "assistant", "content": answer}, *user(rng.choice(FOLLOW_UPS)))
    return CorpusPrompt("chat", first.key, messages)


def _shingles(text: str) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + SHINGLE]) for i in range(max(0, len(words) - SHINGLE + 1))}


@dataclass
class Dedup:
    """Drops a prompt that shares a run of SHINGLE words with a held-out question (Spec-Bench's
    turns, and any `held_out` texts), or repeats one already kept."""

    held_out: Iterable[str] = ()
    seen: set[str] = field(default_factory=set)
    dropped: dict[str, int] = field(default_factory=dict)  # why → how many

    def __post_init__(self):
        texts = [t for q in spec_bench() for t in q.get("turns", ())] + list(self.held_out)
        self._held = set().union(*(_shingles(t) for t in texts)) if texts else set()

    def keep(self, prompt: CorpusPrompt) -> bool:
        if prompt.id in self.seen:
            self.dropped["repeat"] = self.dropped.get("repeat", 0) + 1
            return False
        if _shingles(prompt.text) & self._held:
            self.dropped["held-out overlap"] = self.dropped.get("held-out overlap", 0) + 1
            return False
        self.seen.add(prompt.id)
        return True
