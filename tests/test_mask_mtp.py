"""Mask-token MTP (arXiv 2602.06019) on tiny random models: the adapter view, the training's
regions and student-forced targets, `train mtp` end to end, and `mask_spec` (lossless)."""

import json
from collections import Counter

import pytest
import torch
from conftest import decode, hf_greedy, save_tiny_dir, tiny_model

from mtp_viz.__main__ import main
from mtp_viz.cache import CachedModel
from mtp_viz.drafters.mask import EVERYWHERE, MASK_ONLY, MaskSpec, adapter_parameters, load_mask_model, mask_model
from mtp_viz.errors import InvalidSettingsError, UserError
from mtp_viz.lean import lean_model
from mtp_viz.projections import StackedLoRA
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.strategies.mask_spec import MAX_K
from mtp_viz.training.data import Sequence
from mtp_viz.training.mask import (
    MaskTrainConfig,
    Region,
    fitted,
    leading_correct,
    pack,
    sample_regions,
    student_and_teacher,
    teacher_inputs,
)

V = 8  # small, so random mask guesses are sometimes right and verification both accepts and rejects
PROMPTS = ([3, 1, 5, 3, 1], [0, 1, 2, 3], [7, 7, 2], [4, 2, 6, 1, 0, 5])


def random_adapter(model, gating: str = MASK_ONLY, seed: int = 0, scale: float = 0.5):
    """A mask-token view of `model` with random (non-zero) LoRA B matrices."""
    spec = MaskSpec(
        base="tiny", vocab_size=model.config.vocab_size, hidden_size=model.config.hidden_size, rank=4, gating=gating
    )
    view = mask_model(model, spec)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in adapter_parameters(view).items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return view


@pytest.fixture(scope="module")
def peaked():
    return tiny_model("llama-2l", seed=0, vocab_size=V, initializer_range=0.4)


def test_mask_only_adapter_leaves_real_positions_untouched_and_shares_the_weights(peaked):
    lean = lean_model(peaked)
    view = random_adapter(peaked)
    ids = torch.tensor([[3, 1, 5, 3, V, V]])
    with torch.no_grad():
        base, adapted = peaked(ids[:, :4]).logits, view(ids).logits
        plain_masks = view(torch.tensor([[3, 1, 5, 3, 0, 0]])).logits
    assert torch.equal(adapted[:, :4], base)  # bit for bit: the adapter's term is gated to zero
    assert not torch.allclose(adapted[:, 4:], plain_masks[:, 4:])  # the masks read the learned row and the adapter
    assert view.model.layers[0].self_attn.q_proj.base_layer.weight is peaked.model.layers[0].self_attn.q_proj.weight
    assert type(peaked.model.layers[0].self_attn.q_proj) is not type(view.model.layers[0].self_attn.q_proj)
    # the view's lean forward fuses the same storage, and the base model's stays current
    assert lean_model(view).blocks[0].proj.qkv.weight.data_ptr() == lean.blocks[0].proj.qkv.weight.data_ptr()
    assert lean_model(peaked) is lean


def test_everywhere_gating_changes_real_positions(peaked):
    view = random_adapter(peaked, EVERYWHERE)
    ids = torch.tensor([[3, 1, 5, 3]])
    with torch.no_grad():
        assert not torch.allclose(view(ids).logits, peaked(ids).logits)


@pytest.mark.parametrize("gating", [MASK_ONLY, EVERYWHERE])
def test_lean_forward_of_a_mask_model_matches_transformers(peaked, monkeypatch, gating):
    """The lean forward stacks the adapters (two products per input) and gates them itself."""
    view = random_adapter(peaked, gating)
    seq = [3, 1, 5, 3, 1, V, V, V]
    lean, base = CachedModel(view, V), CachedModel(peaked, V)
    monkeypatch.setenv("MTP_VIZ_ENGINE", "transformers")
    plain = CachedModel(view, V)
    assert (lean.engine, plain.engine) == ("lean", "transformers")
    torch.testing.assert_close(lean.forward(seq, 4), plain.forward(seq, 4), rtol=1e-5, atol=1e-5)
    assert isinstance(lean_model(view).adapted[0].proj.qkv, StackedLoRA)
    # without masks a gated adapter adds nothing: the base model's logits, bit for bit
    lean.rollback(0)
    assert base.engine == "lean"
    assert torch.equal(lean.forward(seq[:5], 5), base.forward(seq[:5], 5)) == (gating == MASK_ONLY)


