"""The EAGLE-3 training step (loss forward and backward) of this tree against an earlier commit's,
alternated in one process on one synthetic batch of the embedded target's shapes (ratios only:
these machines are noisy), with the loss and a gradient compared (docs/training.md, tenth session).

    OMP_NUM_THREADS=1 .venv/bin/python experiments/eagle_step_ab.py [COMMIT] [THREADS] [ROWS] [REPEATS]

COMMIT (default 6c87ae3, before the elementwise chain attention): its mtp_viz/training/eagle.py.
"""

import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from mtp_viz.drafters.eagle3 import Eagle3Drafter
from mtp_viz.drafters.eagle3_config import Eagle3Config
from mtp_viz.paths import REPO
from mtp_viz.training import eagle as new
from mtp_viz.training.eagle_examples import EagleTrainConfig


def old_module(commit: str):
    source = subprocess.run(
        ["git", "show", f"{commit}:mtp_viz/training/eagle.py"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "eagle_old.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("eagle_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    commit, threads, rows, repeats = (sys.argv[1:] + ["6c87ae3", "1", "4", "4"][len(sys.argv) - 1 :])[:4]
    torch.set_num_threads(int(threads))
    torch.manual_seed(0)
    c = Eagle3Config(
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        vocab_size=49152,
        draft_vocab_size=8192,
        aux_layer_ids=(2, 15, 27),
    )
    b, length, prompt = int(rows), 640, 200
    weight = torch.zeros(b, length)
    weight[:, prompt:], weight[:, -1] = 1.0, 0.0
    batch = dict(
        tokens=torch.randint(0, 49152, (b, length)),
        features=torch.randn(b, length, 3 * 576).half(),
        argmax=torch.randint(0, 8192, (b, length)),
        topk_ids=torch.randint(0, 8192, (b, length, 16)),
        topk_p=torch.softmax(torch.randn(b, length, 16), -1),
        weight=weight,
    )
    batch["argmax"][:, ::7] = -1  # labels outside the draft vocabulary
    drafter = Eagle3Drafter(c, nn.Embedding(49152, 576).requires_grad_(False))
    cfg, times, seen = EagleTrainConfig(), {"old": [], "new": []}, {}
    for _ in range(int(repeats)):
        for name, module in (("old", old_module(commit) if "old" not in seen else seen["old"][2]), ("new", new)):
            drafter.zero_grad(set_to_none=True)
            start = time.perf_counter()
            loss, _ = module.losses(drafter, batch, cfg)
            loss.backward()
            times[name].append(time.perf_counter() - start)
            seen[name] = (float(loss), drafter.fc.weight.grad.clone(), module)
    print({k: [round(x, 2) for x in v] for k, v in times.items()})
    grad_old, grad_new = seen["old"][1], seen["new"][1]
    rel = float((grad_old - grad_new).norm() / grad_old.norm())
    ratio = min(times["old"]) / min(times["new"])
    print(
        f"old/new (fastest of each): {ratio:.2f}x; loss {seen['old'][0]:.6f} vs {seen['new'][0]:.6f}; "
        f"fc gradient relative difference {rel:.1e}"
    )


if __name__ == "__main__":
    main()
