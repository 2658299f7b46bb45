"""The trained draft, MTP heads and EAGLE-3 drafter shipped for the embedded model: they load through the registry,
have the right shapes, and on a fixed held-out prompt agree with the target clearly more often than
untrained drafters of the same architecture.

The prompt comes from the training prompts' generator but was not among the training prompts
(checked below). Measured on it (48 greedy tokens): draft acceptance 0.23 with 4 drafts (untrained
0.0); heads chain of 3: 1.85 tokens per target forward (untrained, randomly initialised: about
1.0). The thresholds sit well below those values; docs/training.md has the held-out Spec-Bench figures."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import RECORDED_CHOICE, decode, recorded_weight_choice

from mtp_viz import weights_auto
from mtp_viz.drafters import mask
from mtp_viz.drafters.draft import build_draft, read_spec
from mtp_viz.drafters.heads import HeadsSpec, build_heads
from mtp_viz.kernels import stock_linears
from mtp_viz.loading import load_eagle3_for, load_heads_for, load_model
from mtp_viz.prompts import spec_bench
from mtp_viz.registry import load_registry
from mtp_viz.runner import RunRequest, run
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.training.data import DataConfig, pre_query_ids
from mtp_viz.training.draft import DraftTrainConfig, scored_batches
from mtp_viz.training.draft import agreement as draft_agreement
from mtp_viz.training.eagle import EagleTrainConfig, agreement, build_drafter, sequence_examples
from mtp_viz.training.heads import agreement as heads_agreement
from mtp_viz.training.heads import positions as heads_positions
from mtp_viz.training.heldout import spec_bench_heldout, spec_bench_prompts
from mtp_viz.training.mask import MaskTrainConfig, fitted, validate, validation_packs
from mtp_viz.training.prompts import instruction_prompts, math_prompts
from mtp_viz.weights import AUTO, FP32

pytestmark = pytest.mark.slow
MODEL, DRAFT, HEADS, MASK = "smollm2-135m", "smollm2-135m-draft", "smollm2-135m-mtp", "smollm2-135m-mask"
EAGLE3 = "smollm2-135m-eagle3"
PROMPT = "A shop sells 15 apples every day. How many apples does it sell in 15 days?"
TOKENS = 48
SELF_INSTRUCT = Path(__file__).resolve().parent.parent / "docs" / "results" / "smollm2-135m-self-instruct-prompts.json"


@pytest.fixture(scope="module")
def target():
    return load_model(MODEL)


def ids_of(prompt: str) -> list[int]:
    """The prompt's token ids as a run of the embedded model sees them (its chat template)."""
    return run(RunRequest(prompt=prompt, model=MODEL, generation=GenerationSettings(max_new_tokens=1))).prompt_token_ids


def acceptance(target, prompt_ids, strategy, **kw):
    _, steps = decode(target.model, strategy, prompt_ids, GenerationSettings(max_new_tokens=TOKENS), **kw)
    drafted = sum(len(s.drafted) for s in steps)
    return sum(s.accepted for s in steps) / drafted, sum(len(s.emitted) for s in steps) / len(steps)


def test_the_prompt_was_held_out_of_training():
    # stage 1 of the shipped weights used the first 1,200 template prompts, stage 2 the first 800
    assert PROMPT in instruction_prompts(1210) and PROMPT not in instruction_prompts(1200)
    written = json.loads(SELF_INSTRUCT.read_text())  # the instructions the target wrote for training
    assert len(written) == DataConfig().self_instruct and PROMPT not in written
    assert not {t for q in spec_bench() for t in q["turns"]} & set(written)  # Spec-Bench stays held out


def test_self_written_instructions_start_from_the_empty_user_turn(target):
    text = target.tokenizer.decode(pre_query_ids(target))
    assert text.endswith("<|im_start|>user\n") and text.startswith("<|im_start|>system")


def test_registry_names_the_trained_drafters():
    entry = load_registry().models[MODEL]
    assert entry.drafts[0] == DRAFT and entry.heads[0] == HEADS