def test_saved_adapter_loads_back_identically(peaked, tmp_path):
    """It ships in float16: loaded back, it is the adapter with its weights rounded to float16, bit for bit."""
    from mtp_viz.drafters.mask import adapter_parameters, save_mask_model

    view = random_adapter(peaked)
    save_mask_model(view, tmp_path / "adapter")
    again = load_mask_model(peaked, tmp_path / "adapter")
    ids = torch.tensor([[3, 1, 5, V, V]])
    with torch.no_grad():
        before = view(ids).logits
        for p in adapter_parameters(view).values():
            p.copy_(p.half().float())
        assert not torch.equal(before, view(ids).logits)  # the rounding shows at this scale
        assert torch.equal(view(ids).logits, again(ids).logits)
    with pytest.raises(UserError, match="holds no mask-token adapter"):
        load_mask_model(peaked, tmp_path)


def _sequence(model, tokens: list[int], prompt_len: int) -> Sequence:
    t = torch.tensor(tokens, dtype=torch.int32)
    with torch.no_grad():
        argmax = model(t[None].long()).logits[0, :-1].argmax(-1).int()
    return Sequence(t, prompt_len, None, argmax, None, None)


def test_packed_regions_see_their_prefix_and_their_own_masks_only(peaked):
    seqs = [_sequence(peaked, [1, 2, 3, 4, 5, 6], 2), _sequence(peaked, [7, 6, 5, 4], 1)]
    packed = pack(seqs, [Region(0, 3, 3), Region(1, 1, 2)], max_len=100)
    assert packed.positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    assert packed.mask_positions.tolist() == [4, 5, 2]  # anchor + 1 … anchor + k − 1
    assert packed.slot.tolist() == [1, 2, 1] and packed.region.tolist() == [0, 0, 1]
    real = packed.real_allowed
    assert real[7, 6] and not real[6, 5] and not real[3, 4]  # causal within a sequence, never across
    masks = packed.mask_allowed.int().tolist()
    #            seq 0 real        seq 1 real   masks
    assert masks[0] == [1, 1, 1, 1, 0, 0] + [0, 0, 0, 0] + [1, 0, 0]
    assert masks[1] == [1, 1, 1, 1, 0, 0] + [0, 0, 0, 0] + [1, 1, 0]
    assert masks[2] == [0, 0, 0, 0, 0, 0] + [1, 1, 0, 0] + [0, 0, 1]
    # the teacher reads the model's own next token at the anchor first
    assert packed.first.tolist() == [int(seqs[0].argmax[3])] * 2 + [int(seqs[1].argmax[1])]


def test_teacher_inputs_and_leading_runs_on_a_scripted_student():
    packed = pack(
        [Sequence(torch.arange(8, dtype=torch.int32), 1, None, torch.full((7,), 9, dtype=torch.int32), None, None)],
        [Region(0, 1, 4), Region(0, 4, 3)],
        max_len=100,
    )
    student = torch.tensor([11, 12, 13, 21, 22])
    assert teacher_inputs(packed, student).tolist() == [9, 11, 12, 9, 21]  # first, then the student's own
    right = torch.tensor([True, False, True, True, True])
    assert leading_correct(packed, right).tolist() == [1, 2]


def test_a_prompt_longer_than_the_window_is_cut_at_its_start_and_leaves_answer_regions():
    """A corpus document's prompt (600 tokens) before a 100-token answer, in a 448-token window: the
    prompt's start is cut so the whole answer fits (it crashed sampling regions before); a pack
    with no region is never built."""
    n, prompt = 700, 600
    argmax = torch.arange(1, n, dtype=torch.int32)
    long = Sequence(torch.arange(n, dtype=torch.int32), prompt, None, argmax, argmax[:, None], argmax[:, None].half())
    cut = fitted(long, 448)
    assert (cut.prompt_len, len(cut.tokens)) == (348, 448) and cut.tokens[0] == 252 and cut.argmax[0] == 253
    assert fitted(cut, 448) is cut
    regions = sample_regions([cut], MaskTrainConfig(), torch.Generator().manual_seed(0))
    assert regions and all(347 <= r.anchor < 447 for r in regions)
    packed = pack([cut], regions, 448)
    assert packed.first.dtype == packed.mask_positions.dtype == torch.long
    assert pack([cut], [], 448).first.dtype == torch.long  # no region: still index tensors


