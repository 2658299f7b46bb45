"""`train`: drafters for a frozen target: the self-distillation data, a small draft model,
sequential MTP heads, an EAGLE-3 drafter, or a mask-token MTP adapter."""

import argparse
import hashlib
import json
from dataclasses import replace
from pathlib import Path

from mtp_viz.cli.options import given
from mtp_viz.errors import UserError
from mtp_viz.loading import load_model, model_name
from mtp_viz.paths import cache_root
from mtp_viz.training.corpus import MANIFEST as CORPUS_MANIFEST
from mtp_viz.training.corpus import CorpusConfig, default_folder, is_corpus
from mtp_viz.training.corpus_make import AUTO, ENGINES, make
from mtp_viz.training.data import MANIFEST, DataConfig, generate
from mtp_viz.training.draft import DraftTrainConfig, train_draft
from mtp_viz.training.eagle import EagleTrainConfig, train_eagle
from mtp_viz.training.features import FeatureConfig, is_store, store_layers
from mtp_viz.training.features import build as build_features
from mtp_viz.training.heads import HeadsTrainConfig, train_heads
from mtp_viz.training.loop import SCHEDULES, TrainJob
from mtp_viz.training.mask import MaskTrainConfig, train_mask

DATA_OPTIONS = ("instructions", "self_instruct", "contexts", "math", "max_new_tokens", "batch_size")
# What a run may change from the defaults: option → help, in --help order (integers but where TYPES says)
TUNING = {
    "--instructions": "data: round-1 prompts",
    "--self-instruct": "data: round-2 prompts, written by the target itself",
    "--contexts": "data: round-3 (summarise / context QA) prompts",
    "--math": "data: round-4 prompts (word problems, step by step)",
    "--max-new-tokens": "data: tokens generated per prompt",
    "--batch-size": "data: prompts decoded together",
    "--layers": "draft: decoder layers",
    "--depth": "heads: depths unrolled in training",
    "--ttt-steps": "eagle: draft steps unrolled in training (training-time test)",
    "--regression": "eagle: weight of a hidden-state regression term beside the cross entropy (needs a corpus or "
    "its feature store)",
    "--frozen-head-steps": "eagle: optimizer steps the head (the target's rows at first) stays frozen",
    "--heldout": "draft, heads, eagle, mtp: Spec-Bench prompts a category whose answers (the target's) are "
    "scored at every validation (0: none)",
    "--prompt-weight": "eagle: loss weight of prompt positions (0, the default: chains based in a prompt, which "
    "drafting never starts, are not computed)",
    "--aux-layers": "eagle: the target layers whose residual streams the drafter reads, e.g. 2,15,27",
    "--vocab": "reduced vocabulary size",
    "--k-max": "mtp: most predictions per forward trained (1 + masks)",
    "--rank": "mtp: LoRA rank",
    "--gating": "mtp: adapter at mask positions only (mask_only) or everywhere",
    "--steps": "optimizer steps (the training budget; draft, heads, eagle: at most, within --epochs)",
    "--epochs": None,
    "--lr": None,
    "--schedule": "learning rate after warm-up: cosine (to zero at the run's end), constant, or wsd "
    "(warmup-stable-decay); a constant or wsd run can be made longer with --resume and more --steps or --epochs",
}
TYPES = {
    "--gating": str,
    "--lr": float,
    "--aux-layers": str,
    "--schedule": str,
    "--regression": float,
    "--prompt-weight": float,
}


