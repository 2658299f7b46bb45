"""The training loop every drafter shares: fixed seeds, AdamW with warm-up and a schedule,
gradient clipping, a progress bar, periodic validation, and checkpoint/resume.

A task supplies its parameters, an epoch's batches, a loss and a validation function; the loop
knows nothing of drafts or heads. A checkpoint holds the parameters, the optimizer, the step and
the RNG states, so `--resume` continues the same run (the same batches in the same order).

Schedules (after `warmup_steps` of linear warm-up): `cosine` decays to zero at the run's last step,
so its shape depends on the run's length and a finished run cannot be extended; `constant` keeps
the rate, so `--resume` with more steps (or epochs) simply goes on; `wsd` (warmup-stable-decay)
keeps it until the last `decay_share` of the run and then decays linearly to zero: the state at the
start of the decay is kept (checkpoint-stable.pt), so a longer run resumes from there and decays
at its own end. The validation history also records the mean training loss since the last entry.

A checkpoint is the machine's (optimizer state included, it is several times the weights). A run
that must go on elsewhere, where that folder is gone (a fresh machine keeps only the repository),
restarts from what the task saved at its last checkpoint (`on_checkpoint`: its weights and the
report of the steps done, in `out`): the same batches from the same step on, with a fresh
optimizer whose rate is warmed up again over `warmup_steps` (Adam's moments are re-estimated
there), from weights as the task saves them (EAGLE-3: float16, its shipped format, so a restart
also rounds them once). The task passes that saved state as `restart` where it is further on
than a checkpoint here (none, or one the run has gone past on another machine).
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

from mtp_viz.errors import UserError
from mtp_viz.loading import LoadedModel
from mtp_viz.measured import write_atomically
from mtp_viz.training.curves import markdown

CHECKPOINT = "checkpoint.pt"
STABLE = "checkpoint-stable.pt"  # wsd: the state at the start of the decay, which a longer run resumes from
REPORT = "training.json"
CURVES = "curves.md"  # the history drawn (mtp_viz.training.curves), for docs/training.md
SCHEDULES = ("cosine", "constant", "wsd")
LENGTH = ("epochs", "max_steps")  # the settings a resumed run may change (constant and wsd schedules)


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
    schedule: str = "cosine"  # cosine, constant or wsd (see the module's docstring)
    decay_share: float = 0.2  # wsd: the share of the run that decays

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r}: one of {', '.join(SCHEDULES)}")
        if not 0.0 < self.decay_share <= 1.0:
            raise ValueError(f"decay_share {self.decay_share}: in (0, 1]")

    def decay_start(self, total: int) -> int:
        """wsd: the first step whose rate decays."""
        return max(self.warmup_steps, total - max(1, round(self.decay_share * total)))


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

    def train(
        self, params, epoch_batches, loss_fn, validate, cfg: LoopConfig, on_step=None, on_checkpoint=None, restart=None
    ) -> list[dict]:
        """`train` with this job's checkpoints, resumption and log."""
        return train(
            params,
            epoch_batches,
            loss_fn,
            validate,
            self.runs,
            cfg,
            self.resume,
            self.log,
            on_step,
            on_checkpoint,
            restart,
        )

    def can_restart(self) -> bool:
        """--resume: whether `out` holds what a run saved as it went, further on than a checkpoint
        here (none, or an older one: the run went on on another machine since)."""
        if not (self.resume and self.start_from is None and saved_run(self.out)):
            return False
        here = self.runs / CHECKPOINT
        saved = json.loads((self.out / REPORT).read_text())["step"]
        return not here.exists() or torch.load(here, weights_only=False, map_location="cpu")["step"] < saved

    def report(self, cfg, started: float, before: dict, history: list[dict], step: int | None = None, **sizes) -> dict:
        """The run's report (settings, data sizes, validation before and during training, the
        steps done, seconds since `started`), also written to out/training.json, and drawn in out/curves.md."""
        report = {
            "config": asdict(cfg),
            **sizes,
            "started_from": str(self.start_from) if self.start_from else None,
            "before": before,
            "history": history,
            "step": history[-1]["step"] if step is None and history else step,
            "seconds": time.perf_counter() - started,
        }
        text = json.dumps(report, indent=1)  # written whole: another machine may restart from it
        write_atomically(self.out / REPORT, lambda tmp: tmp.write_text(text), what="a training report")
        (self.out / CURVES).write_text(markdown([{"step": 0, **before}, *history], f"Training {self.out.name}"))
        return report