@pytest.mark.parametrize("gating", [MASK_ONLY, EVERYWHERE])
def test_student_forced_targets_equal_plain_forwards(peaked, gating):
    """Packed three-pass training = for each region alone: the student reads prefix + masks; the
    teacher (the untouched model) reads prefix + the model's token + the student's tokens."""
    view = random_adapter(peaked, gating)
    seqs = [
        _sequence(peaked, [3, 1, 5, 3, 1, 0, 2, 6, 7, 1, 2, 4], 4),
        _sequence(peaked, [4, 2, 6, 1, 0, 5, 5, 1, 3], 3),
    ]
    regions = [Region(0, 5, 4), Region(0, 3, 2), Region(1, 6, 3), Region(1, 2, 4)]
    packed = pack(seqs, regions, max_len=100)
    logits, labels = student_and_teacher(view, packed, V, shared_prefix=gating == MASK_ONLY, grad=False)
    fed = teacher_inputs(packed, logits.argmax(-1))
    row = 0
    with torch.no_grad():
        for r in regions:
            prefix, w = seqs[r.seq].tokens[: r.anchor + 1].long().tolist(), r.k - 1
            alone = view(torch.tensor([prefix + [V] * w])).logits[0, -w:]
            torch.testing.assert_close(logits[row : row + w], alone, rtol=1e-4, atol=1e-4)
            teacher = peaked(torch.tensor([prefix + fed[row : row + w].tolist()])).logits[0, -w:].argmax(-1)
            assert labels[row : row + w].tolist() == teacher.tolist()
            row += w