def add(sub) -> None:
    t = sub.add_parser(
        "train",
        help="train drafters for a frozen target: corpus (the target's answers to broad prompts, by vLLM or our "
        "engine; sharded, resumable), features (the target's view of every corpus position, memory-mapped), "
        "data (cached self-distillation set), draft (a small draft model), "
        "heads (sequential MTP heads), eagle (an EAGLE-3 drafter, in vLLM's format), "
        "mtp (a mask-token MTP adapter, by self-distillation)",
    )
    t.add_argument("what", choices=("corpus", "features", "data", "draft", "heads", "eagle", "mtp"))
    t.add_argument("--model", help="the frozen target (default: the device's default)")
    t.add_argument("--data", type=Path, help="data folder (default: <cache>/train/<model>)")
    t.add_argument("--out", type=Path, help="where the trained drafter or adapter goes (required but for data)")
    t.add_argument(
        "--resume",
        action="store_true",
        help="continue from the last checkpoint (beside the data; a corpus's in the cache), or eagle, where it "
        "is gone or older (another machine): from the weights and report --out holds",
    )
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--start-from", type=Path, help="draft/heads/mtp: continue training these saved weights")
    for option, text in TUNING.items():
        t.add_argument(option, type=TYPES.get(option, int), help=text)
    t.add_argument(
        "--norm-before-fc",
        action=argparse.BooleanOptionalAction,
        help="eagle: an RMSNorm over the fused features (default: a fresh drafter has it, --start-from's its own)",
    )
    vocab_help = "eagle: count the draft vocabulary over (default: answers)"
    t.add_argument("--vocab-from", choices=("all", "answers"), help=vocab_help)
    t.add_argument("--device", default="cpu")
    t.add_argument("--engine", choices=ENGINES, default=AUTO, help="corpus: who answers (auto: vLLM where installed)")
    t.add_argument("--vllm-url", help="corpus: the vLLM server already running there answers")
    t.add_argument("--prompts", type=int, help="corpus: about this many first-turn prompts (default ~4,600)")
    t.add_argument("--sequences", type=int, help="features: a seeded random share of the corpus, this many sequences")
    t.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> None:
    if args.what == "corpus":
        return cmd_corpus(args)
    if args.what == "features":
        return cmd_features(args)
    loop = given(args, "epochs", "lr", "schedule")
    budget = given(args, max_steps="steps")
    if budget.get("max_steps", 1) < 1:
        raise UserError(f"the training budget must be at least one step, got --steps {budget['max_steps']}")
    if loop.get("schedule", SCHEDULES[0]) not in SCHEDULES:
        raise UserError(f"--schedule {loop['schedule']}: one of {', '.join(SCHEDULES)}")
    if args.what != "data" and args.out is None:
        raise UserError(f"train {args.what} needs --out DIR")
    if args.what == "mtp":  # settings checked before anything loads
        mask_loop = replace(MaskTrainConfig().loop, seed=args.seed, **loop, **budget)
        named = given(args, "k_max", "rank", "gating", heldout_per_category="heldout")
        mask_cfg = MaskTrainConfig(**named, loop=mask_loop)
    if args.what == "eagle":
        named = given(args, "ttt_steps", "vocab_from", "frozen_head_steps", reduced_vocab="vocab")
        named |= given(args, "prompt_weight", heldout_per_category="heldout", regression_weight="regression")
        named |= given(args, "norm_before_fc")
        eagle_cfg = EagleTrainConfig(**named, aux_layers=aux_layers(args))
        eagle_loop = replace(eagle_cfg.loop, seed=args.seed, **loop, **budget)
        eagle_cfg = replace(eagle_cfg, loop=eagle_loop)
    name = model_name(args.model, args.device)
    target = load_model(name, args.device, "float32")
    data = args.data or cache_root() / "train" / target.name
    data_flags = given(args, *DATA_OPTIONS)
    if args.what != "data" and not data_flags and not (data / MANIFEST).is_file() and not is_store(data):
        raise UserError(f"no training data in {data}; make it first: python -m mtp_viz train data --data {data}")
    if is_store(data):  # a corpus's feature store (train features): every trainer reads it as it is
        if args.what == "data":
            raise UserError(f"{data} is a feature store (train features makes one), not a data folder")
    elif is_corpus(data):  # EAGLE-3 reads a corpus itself (the target's view batch by batch)
        if args.what != "eagle":
            raise UserError(f"{data} is a corpus: train {args.what} reads its feature store (train features makes it)")
    else:  # without data flags an existing folder keeps its own settings (and is only finished if incomplete)
        generate(target, data, DataConfig(**data_flags, seed=args.seed) if data_flags else None)
    if args.what == "data":
        return
    # checkpoints beside the data, but never inside a corpus (the repository's): in the cache
    runs = data / "runs" / args.out.name
    if is_corpus(data):  # one folder per --out (two outs of one name do not share checkpoints)
        out_hash = hashlib.sha256(str(args.out.resolve()).encode()).hexdigest()[:8]
        runs = cache_root() / "runs" / target.name / f"{args.out.name}-{out_hash}"
    job = TrainJob(target, data, args.out, runs, resume=args.resume, start_from=args.start_from)
    if args.what == "draft":
        cfg = DraftTrainConfig(**given(args, "layers", reduced_vocab="vocab", heldout_per_category="heldout"))
        report = train_draft(job, replace(cfg, loop=replace(cfg.loop, seed=args.seed, **loop, **budget)))
    elif args.what == "heads":
        cfg = HeadsTrainConfig(**given(args, "depth", reduced_vocab="vocab", heldout_per_category="heldout"))
        report = train_heads(job, replace(cfg, loop=replace(cfg.loop, seed=args.seed, **loop, **budget)))
    elif args.what == "eagle":
        report = train_eagle(job, eagle_cfg)
    else:
        report = train_mask(job, mask_cfg)
    final = report["history"][-1] if report["history"] else report["before"]
    print(f"{args.what} trained in {report['seconds']:.0f} s and saved to {args.out}: {final}")


