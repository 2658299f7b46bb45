"""The training loop both drafters share: fixed seeds, AdamW with warm-up and cosine decay,
gradient clipping, a progress bar, periodic validation, and checkpoint/resume.

A task supplies its parameters, an epoch's batches, a loss and a validation function; the loop
knows nothing of drafts or heads. A checkpoint holds the parameters, the optimizer, the step and
the RNG states, so `--resume` continues the same run (the same batches in the same order).
"""

import json
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from mtp_viz.loading import LoadedModel

CHECKPOINT = "checkpoint.pt"
REPORT = "training.json"


@dataclass(frozen=True)
class LoopConfig:
    epochs: int = 2
    lr: float = 3e-4
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    eval_every: int = 100
    checkpoint_every: int = 50
    seed: int = 0
    max_steps: int = 0  # stop after this many steps (0: after `epochs`)


@dataclass(frozen=True)
class TrainJob:
    """Where one training run reads and writes: the frozen target, its data folder, the folder the
    trained weights go to (`out`, with the report) and the one for checkpoints (`runs`). `resume`
    continues from the last checkpoint; `start_from` trains saved weights further."""

    target: LoadedModel
    data: Path
    out: Path
    runs: Path
    resume: bool = False
    start_from: Path | None = None
    log: Callable[[str], None] = print

    def train(self, params, epoch_batches, loss_fn, validate, cfg: LoopConfig) -> list[dict]:
        """`train` with this job's checkpoints, resumption and log."""
        return train(params, epoch_batches, loss_fn, validate, self.runs, cfg, self.resume, self.log)

    def report(self, cfg, started: float, before: dict, history: list[dict], **sizes) -> dict:
        """The run's report (settings, data sizes, validation before and during training, seconds
        since `started`), also written to out/training.json."""
        report = {
            "config": asdict(cfg),
            **sizes,
            "started_from": str(self.start_from) if self.start_from else None,
            "before": before,
            "history": history,
            "seconds": time.perf_counter() - started,
        }
        (self.out / REPORT).write_text(json.dumps(report, indent=1))
        return report


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def lr_at(step: int, total: int, cfg: LoopConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def train(
    params: dict[str, torch.nn.Parameter],
    epoch_batches: Callable[[int], list],  # epoch → its batches, in order (seeded by the task)
    loss_fn: Callable[[object], tuple[torch.Tensor, dict[str, float]]],
    validate: Callable[[], dict[str, float]],
    out: Path,
    cfg: LoopConfig,
    resume: bool = False,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Train `params` in place; returns the validation history (also kept in the checkpoint)."""
    out.mkdir(parents=True, exist_ok=True)
    optimizer = torch.optim.AdamW(params.values(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    per_epoch = len(epoch_batches(0))
    total = per_epoch * cfg.epochs
    if cfg.max_steps:
        total = min(total, cfg.max_steps)
    step, history = 0, []
    checkpoint = out / CHECKPOINT
    if resume and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        if asdict(LoopConfig(**state["config"])) != asdict(cfg):
            raise ValueError(f"{checkpoint} was made with other settings; start afresh without --resume")
        with torch.no_grad():
            for name, value in state["params"].items():
                params[name].copy_(value)
        optimizer.load_state_dict(state["optimizer"])
        step, history = state["step"], state["history"]
        torch.set_rng_state(state["torch_rng"])
        log(f"resumed from {checkpoint} at step {step}/{total}")
    bar = tqdm(total=total, initial=step, unit="step", desc=f"train {out.name}")
    for epoch, batch in _from(step, per_epoch, cfg.epochs, epoch_batches):
        if step >= total:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, total, cfg)
        loss, stats = loss_fn(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), cfg.grad_clip)
        optimizer.step()
        step += 1
        bar.update(1)
        bar.set_postfix(epoch=epoch, **{k: f"{v:.3f}" for k, v in stats.items()})
        if step % cfg.eval_every == 0 or step == total:
            history.append({"step": step, **validate()})
            log(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in history[-1].items() if k != "step"))
        if step % cfg.checkpoint_every == 0 or step == total:
            _save(checkpoint, params, optimizer, step, history, cfg)
    bar.close()
    return history


def _from(step: int, per_epoch: int, epochs: int, epoch_batches) -> Iterator[tuple[int, object]]:
    """The batches from global step `step` on."""
    for epoch in range(step // per_epoch, epochs):
        batches = epoch_batches(epoch)
        for batch in batches[step - epoch * per_epoch if epoch == step // per_epoch else 0 :]:
            yield epoch, batch


def _save(path: Path, params, optimizer, step: int, history: list, cfg: LoopConfig) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "params": {n: p.detach().clone() for n, p in params.items()},
            "optimizer": optimizer.state_dict(),
            "step": step,
            "history": history,
            "torch_rng": torch.get_rng_state(),
            "config": asdict(cfg),
        },
        tmp,
    )
    tmp.rename(path)