def saved_run(out: Path) -> bool:
    """Whether `out` holds a report with the steps its run had done (written at its checkpoints)."""
    return (out / REPORT).is_file() and bool(json.loads((out / REPORT).read_text()).get("step"))


def restart_state(out: Path, cfg_dict: dict) -> dict:
    """What `train` restarts from (see the module docstring): the saved report's step, history
    and loop settings; `cfg_dict` is the task's settings now, which must match the saved ones but
    for the loop's length."""
    report = json.loads((out / REPORT).read_text())
    old, new = dict(report["config"]), json.loads(json.dumps(cfg_dict))
    if {k: v for k, v in old.items() if k != "loop"} != {k: v for k, v in new.items() if k != "loop"}:
        raise UserError(f"{out} was trained with other settings; start afresh without --resume")
    return {"step": report["step"], "history": report["history"], "config": old["loop"], "path": out}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def lr_at(step: int, total: int, cfg: LoopConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "wsd":
        start = cfg.decay_start(total)
        return cfg.lr if step < start else cfg.lr * (total - step) / max(1, total - start)
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def total_steps(per_epoch: int, cfg: LoopConfig) -> int:
    total = per_epoch * cfg.epochs
    return min(total, cfg.max_steps) if cfg.max_steps else total


def train(
    params: dict[str, torch.nn.Parameter],
    epoch_batches: Callable[[int], list],  # epoch → its batches, in order (seeded by the task)
    loss_fn: Callable[[object], tuple[torch.Tensor, dict[str, float]]],
    validate: Callable[[], dict[str, float]],
    out: Path,
    cfg: LoopConfig,
    resume: bool = False,
    log: Callable[[str], None] = print,
    on_step: Callable[[int], None] | None = None,  # told each step's index before its loss (e.g. to freeze)
    on_checkpoint: Callable[[int, list[dict]], None] | None = None,  # told (step, history) at each checkpoint
    restart: dict | None = None,  # restart_state(): used by `resume` where no checkpoint is
) -> list[dict]:
    """Train `params` in place; returns the validation history (also kept in the checkpoint)."""
    out.mkdir(parents=True, exist_ok=True)
    optimizer = torch.optim.AdamW(params.values(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    per_epoch = len(epoch_batches(0))
    total = total_steps(per_epoch, cfg)
    step, history, rewarm = 0, [], None  # rewarm: the step a restart began at
    if resume and restart is not None:  # the task passes one only where it is further on than a checkpoint
        state = _continuable(restart, cfg, per_epoch)  # the task has put its saved weights in params
        step, history, rewarm = state["step"], state["history"], state["step"]
        log(f"restarted from {restart['path']} at step {step}/{total}: fresh optimizer, warmed up again")
    elif resume and (out / CHECKPOINT).exists():
        state = _continuable(
            torch.load(out / CHECKPOINT, weights_only=False, map_location="cpu") | {"path": out / CHECKPOINT},
            cfg,
            per_epoch,
            out / STABLE,
        )
        with torch.no_grad():
            for name, value in state["params"].items():
                params[name].copy_(value)
        optimizer.load_state_dict(state["optimizer"])
        step, history = state["step"], state["history"]
        torch.set_rng_state(state["torch_rng"])
        rewarm = state.get("rewarm")
        log(f"resumed from {state['path']} at step {step}/{total}")
    decay = cfg.decay_start(total) if cfg.schedule == "wsd" else None
    bar = tqdm(total=total, initial=step, unit="step", desc=f"train {out.name}")
    losses: list[float] = []
    for epoch, batch in _from(step, per_epoch, cfg.epochs, epoch_batches):
        if step >= total:
            break
        if step == decay:  # wsd: what a longer run would resume from
            _save(out / STABLE, params, optimizer, step, history, cfg, rewarm)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, total, cfg) * _rewarmed(step, rewarm, cfg)
        if on_step is not None:
            on_step(step)
        loss, stats = loss_fn(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), cfg.grad_clip)
        optimizer.step()
        losses.append(float(loss.detach()))
        step += 1
        bar.update(1)
        bar.set_postfix(epoch=epoch, **{k: f"{v:.3f}" for k, v in stats.items()})
        if step % cfg.eval_every == 0 or step == total:
            entry = {"step": step, "train_loss": sum(losses) / len(losses), "lr": optimizer.param_groups[0]["lr"]}
            history.append(entry | validate())
            losses = []
            log(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in history[-1].items() if k != "step"))
        if step % cfg.checkpoint_every == 0 or step == total:
            _save(out / CHECKPOINT, params, optimizer, step, history, cfg, rewarm)
            if on_checkpoint is not None:
                on_checkpoint(step, history)
    bar.close()
    return history