def test_student_and_teacher_gradients_reach_only_the_adapter(peaked):
    view = random_adapter(peaked)
    for p in peaked.parameters():
        p.requires_grad_(False)
    params = adapter_parameters(view)
    for p in params.values():
        p.requires_grad_(True)
    seqs = [_sequence(peaked, [3, 1, 5, 3, 1, 0, 2, 6], 2)]
    packed = pack(seqs, [Region(0, 2, 4), Region(0, 4, 3)], max_len=100)
    logits, labels = student_and_teacher(view, packed, V, shared_prefix=True, grad=True)
    torch.nn.functional.cross_entropy(logits, labels).backward()
    assert params["mask_embedding"].grad is not None and params["mask_embedding"].grad.abs().sum() > 0
    assert all(p.grad is None for p in peaked.parameters())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`train data` + `train mtp` on a tiny model (seconds)."""
    root = tmp_path_factory.mktemp("mask-train")
    tiny = save_tiny_dir(root / "target", model_name="llama-3l-mha")
    common = ["--model", str(tiny), "--data", str(root / "data")]
    data_flags = ["--instructions", "8", "--self-instruct", "0", "--contexts", "0", "--math", "6"]
    assert main(["train", "data", *common, *data_flags, "--max-new-tokens", "12", "--batch-size", "7"]) == 0
    out = root / "adapter"
    flags = ["--out", str(out), "--steps", "4", "--k-max", "3", "--rank", "4"]
    assert main(["train", "mtp", *common, *flags]) == 0
    return tiny, common, flags, out


def test_train_mtp_writes_an_adapter_a_report_and_resumes(trained, capsys):
    tiny, common, flags, out = trained
    report = json.loads((out / "training.json").read_text())
    assert report["history"][-1]["step"] == 4 and "val_tokens_per_forward" in report["history"][-1]
    assert {"heldout_top1_mask1", "heldout_tokens_per_forward"} <= set(report["before"])  # the Spec-Bench answers
    assert report["config"]["k_max"] == 3 and report["adapter_parameters"] > 0
    spec = json.loads((out / "mask_model.json").read_text())
    assert spec["gating"] == MASK_ONLY and spec["trained_k"] == 3
    assert main(["train", "mtp", *common, *flags, "--resume"]) == 0  # already complete: resumes at the end
    assert "resumed from" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--k-max", "1"], "k_max must be at least 2"),
        (["--steps", "0"], "at least one step"),
        (["--gating", "sometimes"], "gating must be one of"),
    ],
)
def test_train_mtp_rejects_bad_settings_in_one_line(trained, tmp_path, flags, message, capsys):
    tiny, common, _, _ = trained
    assert main(["train", "mtp", *common, "--out", str(tmp_path / "a"), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_train_mtp_without_data_or_model_says_so(trained, tmp_path, capsys):
    tiny, _, _, _ = trained
    assert main(["train", "mtp", "--model", str(tiny), "--data", str(tmp_path / "none"), "--out", str(tmp_path)]) == 2
    assert "no training data in" in capsys.readouterr().err
    assert main(["train", "mtp", "--model", "no-such-model", "--out", str(tmp_path)]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_the_registry_runs_mask_strategies_on_the_registered_adapter(trained, tmp_path, monkeypatch):
    """models.yaml: a mask_adapter model with its mask_token_id, and the base's mask_model; mask
    strategies on the base run on it, the others on the base itself."""
    from mtp_viz.runner import RunRequest, run

    tiny, _, _, out = trained
    vocab = json.loads((out / "mask_model.json").read_text())["vocab_size"]
    registry = {
        "defaults": {"cpu": "t", "cuda": "t"},
        "models": [
            {"id": "t", "sources": [{"kind": "local", "path": str(tiny)}], "mask_model": "t-mask"},
            {
                "id": "t-mask",
                "sources": [{"kind": "mask_adapter", "base": "t", "path": str(out)}],
                "mask_token_id": vocab,
            },
        ],
    }
    path = tmp_path / "models.yaml"
    path.write_text(json.dumps(registry))
    monkeypatch.setenv("MTP_VIZ_MODELS", str(path))
    gen = GenerationSettings(max_new_tokens=12)
    ar = run(RunRequest(prompt="hello there", strategy="autoregressive", generation=gen))
    spec = run(RunRequest(prompt="hello there", strategy="mask_spec", generation=gen))
    conf = run(RunRequest(prompt="hello there", strategy="conf_adapt", strategy_settings={"k": 3}, generation=gen))
    assert ar.model == "t" and spec.model == conf.model == "t-mask"
    assert spec.output_token_ids == ar.output_token_ids
    assert conf.output_token_ids[0] == ar.output_token_ids[0]  # the first token is the untouched model's
    assert {d.source for s in spec.steps for d in s.drafted} <= {"mask_token"}


def test_a_wrong_mask_token_id_in_the_registry_is_one_clear_error(trained, tmp_path, monkeypatch):
    from mtp_viz.loading import load_model

    tiny, _, _, out = trained
    registry = {
        "defaults": {"cpu": "t2"},
        "models": [
            {"id": "t2", "sources": [{"kind": "local", "path": str(tiny)}]},
            {
                "id": "t2-mask",
                "sources": [{"kind": "mask_adapter", "base": "t2", "path": str(out)}],
                "mask_token_id": 3,
            },
        ],
    }
    path = tmp_path / "models.yaml"
    path.write_text(json.dumps(registry))
    monkeypatch.setenv("MTP_VIZ_MODELS", str(path))
    with pytest.raises(UserError, match="mask_token_id 3"):
        load_model("t2-mask")


@pytest.mark.parametrize("k,branches", [(2, True), (4, True), (6, True), (4, False)])
def test_mask_spec_greedy_equals_autoregressive_and_transformers(peaked, k, branches):
    view = random_adapter(peaked, seed=k)
    verdicts = Counter()
    for prompt in PROMPTS:
        ar, _ = decode(peaked, "autoregressive", prompt, GenerationSettings(max_new_tokens=30))
        out, steps = decode(
            view, "mask_spec", prompt, GenerationSettings(max_new_tokens=30), mask_token_id=V, k=k, branches=branches
        )
        assert out == ar == hf_greedy(peaked, prompt, 30)
        verdicts.update(v for s in steps for v in s.verdicts)
        for s in steps:
            blocks = len(s.drafted) + 1 if branches else 1  # one block after each position the step can end at
            assert s.target_forwards == 1 and s.extra["masks"] == blocks * (k - 1)
            assert all(d.source == "mask_token" for d in s.drafted)
            assert len(s.verdicts) == len(s.drafted) <= k - 1
    assert verdicts["accepted"] and verdicts["rejected"]  # both paths ran


@pytest.mark.parametrize("branches", [True, False])
def test_mask_spec_stops_at_eos_and_budget_inside_a_block(peaked, branches):
    view = random_adapter(peaked, seed=2)
    prompt = PROMPTS[0]
    gen = GenerationSettings(max_new_tokens=30)
    ar, _ = decode(peaked, "autoregressive", prompt, gen)
    eos = ar[7]
    ar_eos, _ = decode(peaked, "autoregressive", prompt, gen, eos=[eos])
    out, _ = decode(view, "mask_spec", prompt, gen, eos=[eos], mask_token_id=V, k=5, branches=branches)
    assert out == ar_eos and out[-1] == eos
    for budget in (1, 2, 3, 5, 9):
        gen = GenerationSettings(max_new_tokens=budget)
        out, _ = decode(view, "mask_spec", prompt, gen, mask_token_id=V, k=5, branches=branches)
        assert out == ar[:budget]


@pytest.mark.parametrize("branches", [True, False])
def test_mask_spec_trace_records_guesses_and_cropped_masks(peaked, branches):
    view = random_adapter(peaked, seed=4)
    gen = GenerationSettings(max_new_tokens=20)
    out, steps = decode(view, "mask_spec", PROMPTS[1], gen, mask_token_id=V, k=3, branches=branches)
    assert steps[0].drafted == [] and steps[0].emitted[0].origin == "autoregressive"
    assert sum(len(s.emitted) for s in steps) == len(out)
    after_rejection = drafted_after_rejection = 0
    for before, after in zip(steps, steps[1:], strict=False):
        assert [d.token_id for d in after.drafted] == before.extra["next_guesses"][: len(after.drafted)]
        assert before.extra["cropped_positions"]  # the masks at least
        if before.emitted[-1].origin == "resampled":  # a rejection
            after_rejection += 1
            if branches:  # the block after the last accepted token still drafts (the budget may cut them)
                assert len(before.extra["next_guesses"]) == 2
                drafted_after_rejection += bool(after.drafted)
            else:  # the masks' guesses assumed the rejected ones: dropped
                assert after.drafted == []
    assert after_rejection  # the case ran
    assert drafted_after_rejection or not branches


def test_mask_spec_refuses_models_without_a_mask_token_or_with_an_everywhere_adapter(peaked):
    with pytest.raises(UserError, match="needs a model with a mask token"):
        decode(peaked, "mask_spec", PROMPTS[0])
    with pytest.raises(UserError, match="mask-only adapter"):
        decode(random_adapter(peaked, EVERYWHERE), "mask_spec", PROMPTS[0], mask_token_id=V)
    for k in (1, MAX_K + 1):  # one real position and no mask drafts nothing; past MAX_K is refused
        with pytest.raises(InvalidSettingsError, match=rf"^k must be between 2 and {MAX_K}, got {k}$"):
            decode(random_adapter(peaked), "mask_spec", PROMPTS[0], mask_token_id=V, k=k)


def test_conf_adapt_on_a_mask_only_adapter_starts_every_step_with_the_models_own_token(peaked):
    view = random_adapter(peaked, seed=1)
    out, steps = decode(view, "conf_adapt", PROMPTS[0], GenerationSettings(max_new_tokens=24), mask_token_id=V, tau=0.3)
    seq = list(PROMPTS[0])
    for s in steps:
        with torch.no_grad():
            own = int(peaked(torch.tensor([seq])).logits[0, -1].argmax())
        assert s.emitted[0].token_id == own
        seq += [e.token_id for e in s.emitted]
    assert any(len(s.emitted) > 1 for s in steps)
    with pytest.raises(UserError, match="mask_layout=repeat"):
        decode(view, "conf_adapt", PROMPTS[0], mask_token_id=V, mask_layout="offset")