def test_shipped_draft_loads_and_beats_an_untrained_one(target, unseen_ids):
    """Trained further on the corpus, which holds PROMPT, so judged on unseen_ids."""
    prompt_ids = unseen_ids
    draft = load_model(DRAFT)
    assert draft.source.startswith("trained_draft:")
    spec = read_spec(Path(load_registry().models[DRAFT].sources[0].path))
    assert len(draft.model.model.layers) == len(spec.init_layers) < target.model.config.num_hidden_layers
    assert draft.model.lm_head.ids.numel() == spec.reduced_vocab
    with torch.no_grad():
        logits = draft.model(torch.tensor([prompt_ids])).logits
    assert logits.shape == (1, len(prompt_ids), target.model.config.vocab_size)
    trained, _ = acceptance(target, prompt_ids, "speculative", draft=draft.model, num_draft_tokens=4)
    untrained_model = build_draft(target.model, spec.init_layers, draft.model.lm_head.ids)
    untrained, _ = acceptance(target, prompt_ids, "speculative", draft=untrained_model, num_draft_tokens=4)
    assert trained > 0.1 and trained > untrained + 0.08, (trained, untrained)


@pytest.fixture(scope="module")
def unseen_ids():
    """Spec-Bench's 4th math question, for the drafters trained further on the corpus, which holds
    PROMPT: the corpus drops every prompt that overlaps Spec-Bench, and this one is not in the
    held-out set the trainers validate on either."""
    question = [q for q in spec_bench() if q["category"] == "math"][3]["turns"][0]
    assert question not in spec_bench_prompts()
    return ids_of(question)


def test_shipped_heads_load_and_beat_untrained_ones(target, unseen_ids):
    """Trained further on the corpus, so judged on a prompt it did not see (unseen_ids). Measured
    on it (48 greedy tokens): a chain of 3 keeps 1.55 tokens per target forward, untrained heads
    1.0. The heads shipped before kept 1.66 here: one prompt's 48 tokens; on the 39 held-out
    answers below, and on 39 more nothing was chosen on, the new ones lead (docs/training.md)."""
    prompt_ids = unseen_ids
    name, heads = load_heads_for(target)
    assert name == HEADS
    h = torch.randn(2, target.model.config.hidden_size)
    nxt = heads.step(h, torch.tensor([5, 6]))
    assert nxt.shape == h.shape and heads.logits(nxt).shape == (2, target.model.config.vocab_size)
    _, trained = acceptance(target, prompt_ids, "mtp_heads", heads=heads, tree="chain", num_guesses=3)
    fresh = build_heads(target.model, HeadsSpec(**{**heads.spec.__dict__}), heads.head.ids)
    _, untrained = acceptance(target, prompt_ids, "mtp_heads", heads=fresh, tree="chain", num_guesses=3)
    assert trained > 1.4 and trained > untrained + 0.3, (trained, untrained)  # tokens per target forward


# A word problem from the mask-token model's training generator that it did not train on (the
# data step used the first 500), answered step by step.
MASK_PROMPT = (
    "A class of 40 students goes on a trip. Each bus holds 11 students. How many buses are needed?"
    " Solve it step by step."
)


def test_the_mask_prompt_was_held_out_of_training():
    assert MASK_PROMPT in math_prompts(510) and MASK_PROMPT not in math_prompts(500)
    assert MASK_PROMPT not in instruction_prompts(300) and MASK_PROMPT not in {
        t for q in spec_bench() for t in q["turns"]
    }


