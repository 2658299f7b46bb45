"""Train an EAGLE-3 drafter (mtp_viz.drafters.eagle3) for a frozen target, by self-distillation.

Data (mtp_viz.training.eagle_examples): a corpus's feature store (mtp_viz.training.features), a
finished corpus itself (mtp_viz.training.corpus: the target's view computed batch by batch), or
the older self-distillation set (mtp_viz.training.data): the target's own answers, with its argmax
and top-k view of every position, and its residual streams after the drafter's `aux_layer_ids`
layers (low, middle, high; fp16). Every validation also scores the fixed held-out set
(mtp_viz.training.heldout).

Training-time test: mtp_viz.training.eagle_unroll (the drafter unrolled `ttt_steps` times over
every position at once, each step scored against the target's view of the token after next).
"""

import json
import os
import random
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from torch.nn import functional as F

from mtp_viz.drafters.eagle3 import Eagle3Config, Eagle3Drafter, load_eagle3, save_eagle3
from mtp_viz.drafters.eagle3_config import default_aux_layer_ids
from mtp_viz.drafters.vocab import frequent_tokens
from mtp_viz.errors import UserError
from mtp_viz.training.corpus import VALIDATION, is_complete, is_corpus, read_records
from mtp_viz.training.data import load_sequences
from mtp_viz.training.draft import batches_of
from mtp_viz.training.eagle_examples import (
    EagleTrainConfig,
    Example,
    Pending,
    cache_features,
    chain_batches,
    collate,
    corpus_examples,
    examples,
    on_device,
    record_vocab_tokens,
    sequence_examples,
    spread,
    store_examples,
    vocab_coverage,
    vocab_tokens,
)
from mtp_viz.training.eagle_unroll import at_step, chain_bases, step_labels, unroll
from mtp_viz.training.features import FeatureStore, is_store, store_sequence
from mtp_viz.training.heldout import as_heldout, spec_bench_heldout
from mtp_viz.training.loop import REPORT, TrainJob, restart_state, saved_run, seed_everything


def build_drafter(
    target, aux_layers: tuple[int, ...], vocab: torch.Tensor, norm_before_fc: bool = False
) -> Eagle3Drafter:
    """A fresh drafter for `target` (a transformers Llama-family model): its shapes, its rotary
    settings, its embedding (shared), its final norm and its head rows for `vocab` (sorted target ids)."""
    c = target.config
    config = Eagle3Config(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        rms_norm_eps=float(c.rms_norm_eps),
        rope_theta=float(getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]),
        max_position_embeddings=c.max_position_embeddings,
        vocab_size=c.vocab_size,
        draft_vocab_size=len(vocab),
        aux_layer_ids=tuple(aux_layers),
        norm_before_fc=norm_before_fc,
    )
    drafter = Eagle3Drafter(config, target.get_input_embeddings())
    with torch.no_grad():
        drafter.lm_head.weight.copy_(target.get_output_embeddings().weight[vocab])
        drafter.norm.weight.copy_(target.model.norm.weight)
        drafter.d2t.copy_(vocab - torch.arange(len(vocab)))
        drafter.t2d.zero_()[vocab] = True
    return drafter


def add_input_norm(drafter: Eagle3Drafter, features: torch.Tensor) -> None:
    """Give a drafter trained without it an RMSNorm over its concatenated features (`norm_before_fc`),
    its weight the median root-mean-square of `features` (…, fc_input_size): the fused input keeps its
    typical scale, so the drafter starts where it was rather than from a rescaled residual stream
    (exact only where a position's scale is the median; fine-tuning takes up the rest)."""
    x = features.reshape(-1, features.shape[-1]).float()
    x = x[x.abs().sum(-1) > 0]  # padded positions hold zeros
    scale = float(x.pow(2).mean(-1).sqrt().median()) if len(x) else 1.0
    c = drafter.config = replace(drafter.config, norm_before_fc=True)
    norm = torch.nn.RMSNorm(c.fc_input_size, eps=c.rms_norm_eps).to(drafter.fc.weight.device, drafter.fc.weight.dtype)
    with torch.no_grad():
        norm.weight.fill_(scale)
    drafter.input_norm = norm


def trained_parameters(drafter: Eagle3Drafter) -> dict[str, torch.nn.Parameter]:
    """Everything but the shared embedding."""
    return {n: p for n, p in drafter.named_parameters() if not n.startswith("embed_tokens.")}


