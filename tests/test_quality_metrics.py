"""The quality figures a lossy strategy is judged by: the original model's NLL of a text, and
final answers against GSM8K-style references."""

import torch
from conftest import decode, tiny_model

from mtp_viz.quality import reference_answer, target_nll


def test_reference_answers_are_the_number_after_the_hashes():
    assert reference_answer("so 600+400=$<<600+400=1000>>1000 in total.\n#### 1,000") == "1000"
    assert reference_answer("#### -3.0") == "-3"
    assert reference_answer("no marker 42") is None and reference_answer(None) is None


def test_target_nll_is_the_mean_cross_entropy_and_prefers_the_models_own_text():
    model = tiny_model("llama-2l", vocab_size=16, initializer_range=0.4)
    prompt = [1, 2, 3]
    own, _ = decode(model, "autoregressive", prompt)
    other = [(t + 5) % 16 for t in own]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + own])).logits[0, 2:-1], -1)
    manual = -float(logp[torch.arange(len(own)), torch.tensor(own)].mean())
    assert abs(target_nll(model, prompt, own) - manual) < 1e-5
    assert target_nll(model, prompt, own) < target_nll(model, prompt, other)
    assert target_nll(model, prompt, []) != target_nll(model, prompt, [])  # NaN: nothing to score
