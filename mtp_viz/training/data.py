"""Self-distillation data: what the frozen target generates for varied prompts, with its own view
of every position, cached to disk in shards so a stopped run resumes where it left off.

For every sequence (prompt + generated answer) and every position i < len - 1 a record holds the
target's final hidden state at i (after the final norm, what the LM head reads), its argmax for
token i+1, and its top-k next-token log-probabilities: the teacher signal for the draft model
(soft labels) and for the MTP heads (hidden states in, the target's later predictions out). Prompt
positions come from the prefill forward, so the drafters also learn to read long inputs.

Round 1 answers instruction prompts built from templates (mtp_viz.training.prompts). Round 2
answers instructions the target writes itself: sampled from its chat template's empty user turn
(the pre-query template of Magpie, Xu et al. 2024), so they range over whatever the model
expects users to ask, far beyond the templates. Round 3 asks for summaries of and questions about
round-1 answers. Round 4 (off by default; the mask-token MTP model uses it) asks arithmetic word
problems, mostly step by step. Batches alternate between greedy decoding (what greedy speculative decoding meets
at test time) and sampling, for variety. No prompt is taken from Spec-Bench, the held-out set.
"""

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

from mtp_viz.errors import UserError
from mtp_viz.loading import LoadedModel, encode_prompt
from mtp_viz.prompts import spec_bench
from mtp_viz.sampling import Warp, probs_from_logits
from mtp_viz.training.prompts import context_prompts, instruction_prompts, math_prompts

ROUNDS = ("instructions", "self_instruct", "contexts", "math")
SELF_INSTRUCT_PROMPTS = "self_instruct-prompts.json"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class DataConfig:
    instructions: int = 800  # round-1 prompts (templates)
    self_instruct: int = 1200  # round-2 prompts, written by the target itself
    contexts: int = 200  # round-3 prompts, built from round-1 answers
    math: int = 0  # round-4 prompts: word problems answered step by step (mtp_viz.training.prompts)
    max_new_tokens: int = 160
    self_instruct_tokens: int = 64  # cap on a self-written instruction
    self_instruct_temperature: float = 1.0
    max_prompt_tokens: int = 768
    batch_size: int = 48
    sampled_every: int = 3  # every n-th batch samples (temperature below) instead of greedy
    temperature: float = 0.7
    teacher_top_k: int = 16
    seed: int = 0


@dataclass
class Sequence:
    tokens: torch.Tensor  # (n,) int32: prompt then answer
    prompt_len: int
    hidden: torch.Tensor | None  # (n-1, H) float16: target's final hidden state at positions 0..n-2
    argmax: torch.Tensor  # (n-1,) int32: target's argmax for the next token
    topk_ids: torch.Tensor  # (n-1, K) int32
    topk_logp: torch.Tensor  # (n-1, K) float16: log-probabilities (plain softmax, temperature 1)


@torch.inference_mode()
def generate_batch(
    target: LoadedModel, prompts: list[list[int]], cfg: DataConfig, warp: Warp, generator: torch.Generator
) -> list[Sequence]:
    """Decode a left-padded batch, keeping the teacher's view of every position."""
    model = target.model
    at = dict(device=next(model.parameters()).device)  # the target's device; the records come back on the CPU
    eos = torch.tensor(sorted(target.eos_token_ids), **at)
    b, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(b, width, dtype=torch.long, **at)
    mask = torch.zeros(b, width, dtype=torch.long, **at)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(p)
        mask[r, width - len(p) :] = 1
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    hidden = model.model(
        input_ids=ids, attention_mask=mask, position_ids=position, past_key_values=cache, use_cache=True
    ).last_hidden_state  # (B, W, H)
    # prompt positions but the last: the loop below records the last one with the answer's tokens
    rows = [
        [teacher_record(model, hidden[r, width - len(p) : -1], None, cfg.teacher_top_k)] for r, p in enumerate(prompts)
    ]
    answers: list[list[int]] = [[] for _ in prompts]
    live = torch.arange(b, **at)  # batch rows still decoding; finished rows leave the batch and the cache
    last = hidden[:, -1]  # (B, H)
    next_pos = position[:, -1] + 1  # (B,)
    for step in range(cfg.max_new_tokens):
        logits = model.lm_head(last).float()  # (b, V)
        if warp.greedy:
            token = logits.argmax(-1)
        else:
            probs = probs_from_logits(logits, warp).cpu()  # drawn by the CPU generator on any device
            token = torch.multinomial(probs, 1, generator=generator)[:, 0].to(logits.device)
        view = teacher_record(model, last, logits, cfg.teacher_top_k)
        for i, r in enumerate(live.tolist()):
            rows[r].append(tuple(x[i : i + 1] for x in view))
            answers[r].append(int(token[i]))
        keep = ~torch.isin(token, eos)
        if not keep.any() or step == cfg.max_new_tokens - 1:
            break
        if not keep.all():
            live, token, mask, next_pos = live[keep], token[keep], mask[keep], next_pos[keep]
            cache.batch_select_indices(torch.nonzero(keep).flatten())
        mask = torch.cat([mask, torch.ones(len(live), 1, dtype=torch.long, **at)], dim=1)
        last = model.model(
            input_ids=token[:, None], attention_mask=mask, position_ids=next_pos[:, None], past_key_values=cache
        ).last_hidden_state[:, -1]
        next_pos = next_pos + 1
    on_cpu = [[tuple(x.cpu() for x in part) for part in parts] for parts in rows]
    return [_sequence(p, a, on_cpu[r]) for r, (p, a) in enumerate(zip(prompts, answers, strict=True))]


