"""On a CUDA device: the engine stays lossless and its clock measures the work, not the launch."""

import pytest
import torch
from conftest import OracleHeads, decode, hf_greedy, perturbed, tiny_model

from mtp_viz.clock import Clock
from mtp_viz.strategies.base import GenerationSettings

pytestmark = pytest.mark.gpu
PROMPT = [5, 17, 3, 42, 9, 17, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_identity_on_cuda(dtype):
    model = tiny_model("llama-2l", seed=0).to("cuda", dtype)
    draft = perturbed(tiny_model("llama-2l", seed=0), 0.2).to("cuda", dtype)
    generation = GenerationSettings(max_new_tokens=40)
    reference, _ = decode(model, "autoregressive", PROMPT, generation)
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
