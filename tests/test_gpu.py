"""On a CUDA device: the engine stays lossless and its clock measures the work, not the launch."""

import pytest
import torch
from conftest import OracleHeads, decode, hf_greedy, perturbed, tiny_model
from test_mask_mtp import V, random_adapter

from mtp_viz.clock import Clock
from mtp_viz.lean import MIN_CAPACITY, lean_model
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.strategies.mtp_heads import DEFAULT_TREE

pytestmark = pytest.mark.gpu
PROMPT = [5, 17, 3, 42, 9, 17, 3]
MASK_PROMPT = [3, 1, 5, 3, 1]  # ids below V, the mask model's vocabulary


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_identity_on_cuda(dtype, compiled):
    """Every lossless strategy equals our autoregressive decoding on the lean forward, eager and
    compiled (CUDA graphs), and in float32 transformers' generate too (in bfloat16 another kernel
    order may legitimately break a near-tie differently)."""
    model = tiny_model("llama-2l", seed=0).to("cuda", dtype)
    draft = perturbed(tiny_model("llama-2l", seed=0), 0.2).to("cuda", dtype)
    leans = [lean_model(model), lean_model(draft)]
    if compiled:
        assert all(lean.compile() > 0 for lean in leans)
    try:
        generation = GenerationSettings(max_new_tokens=40)
        reference, _ = decode(model, "autoregressive", PROMPT, generation)
        if dtype == torch.float32:
            assert reference == hf_greedy(model, PROMPT, 40)
        heads = OracleHeads(model, PROMPT, reference)
        for strategy, kw in (
            ("speculative", {"num_draft_tokens": 4}),
            ("prompt_lookup", {}),
            ("lookahead", {}),
            ("self_speculative", {"exit_layer": 1}),
            ("mtp_heads", {}),
        ):
            out, _ = decode(model, strategy, PROMPT, generation, draft=draft, heads=heads, **kw)
            assert out == reference, strategy
        assert all(lean.compiled for lean in leans) == compiled  # no CUDA graph fell back to eager
    finally:
        for lean in leans:
            lean.decompile()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_across_kv_growth(dtype):
    """Decoding past the KV cache's initial capacity with CUDA graphs: the cache is reallocated
    (doubling) under graphs recorded against the old one. Every strategy equals compiled
    autoregressive decoding, the graphs never fell back to eager, and in float32 compiled equals
    eager. (In bfloat16 the compiled kernels keep other intermediates than eager's, fused in float32:
    on a CPU the two part at a 0.05-logit gap, 1.5 bfloat16 steps; lossless means on one backend.)"""
    generation = GenerationSettings(max_new_tokens=MIN_CAPACITY + 16)
    model = tiny_model("llama-2l", seed=1).to("cuda", dtype)
    draft = perturbed(tiny_model("llama-2l", seed=1), 0.2).to("cuda", dtype)
    peaked = tiny_model("llama-2l", seed=0, vocab_size=V, initializer_range=0.4)
    view = random_adapter(peaked).to("cuda", dtype)  # moves the base weights it shares with peaked
    peaked.to("cuda", dtype)
    eager, eager_steps = decode(model, "autoregressive", PROMPT, generation)
    eager_masks, _ = decode(peaked, "autoregressive", MASK_PROMPT, generation)
    assert max(s.kv_len for s in eager_steps) > MIN_CAPACITY
    leans = [lean_model(m) for m in (model, draft, view, peaked)]
    assert all(lean.compile() >= 0 for lean in leans)
    try:
        reference, steps = decode(model, "autoregressive", PROMPT, generation)
        masks_reference, _ = decode(peaked, "autoregressive", MASK_PROMPT, generation)
        heads = OracleHeads(model, PROMPT, reference)
        runs = {
            "speculative": decode(model, "speculative", PROMPT, generation, draft=draft, num_draft_tokens=4)[0],
            "mtp_heads": decode(model, "mtp_heads", PROMPT, generation, heads=heads)[0],
            "mtp_heads tree": decode(model, "mtp_heads", PROMPT, generation, heads=heads, tree=DEFAULT_TREE)[0],
        }
        mask_spec, _ = decode(view, "mask_spec", MASK_PROMPT, generation, mask_token_id=V, k=3)
        assert all(lean.compiled for lean in leans), "a CUDA graph failed and the forward fell back to eager"
    finally:
        for lean in leans:
            lean.decompile()
    assert max(s.kv_len for s in steps) > MIN_CAPACITY
    for name, out in runs.items():
        assert out == reference, name
    assert mask_spec == masks_reference
    if dtype == torch.float32:
        assert reference == eager and masks_reference == eager_masks


def test_cuda_clock_waits_for_the_kernels():
    x = torch.randn(4096, 4096, device="cuda")
    clock = Clock("cuda")
    start = clock.now()
    for _ in range(20):
        x = x @ x
        x = x / x.norm()
    measured = clock.now() - start
    events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    events[0].record()
    for _ in range(20):
        x = x @ x
        x = x / x.norm()
    events[1].record()
    torch.cuda.synchronize()
    assert measured >= 0.5 * events[0].elapsed_time(events[1]) / 1000


def test_eagle3_trains_on_cuda_as_on_the_cpu(tiny_corpus, tmp_path):
    """The EAGLE-3 trainer is device-agnostic (issue 41 §2): with the target on CUDA (--device cuda)
    a run from a corpus answers the held-out prompts there (first, so the CPU run reads them
    cached), collates on the CPU and trains on the device; its first validation is the CPU run's
    (the same drafter, labels and features, up to float rounding), and its weights load on the CPU."""
    import json

    from mtp_viz.cli import main
    from mtp_viz.drafters.eagle3 import load_eagle3

    reports = {}
    for device in ("cuda", "cpu"):
        out = tmp_path / device
        args = ["train", "eagle", "--model", "tiny", "--data", str(tiny_corpus), "--out", str(out), "--vocab", "20"]
        assert main([*args, "--device", device, "--ttt-steps", "2", "--epochs", "1", "--heldout", "1"]) == 0
        reports[device] = json.loads((out / "training.json").read_text())
    cpu, cuda = reports["cpu"]["before"], reports["cuda"]["before"]
    assert "heldout_top1_step1" in cuda and cpu.keys() == cuda.keys()
    assert all(abs(cpu[k] - cuda[k]) < 0.05 for k in cpu)
    assert reports["cuda"]["history"][-1]["train_loss"] > 0
    drafter = load_eagle3(tmp_path / "cuda")
    assert drafter.lm_head.weight.device.type == "cpu"