def teacher_record(model, hidden: torch.Tensor, logits: torch.Tensor | None, k: int) -> tuple[torch.Tensor, ...]:
    """The teacher's record of positions with final hidden states (n, H) (logits computed if None)."""
    logp = torch.log_softmax(model.lm_head(hidden).float() if logits is None else logits, -1)  # (n, V)
    top = torch.topk(logp, k, dim=-1)
    return hidden.half(), top.indices[:, 0].int(), top.indices.int(), top.values.half()


def _sequence(prompt: list[int], answer: list[int], parts: list[tuple[torch.Tensor, ...]]) -> Sequence:
    tokens = torch.tensor(prompt + answer, dtype=torch.int32)
    hidden, argmax, topk_ids, topk_logp = (torch.cat(x) for x in zip(*parts, strict=True))
    assert len(hidden) == len(tokens) - 1  # one record per position that has a next token
    return Sequence(tokens, len(prompt), hidden, argmax, topk_ids, topk_logp)


def _batches(prompt_ids: list[list[int]], size: int) -> list[list[int]]:
    """Indices grouped by prompt length, so little of each batch is padding."""
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    return [order[i : i + size] for i in range(0, len(order), size)]


def generate(target: LoadedModel, out: Path, cfg: DataConfig | None = None, log=print) -> Path:
    """Generate (or finish generating) the data set in `out`; returns `out`. cfg None: the
    settings the folder was started with, or the defaults for a new folder."""
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / MANIFEST
    old = json.loads(manifest_path.read_text()) if manifest_path.exists() else None
    if old:  # settings added since the folder was made take their defaults
        old["config"] = asdict(DataConfig(**old["config"]))
    if cfg is None:
        cfg = DataConfig(**old["config"]) if old else DataConfig()
    manifest = {"model": target.name, "config": asdict(cfg), "rounds": {}}
    if old:
        if old["config"] != manifest["config"] or old["model"] != target.name:
            raise UserError(f"{out} holds data made with other settings; choose another --data folder")
        manifest = old
    manifest_path.write_text(json.dumps(manifest, indent=1))
    for round_name in ROUNDS:
        if round_name in manifest["rounds"]:
            continue
        prompts = _round_prompts(round_name, out, cfg, target)
        ids = [encode_prompt(target, p)[-cfg.max_prompt_tokens :] for p in prompts]
        batches = _batches(ids, cfg.batch_size)
        bar = tqdm(batches, desc=f"data: {round_name}", unit="batch")
        for n, batch in enumerate(bar):
            shard = out / f"{round_name}-{n:04d}.pt"
            if shard.exists():
                continue
            sampled = n % cfg.sampled_every == cfg.sampled_every - 1
            warp = Warp(cfg.temperature) if sampled else Warp()
            gen = torch.Generator().manual_seed(cfg.seed * 100_003 + n)
            seqs = generate_batch(target, [ids[i] for i in batch], cfg, warp, gen)
            texts = [target.tokenizer.decode(s.tokens[s.prompt_len :], skip_special_tokens=True) for s in seqs]
            tmp = shard.with_suffix(".tmp")
            torch.save({"sequences": [asdict(s) for s in seqs], "texts": texts, "sampled": sampled}, tmp)
            tmp.rename(shard)  # a shard exists only once complete
            bar.set_postfix(tokens=sum(len(s.tokens) for s in seqs))
        manifest["rounds"][round_name] = len(batches)
        manifest_path.write_text(json.dumps(manifest, indent=1))
    log(f"data ready in {out}")
    return out