def _continuable(state: dict, cfg: LoopConfig, per_epoch: int, stable: Path | None = None) -> dict:
    """The state a run with `cfg` continues from, given `state` (a checkpoint, or what a restart
    reads: step, config, path): `state` for the same run; for a run made longer, `state` (constant),
    or the last one before the new run's decay starts (wsd: `state` while its own decay had not
    begun, else the one kept at its start in `stable`, where there is one); refused otherwise."""
    path, old = state["path"], LoopConfig(**state["config"])
    if {k: v for k, v in asdict(old).items() if k not in LENGTH} != {
        k: v for k, v in asdict(cfg).items() if k not in LENGTH
    }:
        raise UserError(f"{path} was made with other settings; start afresh without --resume")
    if old == cfg:
        return state
    if cfg.schedule == "cosine":
        raise UserError("a cosine schedule ends at zero: only a constant or wsd run can be made longer (--resume)")
    total = total_steps(per_epoch, cfg)
    if cfg.schedule == "constant":
        if state["step"] > total:
            raise UserError(f"{path} is at step {state['step']}, past this run's {total} steps")
        return state
    start = cfg.decay_start(total)
    if state["step"] <= min(start, old.decay_start(total_steps(per_epoch, old))):
        return state
    if stable is not None and stable.exists():
        kept = torch.load(stable, weights_only=False, map_location="cpu") | {"path": stable}
        if kept["step"] <= start:
            return kept
    raise UserError(f"{path} holds no state from before step {start}, where this run's decay starts")


def _from(step: int, per_epoch: int, epochs: int, epoch_batches) -> Iterator[tuple[int, object]]:
    """The batches from global step `step` on."""
    for epoch in range(step // per_epoch, epochs):
        batches = epoch_batches(epoch)
        for batch in batches[step - epoch * per_epoch if epoch == step // per_epoch else 0 :]:
            yield epoch, batch


def _rewarmed(step: int, rewarm: int | None, cfg: LoopConfig) -> float:
    """The share of the schedule's rate a restarted run uses: warmed up again from `rewarm`."""
    return 1.0 if rewarm is None else min(1.0, (step - rewarm + 1) / max(1, cfg.warmup_steps))


def _save(path: Path, params, optimizer, step: int, history: list, cfg: LoopConfig, rewarm: int | None) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "params": {n: p.detach().clone() for n, p in params.items()},
            "optimizer": optimizer.state_dict(),
            "step": step,
            "history": history,
            "torch_rng": torch.get_rng_state(),
            "config": asdict(cfg),
            "rewarm": rewarm,  # a restart's warm-up goes on where a checkpoint inside it resumes
        },
        tmp,
    )
    tmp.rename(path)