def losses(drafter: Eagle3Drafter, batch: dict[str, torch.Tensor], cfg: EagleTrainConfig):
    total, stats = 0.0, {}
    bases, real = chain_bases(batch)
    states = [] if cfg.regression_weight else None
    for j, logits in unroll(drafter, batch, cfg.ttt_steps, states, bases):
        argmax, ids, p, weight = step_labels(batch, j, bases, real)
        logp = torch.log_softmax(logits.float(), -1)  # (B, T, V_d)
        # the argmax (weight 1 where in the draft vocabulary) and the top-k (p, 0 outside) in one gather:
        # its backward fills a (B, T, V_d) gradient with zeros, once rather than twice
        picked = torch.cat([argmax[..., None], ids], -1).clamp(min=0)
        mass = torch.cat([(argmax >= 0)[..., None].float(), cfg.soft_weight * p], -1)
        per = -(mass * logp.gather(-1, picked)).sum(-1) * weight  # hard + soft_weight · soft
        if states is not None:  # toward the state the target's head read at the labelled position
            goal = at_step(batch["hidden"], j, bases, 0.0).float()
            per = per + cfg.regression_weight * F.smooth_l1_loss(states[-1], goal, reduction="none").mean(-1) * weight
        loss = per.sum() / weight.sum().clamp(min=1)
        total = total + cfg.step_decay ** (j - 1) * loss
        stats[f"loss{j}"] = float(loss.detach())
    return total, stats


@torch.no_grad()
def agreement(drafter: Eagle3Drafter, exs: list[Example | Pending], steps: int, budget: int = 4096) -> dict[str, float]:
    """Teacher-forced, on answer positions (weight 1): per step, top-1 agreement with the target's
    argmax (a label outside the draft vocabulary is a miss); and the tokens a greedy chain of
    `steps` drafts yields per target forward, 1 + Σ_j P(drafts 1..j right), over chains whose
    every label lies in an answer. Only chains that reach an answer label within `steps` are
    unrolled (those based in a prompt further back count nowhere)."""
    right, counted, alive_sum = torch.zeros(steps), torch.zeros(steps), torch.zeros(steps)
    complete = 0.0
    for group in chain_batches(exs, budget, random.Random(0)):
        batch = on_device(collate(group), drafter.lm_head.weight.device)
        bases, real = chain_bases(batch, lookback=steps - 1, answer_only=True)
        reach = alive = None
        alives = []
        for j, logits in unroll(drafter, batch, steps, bases=bases):
            argmax, _, _, weight = step_labels(batch, j, bases, real)
            answer = weight == 1.0
            ok = logits.argmax(-1) == argmax
            right[j - 1] += float((ok & answer).sum())
            counted[j - 1] += float(answer.sum())
            reach = answer if reach is None else reach & answer
            alive = ok if alive is None else alive & ok
            alives.append(alive)
        for j, a in enumerate(alives):
            alive_sum[j] += float((a & reach).sum())
        complete += float(reach.sum())
    result = {f"val_top1_step{j + 1}": float(right[j] / counted[j].clamp(min=1)) for j in range(steps)}
    return result | {"val_mean_accepted_tokens": 1.0 + float(alive_sum.sum()) / max(1.0, complete)}