def _round_prompts(round_name: str, out: Path, cfg: DataConfig, target: LoadedModel) -> list[str]:
    if round_name == "instructions":
        return instruction_prompts(cfg.instructions, cfg.seed)
    if round_name == "math":
        return math_prompts(cfg.math, cfg.seed)
    if round_name == "self_instruct":
        path = out / SELF_INSTRUCT_PROMPTS  # kept, so a resumed run answers the same prompts
        if not path.exists():
            path.write_text(json.dumps(self_instruct_prompts(target, cfg), indent=0, ensure_ascii=False))
        return json.loads(path.read_text())
    documents = [t for shard in sorted(out.glob("instructions-*.pt")) for t in torch.load(shard)["texts"]]
    return context_prompts(documents, cfg.contexts, cfg.seed)


def pre_query_ids(target: LoadedModel) -> list[int]:
    """The chat template up to where a user message's text would start (with any default system
    turn): what the model reads before it writes an instruction. Without a chat template, BOS."""
    tok = target.tokenizer
    if target.chat and tok.chat_template:
        marker = "\x00MARK\x00"
        text = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
        return tok(text[: text.index(marker)], add_special_tokens=False)["input_ids"]
    bos = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    return [bos] if bos is not None else [0]


def self_instruct_prompts(target: LoadedModel, cfg: DataConfig) -> list[str]:
    """cfg.self_instruct distinct instructions sampled from the target's empty user turn; none is a
    Spec-Bench prompt (the held-out set)."""
    if cfg.self_instruct == 0:
        return []
    held_out = {t.strip() for q in spec_bench() for t in q["turns"]}
    gen_cfg = replace(cfg, max_new_tokens=cfg.self_instruct_tokens)
    warp = Warp(cfg.self_instruct_temperature)
    prefix = pre_query_ids(target)
    found: dict[str, None] = {}
    bar = tqdm(total=cfg.self_instruct, desc="data: writing instructions", unit="prompt")
    for attempt in range(4 * cfg.self_instruct // cfg.batch_size + 4):  # duplicates are rare
        gen = torch.Generator().manual_seed(cfg.seed * 100_003 + 50_000 + attempt)
        for s in generate_batch(target, [prefix] * cfg.batch_size, gen_cfg, warp, gen):
            text = target.tokenizer.decode(s.tokens[s.prompt_len :], skip_special_tokens=True).strip()
            if text and text not in held_out and text not in found and len(found) < cfg.self_instruct:
                found[text] = None
                bar.update()
        if len(found) >= cfg.self_instruct:
            break
    bar.close()
    return list(found)


def shards(data: Path) -> list[Path]:
    manifest = json.loads((data / MANIFEST).read_text()) if (data / MANIFEST).exists() else {"rounds": {}}
    done = set(manifest["rounds"]) | {r for r in ROUNDS if not manifest.get("config", {}).get(r, 0)}
    if not set(ROUNDS) <= done:
        raise ValueError(f"{data} is incomplete; run `python -m mtp_viz train data` to finish it")
    return sorted(data.glob("*.pt"))


def load_sequences(
    data: Path, holdout_every: int = 0, holdout: bool = False, hidden: bool = True
) -> Iterator[Sequence]:
    """Every cached sequence; with holdout_every=n, only (or all but) every n-th one. hidden=False
    drops the hidden states (the draft does not need them), which saves most of the memory."""
    i = 0
    for shard in shards(data):
        for s in torch.load(shard)["sequences"]:
            if not holdout_every or ((i % holdout_every == 0) == holdout):
                yield Sequence(**{**s, "hidden": s["hidden"] if hidden else None})
            i += 1