def test_shipped_mask_adapter_loads_through_the_registry_and_beats_an_untrained_one(target):
    """The embedded model's mask-token MTP model: a view of the same weights plus a LoRA adapter
    of about 10 MB (float16); mask_spec on it stays lossless and drafts clearly better than an untrained adapter."""
    assert load_registry().models[MODEL].mask_model == MASK
    loaded = load_model(MASK)
    assert loaded.source.startswith("mask_adapter:") and loaded.tokenizer is target.tokenizer
    path = Path(load_registry().models[MASK].sources[0].path)
    assert (path / mask.WEIGHTS_FILE).stat().st_size <= 12 * 2**20  # the tree a GPU call carries is 64 MiB
    spec = mask.read_spec(path)
    assert spec.gating == mask.MASK_ONLY and load_registry().models[MASK].mask_token_id == spec.mask_token_id
    ids = run(
        RunRequest(prompt=MASK_PROMPT, model=MODEL, generation=GenerationSettings(max_new_tokens=1))
    ).prompt_token_ids
    gen = GenerationSettings(max_new_tokens=TOKENS)
    ar, _ = decode(target.model, "autoregressive", ids, gen)
    mask_id = spec.mask_token_id

    def tokens_per_forward(model):
        out, steps = decode(model, "mask_spec", ids, gen, mask_token_id=mask_id, k=4)
        assert out == ar  # lossless, whatever the adapter
        return len(out) / len(steps)

    trained = tokens_per_forward(loaded.model)
    untrained = tokens_per_forward(mask.mask_model(target.model, spec))
    assert trained > 1.2 and trained > untrained + 0.15, (trained, untrained)


def test_shipped_eagle3_drafter_loads_and_beats_an_untrained_one(target, unseen_ids):
    """It was trained further on the corpus, so it is judged on unseen_ids. Measured on it (48
    greedy tokens): a chain of 3 keeps 1.66 tokens per target forward (the drafter shipped before,
    1.60), an untrained drafter of the same shapes about 1.0."""
    prompt_ids = unseen_ids
    assert load_registry().models[MODEL].eagle3[0] == EAGLE3
    name, drafter = load_eagle3_for(target)
    assert name == EAGLE3 and drafter.config.aux_layer_ids == (2, 15, 27)
    assert drafter.embed_tokens is target.model.get_input_embeddings()  # shared, not shipped
    _, trained = acceptance(target, prompt_ids, "eagle", eagle3=drafter, depth=3)
    vocab = drafter.to_target_ids(torch.arange(drafter.config.draft_vocab_size))
    fresh = build_drafter(target.model, drafter.config.aux_layer_ids, vocab).eval()
    _, untrained = acceptance(target, prompt_ids, "eagle", eagle3=fresh, depth=3)
    assert trained > 1.4 and trained > untrained + 0.3, (trained, untrained)  # tokens per target forward


@pytest.mark.parametrize("weights", [FP32, AUTO])
def test_eagle_with_the_shipped_drafter_is_autoregressive_decoding(weights):
    """Greedy, on the embedded model in fp32 and in the weights `auto` picks: a chain and a dynamic
    tree emit exactly the autoregressive tokens. For auto the suite reads the choice recorded on the
    project's machine (conftest.RECORDED_CHOICE: q4) and runs in its format; measuring a choice is
    tests/test_weights_auto.py's."""
    runs_in, why = weights, None
    if weights == AUTO:
        runs_in = RECORDED_CHOICE
        why = weights_auto.describe_record(recorded_weight_choice())
    generation = GenerationSettings(max_new_tokens=TOKENS)
    base = RunRequest(prompt=PROMPT, model=MODEL, generation=generation, weights=weights)
    reference = run(base)
    assert reference.machine["weights"].split()[0] == runs_in
    assert reference.machine.get("weights_choice") == why  # auto: the recorded choice, read, not measured again
    for settings in ({"depth": 3}, {"draft_tree": "dynamic", "depth": 3, "branching": 2, "nodes": 4}):
        trace = run(replace(base, strategy="eagle", strategy_settings=settings))
        assert trace.output_token_ids == reference.output_token_ids, settings
        assert trace.draft_model == EAGLE3 and trace.summary["mean_accepted_tokens"] > 1.5


