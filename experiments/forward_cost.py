"""What the teacher-forced target forward costs against this CPU's sgemm (the feature store's price).

    .venv/bin/python experiments/forward_cost.py

Prints torch's sgemm rate on a 4096 x 576 x 1536 product, the embedded target's body over 8 x 512
tokens (tok/s), its head over those positions, and the log-softmax with top-16 (best of 2-3 runs).
docs/training.md (2026-12-07) quotes one run on a 2-core AMD EPYC.
"""

import time

import torch

from mtp_viz.loading import load_model, model_name


def best(f, n: int = 3) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    torch.manual_seed(0)
    a, w = torch.randn(4096, 576), torch.randn(1536, 576)
    t = best(lambda: torch.nn.functional.linear(a, w))
    print(f"sgemm 4096x576x1536: {2 * 4096 * 576 * 1536 / t / 1e9:.1f} GFLOP/s")
    model = load_model(model_name(None, "cpu"), "cpu", "float32").model.eval()
    ids = torch.randint(0, model.config.vocab_size, (8, 512))
    with torch.inference_mode():
        t = best(lambda: model.model(input_ids=ids, output_hidden_states=True), 2)
        print(f"body 8x512: {t:.2f} s = {4096 / t:.0f} tok/s")
        hidden = torch.randn(8, 512, model.config.hidden_size)
        print(f"lm_head 8x512: {best(lambda: model.lm_head(hidden), 2):.2f} s")
        logits = model.lm_head(hidden)
        print(f"log_softmax + top-16: {best(lambda: torch.log_softmax(logits.float(), -1).topk(16, -1), 2):.2f} s")
    print(f"torch threads: {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
