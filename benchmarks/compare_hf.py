"""Side by side: trainforge against Hugging Face `Trainer` and TRL `SFTTrainer`, one command.

    python benchmarks/compare_hf.py [--quick] [--steps N] [--sft-rows N] [--out results.json]
                                    [--runs NAME,NAME] [--repeat N] [--workdir DIR] [--threads 2] [--gpu]

The full default takes ~15 minutes on 2 cores, almost all of it in the two runs that use
bf16 autocast on a CPU without native bf16 (hf-trainer-bf16, trl-sft); --quick ~1-2 minutes.
Timings are only as clean as the machine: check the load column, and use --repeat 3 on the
fast runs (--runs hf-trainer,trainforge-blocks,...) for medians.

One Llama-shaped model from scratch (byte-level BPE trained once on the corpus; the initial
weights saved once, so every run starts from the identical weights), two pairs of jobs:

A. Pretraining blocks: standard-library source files (`builtin:python-stdlib`, a fixed number
   of documents) joined and cut into blocks of `max_length` tokens.
   - `hf-trainer`: `transformers.Trainer`, its defaults; data the `run_clm.py` way
     (`datasets.load_dataset` + `map(tokenize)` + `map(group_texts)`), labels = input_ids.
   - `hf-trainer-bf16`: the same with `bf16=True`.
   - `trainforge-blocks`: trainforge, its defaults (precision auto), `data.packing: concat`.
   Same optimizer steps (`--steps`) of the same batch size: the same number of blocks.
B. Prompt/completion: documented stdlib functions (`builtin:python-functions`: signature +
   docstring -> body), written once to a JSONL that every run reads; loss on completions only.
   - `trl-sft`: `trl.SFTTrainer` with `SFTConfig` defaults (completion-only loss for
     prompt/completion data; note TRL's own defaults bf16=True, gradient_checkpointing=True).
   - `trl-sft-packed`: the same with `packing=True` (TRL's BFD packing, padding-free).
   - `trainforge-sft`: trainforge, its defaults (packing on, precision auto).
   Equal examples: every run makes one epoch over the same rows. A packed step holds more
   examples than an unpacked one, so packed runs take fewer optimizer steps (the schedule
   spans each run's own steps).

Hyperparameters are equal everywhere: lr, cosine decay to `min_lr_ratio` x lr (no warmup),
AdamW betas/eps/weight decay (not on norms), grad clipping, seed, micro-batch size, max
length, no checkpoints, no in-training eval.

Measured per run (each run is its own subprocess, run one after another, all with the same
thread count):
- tokens/s: real (non-pad) input tokens trained / training-loop time. For HF and TRL a
  forward pre-hook counts `input_ids != pad` in every training forward, and a callback
  times `on_train_begin` .. `on_train_end`; trainforge reports its own (same definition).
- wall: the whole job in that process, from before importing torch to the saved final
  weights, data preparation (cold caches) included.
- peak memory: peak RSS of the run's process (tokenizer worker processes are listed apart).
- eval loss: after training, the parent loads each run's final weights and evaluates them
  with one function (token-weighted mean cross-entropy, fp32) on the same held-out rows:
  every token of held-out documents for A, completion tokens of held-out pairs for B.

Informational extras (--runs ...,trl-sft-fp32,trl-sft-packed-fp32,trainforge-sft-unpacked):
TRL with bf16 and gradient checkpointing off, and trainforge without packing (as many
steps as trl-sft: separates packing's fewer optimizer steps from numerical differences).

--gpu: sizes for a GPU (a ~100M-parameter Llama, rows of 1,024 tokens; HF runs on the GPU as its
defaults do, trainforge with precision auto), and the peak memory column is the GPU's peak
reserved memory (what the card must hold) instead of RSS.

Needs the dev extra (pip install 'trainforge[bench]'). No network: HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T_START = time.perf_counter()  # a child's whole-job clock starts before torch / transformers are imported

PAIR_A = ("hf-trainer", "hf-trainer-bf16", "trainforge-blocks")
PAIR_B = ("trl-sft", "trl-sft-packed", "trainforge-sft")
RUNS = PAIR_A + PAIR_B
# informational, not in the default list: TRL with its two CPU-hostile defaults turned off
# (bf16=False, gradient_checkpointing=False), i.e. what a TRL user who tunes for CPU would run;
# and trainforge without packing (same optimizer steps as trl-sft: separates the effect of
# packing's fewer, larger steps on the eval loss from any numerical difference)
EXTRA_B = ("trl-sft-fp32", "trl-sft-packed-fp32", "trainforge-sft-unpacked")
PAIR_B_ALL = PAIR_B[:2] + EXTRA_B + PAIR_B[2:]  # trainforge last: the report compares it with each run above
TARGETS = {  # trainforge tokens/s over the baseline's (issue 5)
    "hf-trainer": 2.0,
    "hf-trainer-bf16": 1.3,
    "trl-sft": 4.0,
    "trl-sft-packed": 2.5,
}
MAX_EVAL_LOSS_REL = 0.02


def settings(args: argparse.Namespace) -> dict:
    """Sizes of model and data: the full benchmark, or --quick for a smoke check (~2 minutes)."""
    if args.gpu:
        s = {
            # ~100M parameters: 12 x 7.1M in the blocks, 2 x 6.3M in embeddings and LM head
            "model": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12},
            "vocab_size": 8192,
            "a": {"documents": 300, "eval_documents": 16, "max_length": 1024, "batch_size": 16, "steps": 60},
            "b": {"rows": 3000, "eval_rows": 128, "max_length": 1024, "batch_size": 8},
            "eval_max_batches": 16,
        }
    elif args.quick:
        s = {
            "model": {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4},
            "vocab_size": 512,
            "a": {"documents": 12, "eval_documents": 3, "max_length": 64, "batch_size": 4, "steps": 6},
            "b": {"rows": 48, "eval_rows": 16, "max_length": 128, "batch_size": 4},
            "eval_max_batches": 4,
        }
    else:
        s = {
            # ~5.5M parameters: 4 x 0.85M in the blocks, 2 x 1M in embeddings and LM head
            "model": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4},
            "vocab_size": 4096,
            "a": {"documents": 60, "eval_documents": 8, "max_length": 256, "batch_size": 8, "steps": 16},
            "b": {"rows": 100, "eval_rows": 64, "max_length": 256, "batch_size": 4},
            "eval_max_batches": 16,
        }
    if args.steps:
        s["a"]["steps"] = args.steps
    if args.sft_rows:
        s["b"]["rows"] = args.sft_rows
    s["optim"] = {
        "lr": 1.0e-3,
        "min_lr_ratio": 0.1,
        # No warmup: HF's linear warmup starts at lr 0 (step / warmup), trainforge's at lr / warmup
        # ((step + 1) / warmup), so any warmup makes the two schedules differ; without one, the
        # cosine-to-floor schedules are identical step for step.
        "warmup_steps": 0,
        "weight_decay": 0.1,
        "betas": [0.9, 0.95],
        "eps": 1.0e-8,
        "max_grad_norm": 1.0,
    }
    s["seed"] = 0
    s["threads"] = args.threads
    s["gpu"] = bool(args.gpu)
    return s


# ---------------------------------------------------------------- shared inputs (built once, untimed)


def build_inputs(work: Path, s: dict, save_model=None) -> dict:
    """Corpus files, tokenizer and initial weights (``save_model(model_dir, tokenizer, s)``, default the Llama of
    ``s["model"]``): the settings with their paths and the pad token's id."""
    import itertools

    from trainforge.data.sources import iter_stdlib_sources
    from trainforge.model.tokenizer import train_bpe_tokenizer

    a, b = s["a"], s["b"]
    docs = [r.data["text"] for r in itertools.islice(iter_stdlib_sources(), a["documents"] + a["eval_documents"])]
    write_jsonl(work / "text_train.jsonl", [{"text": t} for t in docs[: a["documents"]]])
    write_jsonl(work / "text_eval.jsonl", [{"text": t} for t in docs[a["documents"] :]])

    pairs = [{"prompt": p, "completion": c} for p, c in function_pairs(b["rows"] + b["eval_rows"])]
    write_jsonl(work / "sft_train.jsonl", pairs[: b["rows"]])
    write_jsonl(work / "sft_eval.jsonl", pairs[b["rows"] :])

    texts = docs[: a["documents"]] + [p["prompt"] + p["completion"] for p in pairs[: b["rows"]]]
    tok = train_bpe_tokenizer(texts, s["vocab_size"])
    model_dir = work / "init_model"
    (save_model or save_initial_model)(model_dir, tok, s)

    paths = {
        "work": str(work),
        "model_dir": str(model_dir),
        "text_train": str(work / "text_train.jsonl"),
        "text_eval": str(work / "text_eval.jsonl"),
        "sft_train": str(work / "sft_train.jsonl"),
        "sft_eval": str(work / "sft_eval.jsonl"),
    }
    return {**s, "paths": paths, "pad_token_id": tok.pad_token_id}