def test_shipped_eagle3_drafter_holds_its_floor_on_the_heldout_spec_bench_answers(target):
    """Training-style agreement (teacher-forced, answer positions, a token outside the draft
    vocabulary a miss) on the fixed held-out set every drafter is judged on: the target's answers
    to 3 Spec-Bench prompts a category, 96 tokens (mtp_viz.training.heldout). Measured: step 1 / 2 /
    3 0.293 / 0.238 / 0.223 and 1.42 tokens per forward for a chain of 3 for the first drafter
    shipped; 0.316 / 0.264 / 0.237 and 1.46 for the one trained further on the corpus; 0.329 /
    0.272 / 0.252 and 1.50 for that one trained 400 more steps on the store's 1,200-sequence share
    (docs/training.md); a drafter that ships must not fall below the floors (raise them with it)."""
    _, drafter = load_eagle3_for(target)
    seqs = spec_bench_heldout(target)
    assert len(seqs) == 3 * len({q["category"] for q in spec_bench()})
    cfg = EagleTrainConfig()
    exs = sequence_examples(target.model, seqs, drafter.config.aux_layer_ids, drafter.to_draft_index(), cfg)
    got = agreement(drafter, exs, 3)
    print(got)
    assert got["val_top1_step1"] >= 0.32 and got["val_top1_step3"] >= 0.245, got
    assert got["val_mean_accepted_tokens"] >= 1.48, got


def test_shipped_heads_hold_their_floor_on_the_heldout_spec_bench_answers(target):
    """Teacher-forced agreement per depth on the same held-out set as the EAGLE-3 drafter's floor
    (each depth's guess from the heads' own previous guesses, answer positions). Measured: depth 1 /
    2 / 3 / 4 0.326 / 0.288 / 0.278 / 0.270 and 1.51 tokens per forward for the heads shipped
    first; 0.349 / 0.307 / 0.304 / 0.288 and 1.57 for the ones trained further on the corpus
    (docs/training.md). A shipped set must not fall below the floors (raise them with it)."""
    _, heads = load_heads_for(target)
    with torch.no_grad():
        data = heads_positions(spec_bench_heldout(target), heads.head.index.cpu(), heads.spec.trained_depth)
        got = heads_agreement(heads.eval(), data, heads.spec.trained_depth)
    assert got["val_top1_depth1"] >= 0.34 and got["val_top1_depth4"] >= 0.28, got
    assert got["val_mean_accepted_tokens"] >= 1.55, got


def test_shipped_mask_adapter_holds_its_floor_on_the_heldout_spec_bench_answers(target):
    """Training-style validation (regions of 1 + 3 masks at every 3rd answer position, a region's
    run of correct predictions counted) on the same held-out set. Measured: 0.391 / 0.194 / 0.117
    top-1 at masks 1 / 2 / 3 and 1.55 tokens per forward for the adapter shipped first; 0.416 /
    0.198 / 0.136 and 1.60 for the one trained further on the corpus (docs/training.md)."""
    view = mask.load_mask_model(target.model, Path(load_registry().models[MASK].sources[0].path)).eval()
    cfg = MaskTrainConfig()
    packs = validation_packs([fitted(s, cfg.max_len) for s in spec_bench_heldout(target)], cfg)
    with stock_linears(view), torch.no_grad():
        got = validate(view, packs, view.mtp_mask_spec.mask_token_id, view.mtp_mask_spec.gating == mask.MASK_ONLY)
    assert got["val_top1_mask1"] >= 0.41 and got["val_tokens_per_forward"] >= 1.59, got


def test_shipped_draft_holds_its_floor_on_the_heldout_spec_bench_answers(target):
    """Top-1 agreement with the target's greedy choice at answer positions (teacher-forced, as its
    trainer validates) on the same held-out set as the other drafters' floors. Measured: 0.269 for
    the draft shipped first, 0.272 for the one trained further on the corpus (docs/training.md). A
    shipped draft must not fall below the floor (raise it with a better one)."""
    draft = load_model(DRAFT).model.eval()
    batches = scored_batches(spec_bench_heldout(target), draft.lm_head.index.cpu(), DraftTrainConfig().tokens_per_batch)
    with torch.no_grad():
        got = draft_agreement(draft, batches)
    assert got["val_agreement"] >= 0.27, got