def cmd_corpus(args: argparse.Namespace) -> None:
    cfg = CorpusConfig(seed=args.seed, **given(args, "max_new_tokens"))
    if args.prompts is not None:
        if args.prompts < 1:
            raise UserError("--prompts must be at least 1")
        cfg = cfg.scaled(args.prompts)
    folder, manifest = make(args.model, args.data, cfg, args.engine, args.vllm_url)
    tokens = sum(s["answer_tokens"] for s in manifest["shards"].values())
    shards, dropped = len(manifest["shards"]), manifest["dropped"]
    print(f"corpus in {folder}: {shards} shards, {tokens} answer tokens; prompts dropped: {dropped}")


def cmd_features(args: argparse.Namespace) -> None:
    """The feature store of a finished corpus (--data, default the model's corpus in the repository)
    in --out (default: the cache's features/<model>: GBs, not for the repository), for the EAGLE-3
    aux layers given or vLLM's default and the last layer's input (features.store_layers)."""
    target = load_model(model_name(args.model, args.device), args.device, "float32")
    corpus = args.data or default_folder(target.name)
    manifest = corpus / CORPUS_MANIFEST
    if not manifest.is_file() or not json.loads(manifest.read_text()).get("complete"):
        raise UserError(f"no finished corpus in {corpus}; make it first: python -m mtp_viz train corpus")
    layers = aux_layers(args) or store_layers(target.model.config.num_hidden_layers)
    if args.sequences is not None and args.sequences < 1:
        raise UserError("--sequences must be at least 1")
    cfg = FeatureConfig(layers, sequences=args.sequences or 0)
    folder = build_features(target.model, corpus, args.out or features_folder(target.name), cfg)
    print(f"features of {corpus} in {folder}")


def features_folder(target_name: str) -> Path:
    """Where `train features` puts a model's feature store unless told: the cache's."""
    return cache_root() / "features" / target_name


def aux_layers(args: argparse.Namespace) -> tuple[int, ...] | None:
    """--aux-layers "2,15,27" → (2, 15, 27); None when not given."""
    if args.aux_layers is None:
        return None
    try:
        layers = tuple(int(x) for x in args.aux_layers.split(","))
    except ValueError:
        raise UserError(f"--aux-layers takes layer ids separated by commas (2,15,27): {args.aux_layers!r}") from None
    if not layers or min(layers) < 0:
        raise UserError(f"--aux-layers takes non-negative layer ids; got {args.aux_layers!r}")
    return layers