def function_pairs(n: int) -> list[tuple[str, str]]:
    """The first ``n`` distinct (signature + docstring, body) pairs of ``builtin:python-functions``:
    distinct, so that no pair is both trained on and evaluated."""
    from trainforge.data.sources import iter_python_functions

    pairs: dict[tuple[str, str], None] = {}
    for r in iter_python_functions():
        pairs.setdefault((r.data["prompt"], r.data["completion"]))
        if len(pairs) == n:
            break
    return list(pairs)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def save_initial_model(model_dir: Path, tok, s: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    m = s["model"]
    config = LlamaConfig(
        vocab_size=len(tok),
        num_key_value_heads=m["num_attention_heads"],
        max_position_embeddings=2048,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        **m,
    )
    torch.manual_seed(s["seed"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    s["parameters"] = sum(p.numel() for p in model.parameters())


def trainforge_config(s: dict, pair: str, cache_dir: Path, packing: bool = True) -> dict:
    """trainforge's config for a pair: only what both sides must agree on; everything else its defaults."""
    p, o = s["paths"], s["optim"]
    if pair == "a":
        data = {"train": p["text_train"], "max_length": s["a"]["max_length"], "too_long": "split", "packing": "concat"}
        train = {"max_steps": s["a"]["steps"], "micro_batch_size": s["a"]["batch_size"]}
    else:
        data = {"train": p["sft_train"], "max_length": s["b"]["max_length"]}  # packing: true is the default
        if not packing:
            data["packing"] = False
        train = {"epochs": 1, "micro_batch_size": s["b"]["batch_size"]}
    return {
        "model": {"path": p["model_dir"]},
        "data": {**data, "eval": None, "cache_dir": str(cache_dir)},
        "train": {**train, "seed": s["seed"]},
        "optim": {
            "lr": o["lr"],
            "weight_decay": o["weight_decay"],
            "betas": o["betas"],
            "eps": o["eps"],
            "schedule": "cosine",
            "warmup_steps": o["warmup_steps"],
            "min_lr_ratio": o["min_lr_ratio"],
            "max_grad_norm": o["max_grad_norm"],
        },
        "checkpoint": {"every_minutes": None},  # the HF runs save no checkpoints either (save_strategy="no")
    }


# ---------------------------------------------------------------- children: one run each


def run_in_child(spec_path: Path, result_path: Path, name: str, run) -> None:
    """A child process's one run: the spec's thread count, a fresh ``runs/NAME`` directory, ``run(spec, out)``'s
    result with the whole job's wall time and peak memory added, written to ``result_path``. Every
    side-by-side benchmark's children run through it."""
    import resource

    import torch
    from transformers.utils import logging as hf_logging

    s = json.loads(spec_path.read_text())
    hf_logging.disable_progress_bar()  # weight-loading bars: noise in the logs, no effect on timings
    torch.set_num_threads(s["threads"])
    out = Path(s["paths"]["work"]) / "runs" / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    r = run(s, out)
    r["wall_s"] = time.perf_counter() - T_START
    r["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    r["peak_rss_children_bytes"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    r["threads"] = torch.get_num_threads()
    if torch.cuda.is_available():  # the GPU's high-water mark: what the card had to hold
        r["peak_gpu_reserved_bytes"] = torch.cuda.max_memory_reserved()
        r["peak_gpu_allocated_bytes"] = torch.cuda.max_memory_allocated()
    result_path.write_text(json.dumps(r, indent=2))


def child(name: str, spec_path: Path, result_path: Path) -> None:
    def run(s: dict, out: Path) -> dict:
        if name.startswith("trainforge"):
            return run_trainforge(s, name, out)
        if name.startswith("hf-trainer"):
            return run_hf_trainer(s, out, bf16=name.endswith("bf16"))
        return run_trl(s, out, packing="packed" in name, tuned=name.endswith("fp32"))

    run_in_child(spec_path, result_path, name, run)


def known_runs(ap: argparse.ArgumentParser, given: str, known: tuple[str, ...]) -> list[str]:
    """The comma-separated ``--runs`` in order, without repeats; an unknown name is an argument error."""
    runs = list(dict.fromkeys(r.strip() for r in given.split(",") if r.strip()))
    unknown = set(runs) - set(known)
    if unknown:
        ap.error(f"unknown runs: {', '.join(sorted(unknown))}; choose from {', '.join(known)}")
    return runs


def train_timed(cfg, out: Path) -> tuple[dict, float | None]:
    """``trainforge train`` of ``cfg`` into ``out``, quietly: (its summary, the process CPU seconds of its training
    loop, as the HF runs' callback measures theirs; nothing is added inside the loop)."""
    from rich.console import Console

    import trainforge.engine.trainer as trainer_module
    from trainforge.metrics.console import ConsoleReporter

    clock, loop = {}, trainer_module.train_loop

    def timed_loop(run):
        c = time.process_time()
        try:
            return loop(run)
        finally:
            clock["cpu_s"] = time.process_time() - c

    trainer_module.train_loop = timed_loop
    try:
        return trainer_module.train(cfg, out, ConsoleReporter(Console(quiet=True))).summary, clock.get("cpu_s")
    finally:
        trainer_module.train_loop = loop


def run_trainforge(s: dict, name: str, out: Path) -> dict:
    import yaml

    from trainforge.config.run import load_config

    pair = "a" if name == "trainforge-blocks" else "b"
    cfg_dict = trainforge_config(s, pair, out / "cache", packing=not name.endswith("unpacked"))
    (out / "config.yaml").write_text(yaml.safe_dump(cfg_dict, sort_keys=False))
    cfg = load_config(out / "config.yaml")
    sm, cpu_s = train_timed(cfg, out / "run")
    return {
        "steps": sm["steps"],
        "examples": None,
        "tokens": sm["tokens"],
        "train_s": sm["train_time_s"],
        "train_cpu_s": cpu_s,
        "tokens_per_s": sm["tokens_per_s"],
        "precision": sm["precision"],
        "final_dir": sm["final_dir"],
        "settings": cfg.model_dump(mode="json"),
        "trainforge_summary": {k: v for k, v in sm.items() if k not in ("data",)},
        "data_stats": sm.get("data"),
    }


class Counter:
    """Real (non-pad) input tokens and sequences of every training forward; the training-loop clock."""

    def __init__(self, pad_id: int):
        self.pad_id, self.tokens, self.forwards, self.t0, self.t1 = pad_id, 0, 0, None, None
        self.cpu0 = self.cpu1 = None

    def hook(self, module, args, kwargs):
        import torch

        if module.training and torch.is_grad_enabled():
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.tokens += int((ids != self.pad_id).sum())
            self.forwards += 1

    def callback(self):
        from transformers import TrainerCallback

        counter = self

        class Timer(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                counter.t0, counter.cpu0 = time.perf_counter(), time.process_time()

            def on_train_end(self, args, state, control, **kw):
                counter.t1, counter.cpu1 = time.perf_counter(), time.process_time()

        return Timer()


def hf_common_args(s: dict, out: Path) -> dict:
    o = s["optim"]
    return {
        "output_dir": str(out / "trainer"),
        "learning_rate": o["lr"],
        "lr_scheduler_type": "cosine_with_min_lr",
        "lr_scheduler_kwargs": {"min_lr_rate": o["min_lr_ratio"]},
        "weight_decay": o["weight_decay"],
        "adam_beta1": o["betas"][0],
        "adam_beta2": o["betas"][1],
        "adam_epsilon": o["eps"],
        "max_grad_norm": o["max_grad_norm"],
        "warmup_steps": o["warmup_steps"],
        "seed": s["seed"],
        "report_to": "none",
        "logging_steps": 1_000_000,  # sparse: the loss is logged once, at the end
        "save_strategy": "no",
        "disable_tqdm": True,
        # on a machine without a GPU, TrainingArguments refuses bf16=True (TRL's default) unless told
        # to run on the CPU; the message says so and this is what a user does. Changes nothing else.
        "use_cpu": not s.get("gpu"),
    }


def load_model(s: dict, counter: Counter):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(s["paths"]["model_dir"])  # defaults: fp32 as saved, sdpa
    model.register_forward_pre_hook(counter.hook, with_kwargs=True)
    return model


def finish_hf(trainer, counter: Counter, out: Path, train_result) -> dict:
    trainer.save_model(str(out / "final"))
    return {
        "steps": trainer.state.global_step,
        "forwards": counter.forwards,
        "tokens": counter.tokens,
        "train_s": counter.t1 - counter.t0,
        "train_cpu_s": counter.cpu1 - counter.cpu0,
        "tokens_per_s": counter.tokens / (counter.t1 - counter.t0),
        "train_runtime_s": train_result.metrics.get("train_runtime"),
        "final_train_loss": train_result.training_loss,
        "final_dir": str(out / "final"),
        "settings": {k: str(v) for k, v in trainer.args.to_dict().items()},
        "model_dtype": str(next(trainer.model.parameters()).dtype),
        "attention": trainer.model.config._attn_implementation,
    }


def run_hf_trainer(s: dict, out: Path, bf16: bool) -> dict:
    """HF Trainer on pretraining blocks, the data prepared the way run_clm.py does it."""
    from itertools import chain

    import datasets
    from transformers import AutoTokenizer, Trainer, TrainingArguments

    datasets.disable_progress_bars()
    a, p = s["a"], s["paths"]
    tok = AutoTokenizer.from_pretrained(p["model_dir"])
    raw = datasets.load_dataset("json", data_files=p["text_train"], split="train", cache_dir=str(out / "hf-cache"))
    eos, block = tok.eos_token_id, a["max_length"]

    def tokenize(batch):  # EOS after each document, as trainforge does
        return {"input_ids": [ids + [eos] for ids in tok(batch["text"])["input_ids"]]}

    def group_texts(batch):
        joined = list(chain(*batch["input_ids"]))
        total = len(joined) // block * block
        blocks = [joined[i : i + block] for i in range(0, total, block)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    ds = raw.map(tokenize, batched=True, remove_columns=raw.column_names)
    ds = ds.map(group_texts, batched=True)

    counter = Counter(tok.pad_token_id)
    model = load_model(s, counter)
    args = TrainingArguments(
        **hf_common_args(s, out),
        per_device_train_batch_size=a["batch_size"],
        max_steps=a["steps"],
        bf16=bf16,
    )
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[counter.callback()])
    r = trainer.train()
    return {**finish_hf(trainer, counter, out, r), "blocks": len(ds), "examples": a["steps"] * a["batch_size"]}


def run_trl(s: dict, out: Path, packing: bool, tuned: bool = False) -> dict:
    """TRL SFTTrainer on prompt/completion rows: SFTConfig defaults, one epoch (tuned: bf16 and
    gradient checkpointing off, the two defaults that cost most on a CPU)."""
    import datasets
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    datasets.disable_progress_bars()
    b, p = s["b"], s["paths"]
    tok = AutoTokenizer.from_pretrained(p["model_dir"])
    ds = datasets.load_dataset("json", data_files=p["sft_train"], split="train", cache_dir=str(out / "hf-cache"))
    counter = Counter(tok.pad_token_id)
    model = load_model(s, counter)
    args = SFTConfig(
        **hf_common_args(s, out),
        per_device_train_batch_size=b["batch_size"],
        num_train_epochs=1,
        max_length=b["max_length"],
        packing=packing,
        **({"bf16": False, "gradient_checkpointing": False} if tuned else {}),
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, callbacks=[counter.callback()])
    rows = len(trainer.train_dataset)
    r = trainer.train()
    res = finish_hf(trainer, counter, out, r)
    res.update(
        examples=len(ds),
        train_rows=rows,
        bf16=args.bf16,
        gradient_checkpointing=args.gradient_checkpointing,
        padding_free=getattr(trainer, "padding_free", None),
        completion_only_loss=getattr(trainer, "completion_only_loss", None),
    )
    return res


# ---------------------------------------------------------------- the one eval, in the parent


def eval_batches_for(s: dict, pair: str, work: Path) -> list:
    """Held-out rows, one per row (padded, never packed), tokenized and masked by one pipeline for all runs."""
    import numpy as np

    from trainforge.config.data import DataSettings
    from trainforge.data.loader import RowCollator, eval_batches
    from trainforge.data.packing import build_rows
    from trainforge.data.prepare import prepare_data
    from trainforge.model.tokenizer import load_tokenizer

    tok = load_tokenizer(s["paths"]["model_dir"])
    p = s[pair]
    path, too_long = (s["paths"]["text_eval"], "split") if pair == "a" else (s["paths"]["sft_eval"], "truncate")
    d = DataSettings(train=path, eval=None, max_length=p["max_length"], too_long=too_long, packing=False,
                     cache_dir=work / "eval-cache", num_workers=1)
    store = prepare_data(d, tok, seed=0, log=lambda *_: None).train
    rows = build_rows(store, np.arange(len(store)), False, p["max_length"])
    collate = RowCollator(store, tok.pad_token_id, False, p["max_length"])
    return eval_batches(rows, collate, p["batch_size"], s["eval_max_batches"])


def eval_loss(model_dir: str, batches: list) -> float:
    """Token-weighted mean next-token cross-entropy over the labelled tokens, fp32, no autocast."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for b in batches:  # right padding under causal attention: pads affect nothing before them
            logits = model(input_ids=b.input_ids.to(device), use_cache=False).logits.float()
            labels = b.labels.to(device).flatten()
            total += float(F.cross_entropy(logits.flatten(0, 1), labels, ignore_index=-100, reduction="sum"))
            n += int((b.labels != -100).sum())
    return total / n


# ---------------------------------------------------------------- the parent


def launch_child(script: str, name: str, spec: Path, work: Path, threads: int) -> dict:
    """``script --child name`` in a fresh process (``threads`` threads, offline, cold caches of its own);
    its result with the 1-minute load average before and after, or ``{name, error, log_tail}``."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(work / "hf-home" / name),  # cold caches for every run
        "TRAINFORGE_CACHE": str(work / "tf-cache" / name),
        "TRANSFORMERS_VERBOSITY": "error",
        "PYTHONWARNINGS": "ignore",
    }
    result = work / f"result-{name}.json"
    log = work / f"log-{name}.txt"
    result.unlink(missing_ok=True)
    load_before, t = os.getloadavg()[0], time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, script, "--child", name, "--spec", str(spec), "--result", str(result)],
                              env=env, stdout=f, stderr=subprocess.STDOUT)
    process_s = time.perf_counter() - t
    if proc.returncode != 0 or not result.is_file():
        tail = log.read_text()[-3000:]
        print(f"  {name}: FAILED (exit {proc.returncode}); log tail:\n{tail}", flush=True)
        return {"name": name, "error": f"exit {proc.returncode}", "log_tail": tail}
    r = json.loads(result.read_text())
    # 1-minute load average before and after: anything above `threads` means other work shared the cores
    r.update(name=name, process_s=process_s, load_before=load_before, load_after=os.getloadavg()[0])
    return r


def run_child(name: str, spec: Path, work: Path, threads: int) -> dict:
    r = launch_child(__file__, name, spec, work, threads)
    if "error" in r:
        return r
    r["tokens_per_cpu_s"] = r["tokens"] / r["train_cpu_s"] if r.get("train_cpu_s") else None
    print(f"  {name}: {r['steps']} steps, {r['tokens']:,} tokens in {r['train_s']:.1f}s "
          f"({r['tokens_per_s']:,.0f} tok/s), wall {r['wall_s']:.1f}s, peak RSS {r['peak_rss_bytes'] / 2**20:,.0f} MiB, "
          f"load {r['load_before']:.1f} -> {r['load_after']:.1f}", flush=True)
    return r


def peak_memory(r: dict) -> int:
    """The memory a run had to hold: the GPU's peak reserved bytes on a GPU, else the process peak RSS."""
    return r.get("peak_gpu_reserved_bytes", r["peak_rss_bytes"])


MEDIAN_KEYS = ("tokens_per_s", "tokens_per_cpu_s", "train_s", "wall_s", "peak_rss_bytes", "peak_gpu_reserved_bytes", "load_before")
ROUND_KEYS = ("tokens_per_s", "tokens_per_cpu_s", "wall_s", "peak_rss_bytes", "load_before", "load_after", "error")


def combine(rounds: list[dict], keys: tuple[str, ...] = MEDIAN_KEYS, round_keys: tuple[str, ...] = ROUND_KEYS) -> dict:
    """One row per run: medians over the rounds of the timings ``keys`` (the last round's weights are
    evaluated); with several rounds, each round's ``round_keys`` too."""
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return rounds[-1]
    import statistics

    out = dict(ok[-1])
    for key in keys:
        values = [r[key] for r in ok if r.get(key) is not None]
        if values:
            out[key] = statistics.median(values)
    if len(rounds) > 1:
        out["rounds"] = [{k: r.get(k) for k in round_keys} for r in rounds]
    return out


HEADER = (f"{'run':<23} {'steps':>5} {'tokens':>8} {'train s':>7} {'tok/s':>7} {'tok/cpu-s':>9} {'wall s':>6} "
          f"{'peak MiB':>8} {'load':>4} {'eval loss':>9}")


def fmt_row(r: dict) -> str:
    if "error" in r:
        return f"{r['name']:<23} FAILED: {r['error']}"
    cpu = f"{r['tokens_per_cpu_s']:>9,.0f}" if r.get("tokens_per_cpu_s") else f"{'-':>9}"
    return (f"{r['name']:<23} {r['steps']:>5} {r['tokens']:>8,} {r['train_s']:>7.1f} {r['tokens_per_s']:>7,.0f} {cpu} "
            f"{r['wall_s']:>6.1f} {peak_memory(r) / 2**20:>8,.0f} {r['load_before']:>4.1f} "
            f"{r.get('eval_loss', float('nan')):>9.4f}")


def report(pair_name: str, title: str, names: list[str], results: dict) -> list[dict]:
    """The pair's table, then trainforge (the last name) against each other run."""
    print(f"\n{title}\n{HEADER}")
    for n in names:
        print(fmt_row(results[n]))
    tf = results.get(names[-1]) if names else None
    comparisons = []
    if not tf or "error" in tf or names[-1] not in ("trainforge-blocks", "trainforge-sft"):
        return comparisons
    for n in names[:-1]:
        base = results[n]
        if "error" in base:
            continue
        c = {
            "pair": pair_name,
            "trainforge": names[-1],
            "baseline": n,
            "tokens_per_s_ratio": tf["tokens_per_s"] / base["tokens_per_s"],
            "target_tokens_per_s_ratio": TARGETS.get(n),
            "wall_speedup": base["wall_s"] / tf["wall_s"],
            "peak_memory_ratio": peak_memory(tf) / peak_memory(base),
            "eval_loss_trainforge": tf.get("eval_loss"),
            "eval_loss_baseline": base.get("eval_loss"),
        }
        c["eval_loss_rel_diff"] = (c["eval_loss_trainforge"] - c["eval_loss_baseline"]) / c["eval_loss_baseline"]
        target = c["target_tokens_per_s_ratio"]
        c["meets"] = {
            "tokens_per_s": None if target is None else c["tokens_per_s_ratio"] >= target,
            "peak_memory": c["peak_memory_ratio"] <= 1.0,
            "eval_loss": c["eval_loss_rel_diff"] <= MAX_EVAL_LOSS_REL,
        }
        comparisons.append(c)

        def ok(b):
            return "ok" if b else "MISSED"

        if target is None:  # an informational run: numbers only, no verdicts
            c["meets"] = None
            print(f"  trainforge vs {n} (informational): tokens/s {c['tokens_per_s_ratio']:.2f}x | whole job "
                  f"{c['wall_speedup']:.2f}x faster | peak memory {c['peak_memory_ratio']:.2f}x | eval loss "
                  f"{c['eval_loss_trainforge']:.4f} vs {c['eval_loss_baseline']:.4f} ({c['eval_loss_rel_diff']:+.2%})")
            continue
        print(f"  trainforge vs {n}: tokens/s {c['tokens_per_s_ratio']:.2f}x (target >= {target}x: "
              f"{ok(c['meets']['tokens_per_s'])}) | whole job {c['wall_speedup']:.2f}x faster | peak memory "
              f"{c['peak_memory_ratio']:.2f}x ({ok(c['meets']['peak_memory'])}) | eval loss {c['eval_loss_trainforge']:.4f} "
              f"vs {c['eval_loss_baseline']:.4f} ({c['eval_loss_rel_diff']:+.2%}, {ok(c['meets']['eval_loss'])})")
    return comparisons


def legend(args: argparse.Namespace, columns: str) -> str:
    """The line under a results table: the machine and rounds, the benchmark's own ``columns``, then the
    columns every side-by-side benchmark shares."""
    rounds = f", medians of {args.repeat} rounds" if args.repeat > 1 else ""
    return (f"\n{os.cpu_count()} cores, {args.threads} threads per run, runs one after another{rounds}. {columns}; "
            "wall: the whole job (imports, data preparation from cold caches, model load, training, saving); peak: "
            f"process peak RSS; load: 1-min load average when the run started (above {args.threads}: other work shared "
            "the cores); eval: one function, fp32, the same held-out rows")


def add_common_arguments(ap: argparse.ArgumentParser) -> None:
    """--repeat, --threads, --workdir, --out, and the hidden arguments a child run is started with."""
    ap.add_argument("--repeat", type=int, default=1, help="rounds over all runs (interleaved); timings are medians")
    ap.add_argument("--threads", type=int, default=2, help="torch/OMP threads of every run")
    ap.add_argument("--workdir", type=Path, default=None, help="keep inputs, runs and logs here (default: a temp dir, removed)")
    ap.add_argument("--out", type=Path, default=None, help="write all settings and results as JSON")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)


def start_session(args: argparse.Namespace, prefix: str) -> Path:
    """The parent's set-up: offline, transformers quiet, ``--threads`` torch threads; the work directory
    (``--workdir``, else a new temporary one, which the caller removes)."""
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    work = args.workdir or Path(tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    return work


def end_session(args: argparse.Namespace, started: float, **record) -> None:
    """Print the benchmark's total time and, with ``--out``, write ``record`` (settings, runs, comparisons, ...) as
    JSON with the total and the command."""
    total = time.perf_counter() - started
    print(f"\nbenchmark total {total:.0f}s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**record, "total_s": total, "command": sys.argv}, indent=2, default=str))


def run_rounds(names: list[str], repeat: int, run_one) -> dict[str, list[dict]]:
    """``repeat`` rounds, each running every one of ``names`` in turn (interleaved: a slow spell of the
    machine spreads over the runs); each run's results, round by round."""
    rounds: dict[str, list[dict]] = {n: [] for n in names}
    for k in range(repeat):
        if repeat > 1:
            print(f"round {k + 1} of {repeat}")
        for name in names:
            rounds[name].append(run_one(name))
    return rounds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny settings: a smoke check in about two minutes")
    ap.add_argument("--gpu", action="store_true", help="GPU sizes (~100M Llama, 1,024-token rows); peak = GPU reserved")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps of pair A (pretraining blocks)")
    ap.add_argument("--sft-rows", type=int, default=None, help="training rows of pair B (one epoch each)")
    ap.add_argument("--runs", default=",".join(RUNS),
                    help=f"comma-separated, in this order: {', '.join(RUNS)} (default); also {', '.join(EXTRA_B)}")
    add_common_arguments(ap)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.spec, args.result)
        return 0

    runs = known_runs(ap, args.runs, RUNS + EXTRA_B)
    work = start_session(args, "tf-compare-")
    started = time.perf_counter()
    try:
        import torch

        s = build_inputs(work, settings(args))
        spec = work / "spec.json"
        spec.write_text(json.dumps(s, indent=2))
        a, b = s["a"], s["b"]
        print(f"model: llama {s['model']}, vocab {s['vocab_size']}, {s['parameters'] / 1e6:.2f}M parameters; "
              f"{args.threads} threads per run; torch {torch.__version__}")
        print(f"A: {a['documents']} stdlib files, {a['steps']} steps x {a['batch_size']} blocks of {a['max_length']} tokens")
        print(f"B: {b['rows']} prompt/completion rows, one epoch, micro-batch {b['batch_size']}, max_length {b['max_length']}")
        rounds = run_rounds(runs, args.repeat, lambda name: run_child(name, spec, work, args.threads))
        results = {n: combine(rs) for n, rs in rounds.items()}

        print("evaluating every run's final weights with one function ...")
        order = {"a": [n for n in PAIR_A if n in results], "b": [n for n in PAIR_B_ALL if n in results]}
        for pair, names in order.items():
            todo = [n for n in names if "error" not in results[n]]
            if not todo:
                continue
            batches = eval_batches_for(s, pair, work)
            s[pair]["eval_tokens"] = sum(int((bt.labels != -100).sum()) for bt in batches)
            s[pair]["eval_loss_initial"] = eval_loss(s["paths"]["model_dir"], batches)
            for n in todo:
                results[n]["eval_loss"] = eval_loss(results[n]["final_dir"], batches)

        print(legend(args, "tokens: real (non-pad) input tokens trained; tok/s: over the training loop; tok/cpu-s: over "
                           "its process CPU time"))
        comparisons = []
        if order["a"]:
            comparisons += report("a", f"A. pretraining blocks, {a['steps']} steps x {a['batch_size']} x {a['max_length']} "
                                       f"(eval: {a['eval_tokens']:,} held-out tokens, initial loss "
                                       f"{a['eval_loss_initial']:.4f})" if "eval_tokens" in a else "A. pretraining blocks",
                                  order["a"], results)
        if order["b"]:
            comparisons += report("b", f"B. prompt/completion, one epoch over {b['rows']} rows, micro-batch {b['batch_size']}, "
                                       f"max_length {b['max_length']} (eval: {b['eval_tokens']:,} held-out completion "
                                       f"tokens, initial loss {b['eval_loss_initial']:.4f})" if "eval_tokens" in b
                                  else "B. prompt/completion", order["b"], results)
        end_session(args, started, settings=s, runs=results, comparisons=comparisons)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
