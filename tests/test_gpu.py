"""On a CUDA device: the engine stays lossless and its clock measures the work, not the launch."""

import pytest
import torch
from conftest import OracleHeads, decode, hf_greedy, perturbed, tiny_model

from mtp_viz.clock import Clock
from mtp_viz.lean import lean_model
from mtp_viz.strategies.base import GenerationSettings

pytestmark = pytest.mark.gpu
PROMPT = [5, 17, 3, 42, 9, 17, 3]


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
    finally:
        for lean in leans:
            lean.decompile()


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