def train_eagle(job: TrainJob, cfg: EagleTrainConfig) -> dict:
    """Train and save an EAGLE-3 drafter in `job.out` (vLLM's checkpoint format); returns the report."""
    seed_everything(cfg.loop.seed)
    started = time.perf_counter()
    model = job.target.model.requires_grad_(False)
    store = FeatureStore(job.data) if is_store(job.data) else None
    records = None
    if store is None and is_corpus(job.data):
        if not is_complete(job.data):
            raise UserError(f"the corpus in {job.data} is not finished: python -m mtp_viz train corpus finishes it")
        records = [{k: r[k] for k in ("prompt_ids", "answer_ids", "split")} for r in read_records(job.data)]
    if cfg.regression_weight and store is None and records is None:
        raise UserError("the regression needs the target's final hidden states: train from a corpus or its features")
    layers = tuple(cfg.aux_layers or default_aux_layer_ids(model.config.num_hidden_layers))
    if store is not None and not cfg.aux_layers:  # vLLM's default where the store has it, else the store's
        stored = tuple(store.meta["made_from"]["config"]["aux_layers"])
        layers = layers if set(layers) <= set(stored) else stored
    restart = None
    if job.resume and saved_run(job.out):  # a run resumed here or restarted: its settings, not others
        restart = restart_state(job.out, asdict(cfg))
        restart = restart if job.can_restart() else None
    if job.start_from is not None or restart is not None:  # trained weights, or a run's as saved (restart)
        drafter = load_eagle3(job.start_from or job.out, embed=model.get_input_embeddings())
        layers = drafter.config.aux_layer_ids
        add_norm = restart is None and cfg.norm_before_fc is True and not drafter.config.norm_before_fc
    else:
        eos = sorted(job.target.eos_token_ids)
        if records is not None:
            ids = (record_vocab_tokens(r, cfg.vocab_from) for r in records if r["split"] != VALIDATION)
        else:
            if store is not None:
                seqs = (store_sequence(store, i) for i in store.indices(validation=False))
            else:
                seqs = load_sequences(job.data, cfg.holdout_every, holdout=False, hidden=False)
            ids = (vocab_tokens(s, cfg.vocab_from) for s in seqs)
        vocab = frequent_tokens(ids, cfg.reduced_vocab, always=eos)
        drafter = build_drafter(model, layers, vocab, cfg.norm_before_fc is not False)
        add_norm = False
    drafter.to(model.get_input_embeddings().weight.device).train()  # the target's device (--device)
    index = drafter.to_draft_index().cpu()  # examples are made on the CPU, batches moved as they are used
    if store is not None or records is not None:  # a corpus's feature store or the corpus: its split
        if store is not None:
            train_exs = store_examples(store, layers, index, cfg, validation=False)
            val_exs = store_examples(store, layers, index, cfg, validation=True)
        else:
            train_exs = corpus_examples([r for r in records if r["split"] != VALIDATION], model, layers, index, cfg)
            val_exs = corpus_examples([r for r in records if r["split"] == VALIDATION], model, layers, index, cfg)
            val_exs = spread(val_exs, [len(e.tokens) for e in val_exs], cfg.val_tokens)
            val_exs = [e.ready() for e in val_exs]  # scored at every validation: the target's view once
            records = None  # the examples keep what they read
        if not train_exs or not val_exs:
            raise UserError(f"the data in {job.data} needs sequences on both sides of the split")
    else:
        folder = cache_features(model, job.data, layers, job.log)
        train_exs = examples(job.data, folder, index, cfg, holdout=False)
        val_exs = examples(job.data, folder, index, cfg, holdout=True)
    if add_norm:  # a trained drafter given the ablation's norm: scaled to the features it has read
        group = sorted(train_exs, key=lambda e: len(e.tokens))[:: max(1, len(train_exs) // 16)][:16]
        add_input_norm(drafter, collate(group)["features"])
        job.log(f"eagle: an input norm added before fc, scaled {drafter.input_norm.weight[0].item():.3g}")
    params = trained_parameters(drafter)
    heldout, coverage = [], None
    if cfg.heldout_per_category:
        seqs = spec_bench_heldout(job.target, cfg.heldout_per_category, log=job.log)
        heldout = sequence_examples(model, seqs, layers, index, cfg)
        coverage = vocab_coverage(seqs, index)
        job.log(f"eagle: the draft vocabulary holds {coverage:.1%} of the held-out answers' target tokens")

    def epoch_batches(epoch: int) -> list[list]:  # collated one step at a time (loss_fn): RAM stays flat
        rng = random.Random(cfg.loop.seed * 1000 + epoch)
        if cfg.prompt_weight == 0:  # the chains from each prompt's end: batched by the answers' lengths
            return chain_batches(train_exs, cfg.tokens_per_batch, rng)
        return batches_of(train_exs, cfg.tokens_per_batch, rng)  # every chain: by the windows' lengths

    def validate() -> dict[str, float]:
        drafter.eval()
        result = agreement(drafter, val_exs, cfg.ttt_steps)
        if heldout:
            result |= as_heldout(agreement(drafter, heldout, cfg.ttt_steps))
        drafter.train()
        return result

    if restart:  # the run's validation before training, and its seconds so far, as saved
        saved = json.loads((job.out / REPORT).read_text())
        initial, started = saved["before"], started - saved["seconds"]
    else:
        initial = validate()
    tokens = sum(len(e.tokens) for e in train_exs)
    job.log(f"eagle: aux layers {layers}, {len(train_exs)} sequences ({tokens} tokens); before training: {initial}")
    sizes = {
        "aux_layers": list(layers),
        "train_sequences": len(train_exs),
        "train_tokens": tokens,
        "heldout_vocab_coverage": coverage,
    }
    if restart and (saved["train_sequences"], saved["train_tokens"]) != (len(train_exs), tokens):
        raise UserError(
            f"{job.out} was trained on other data ({saved['train_sequences']} sequences, {saved['train_tokens']} "
            f"tokens; {job.data} holds {len(train_exs)} and {tokens}): start afresh without --resume"
        )
    drafter.config = replace(drafter.config, trained_steps=max(cfg.ttt_steps, drafter.config.trained_steps or 0))

    def on_step(step: int) -> None:  # the head learns only once the body has had frozen_head_steps
        drafter.lm_head.weight.requires_grad_(step >= cfg.frozen_head_steps)

    def on_checkpoint(step: int, history: list[dict]) -> None:  # what another machine restarts from
        save_whole(drafter, job.out)
        job.report(cfg, started, initial, history, step=step, **sizes)  # last: it says the weights are there

    loss_fn = lambda group: losses(drafter, on_device(collate(group), drafter.lm_head.weight.device), cfg)  # noqa: E731
    history = job.train(params, epoch_batches, loss_fn, validate, cfg.loop, on_step, on_checkpoint, restart)
    drafter.eval()
    save_whole(drafter, job.out)
    return job.report(cfg, started, initial, history, **sizes)


def save_whole(drafter: Eagle3Drafter, out: Path) -> None:
    """The drafter in `out` in float16 (vLLM's format), each file replaced whole: a run killed while
    saving leaves the last weights, which another machine may restart from."""
    saving = out / ".saving"
    save_eagle3(drafter, saving, torch.float16)
    for path in saving.iterdir():
        os.replace(path, out / path.name)
    saving.rmdir()
