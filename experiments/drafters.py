"""How well the shipped drafters of the embedded model agree with it, beyond their training data
(the figures of docs/training.md that are not from `bench`):

    .venv/bin/python experiments/drafters.py [--held-out 6] [--categories 8]

1. Held-out prompts of the training prompts' own generator (`instruction_prompts` indices
   1200-1205, which training did not use): greedy decoding with the real strategies, 48 new
   tokens; draft acceptance with 4 drafts and tokens per target forward, trained vs untrained;
   heads chain of 3, tokens per target forward, trained vs untrained.
2. Is the reduced vocabulary what holds them back? Teacher-forced on the target's greedy answers
   (64 tokens) to the first prompt of 8 Spec-Bench categories: top-1 agreement of the draft and
   of the heads (depth 1) when scored with their reduced head and with the target's full head.

Produced, in docs/training.md: "What they measured", table 2 (part 1) and the reduced-vs-full
head figures under "Why, and what would close the gap" (part 2), both with the stage-1 weights
(2026-12-03 morning); and the "teacher-forced top-1 on Spec-Bench answers" rows of the stage-2
table (part 2, stage 2: the weights shipped now, so a run today gives that column). Smaller
`--held-out` / `--categories` only try it quickly.
"""

import argparse
import sys
from pathlib import Path

import torch

from mtp_viz.drafters.draft import build_draft, read_spec
from mtp_viz.drafters.heads import HeadsSpec, build_heads
from mtp_viz.loading import encode_prompt, load_heads_for, load_model, quiet_transformers
from mtp_viz.prompts import spec_bench
from mtp_viz.registry import load_registry
from mtp_viz.runner import RunRequest, run
from mtp_viz.sampling import Warp
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.training.data import DataConfig, generate_batch
from mtp_viz.training.prompts import instruction_prompts

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import decode  # noqa: E402  the tests' direct strategy driver

MODEL, DRAFT = "smollm2-135m", "smollm2-135m-draft"
HELD_OUT_FROM = 1200  # instruction_prompts' first index that training did not use


def rates(target, prompt_ids, strategy, **kw) -> tuple[float, float]:
    """(accepted / drafted, new tokens per target forward) over 48 greedy tokens."""
    _, steps = decode(target, strategy, prompt_ids, GenerationSettings(max_new_tokens=48), **kw)
    drafted = sum(len(s.drafted) for s in steps)
    return sum(s.accepted for s in steps) / max(1, drafted), sum(len(s.emitted) for s in steps) / len(steps)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--held-out", type=int, default=6, help="part 1: prompts (indices 1200 on)")
    parser.add_argument("--categories", type=int, default=8, help="part 2: Spec-Bench categories (first prompt each)")
    args = parser.parse_args()
    quiet_transformers()
    target, draft = load_model(MODEL), load_model(DRAFT)
    _, heads = load_heads_for(target)
    spec = read_spec(Path(load_registry().models[DRAFT].sources[0].path))
    untrained = build_draft(target.model, spec.init_layers, draft.model.lm_head.ids)
    fresh = build_heads(target.model, HeadsSpec(**heads.spec.__dict__), heads.head.ids)

    trained_set = set(instruction_prompts(DataConfig().instructions))
    print("1. held-out prompts of the training generator (48 greedy tokens)")
    print("   draft acc (untrained) | draft tok/fwd | heads chain-3 tok/fwd (untrained) | prompt")
    for prompt in instruction_prompts(HELD_OUT_FROM + args.held_out)[HELD_OUT_FROM:]:
        assert prompt not in trained_set
        ids = run(RunRequest(prompt=prompt, model=MODEL, generation=GenerationSettings(max_new_tokens=1)))
        ids = ids.prompt_token_ids
        d_acc, d_tok = rates(target.model, ids, "speculative", draft=draft.model, num_draft_tokens=4)
        u_acc, _ = rates(target.model, ids, "speculative", draft=untrained, num_draft_tokens=4)
        _, h_tok = rates(target.model, ids, "mtp_heads", heads=heads, tree="chain", num_guesses=3)
        _, f_tok = rates(target.model, ids, "mtp_heads", heads=fresh, tree="chain", num_guesses=3)
        print(f"   {d_acc:.2f} ({u_acc:.2f}) | {d_tok:.2f} | {h_tok:.2f} ({f_tok:.2f}) | {prompt[:60]}")

    firsts: dict[str, str] = {}
    for q in spec_bench():
        firsts.setdefault(q["category"], q["turns"][0])
    prompts = [encode_prompt(target, p) for p in list(firsts.values())[: args.categories]]
    seqs = generate_batch(target, prompts, DataConfig(max_new_tokens=64), Warp(), torch.Generator().manual_seed(0))
    full_head = target.model.lm_head.weight
    counts = {k: [0, 0] for k in ("draft reduced", "draft full", "heads reduced", "heads full")}
    for s in seqs:
        ids, n = s.tokens[None].long(), s.prompt_len
        hidden = target.model.model(ids).last_hidden_state[0]
        choice = target.model.lm_head(hidden).argmax(-1)  # the target's next token at each position
        d_hidden = draft.model.model(ids).last_hidden_state[0]
        answer = slice(n - 1, ids.shape[1] - 1)
        for key, guess in (
            ("draft reduced", draft.model.lm_head(d_hidden).argmax(-1)),
            ("draft full", (d_hidden @ full_head.T).argmax(-1)),
        ):
            counts[key][0] += int((guess[answer] == choice[answer]).sum())
            counts[key][1] += len(choice[answer])
        predicted = heads.step(hidden[:-2], ids[0, 1:-1])  # from h_t and x_{t+1}: the state at t+1
        later = choice[1:-1]
        for key, guess in (
            ("heads reduced", heads.logits(predicted).argmax(-1)),
            ("heads full", (predicted @ full_head.T).argmax(-1)),
        ):
            counts[key][0] += int((guess[n - 2 :] == later[n - 2 :]).sum())
            counts[key][1] += len(later[n - 2 :])
    print(f"2. teacher-forced top-1 agreement on Spec-Bench answers ({len(prompts)} categories, 64 tokens)")
    for key, (same, total) in counts.items():
        print(f"   {key}: {same / total:.3f} ({total} positions)")


if __name__ == "__main__":
    main()
