"""Side by side: trainforge against Hugging Face `Seq2SeqTrainer` on encoder-decoder models, one command.

    python benchmarks/compare_seq2seq.py [--quick] [--arch t5,bart] [--rows N] [--epochs N]
                                         [--runs NAME,NAME] [--repeat N] [--threads 2] [--workdir DIR] [--out r.json]

On 2 quiet CPU cores the default takes about 2 minutes and --repeat 3 about 4 (250 s); on the same
cores shared with other work (1-minute load average 7 to 9.5) the default took 19 minutes and its
figures moved by up to 3x between rounds. Timings are only as clean as the machine: check the load
column, compare the per-CPU-second column, and use --repeat 3 for medians (--threads 1 suffers
least from a busy machine).

Per architecture (T5: relative attention, gated-GELU feed-forward as in T5 v1.1 / Flan-T5, the
head shared with the embeddings and its input scaled by d_model**-0.5 as in the original T5, the
layout whose random init starts at a sane loss; BART: learned positions, tied head, final_logits_bias), one small model built here from seeded
random weights and saved once, so every run starts from identical weights, with a tokenizer trained
once on the training rows in that architecture's layout (T5: ``$A </s>``; BART: ``<s> $A </s>``).
Data: documented functions of the Python standard library (``builtin:python-functions``): source
= signature and docstring, target = body, written once to a JSONL of ``{"source", "target"}`` rows
that every run reads; held-out rows are distinct pairs. Each side truncates a source at ``max_length``
and a target at ``max_target_length`` tokens, keeping the final ``</s>`` (the tokenizer's own
truncation on the HF side; the same token counts on both sides are checked and printed).

Runs (each in its own subprocess, one after another, all with the same thread count):
- ``hf-<arch>``: `transformers.Seq2SeqTrainer` as its documentation sets it up: the rows tokenized with
  ``datasets.map`` (``tokenizer(source, truncation=True)``, ``text_target=target``),
  ``DataCollatorForSeq2Seq(tokenizer, model)`` (pads each batch to its longest row; the model makes
  ``decoder_input_ids`` from the labels), its default random sampler, fp32.
- ``hf-<arch>-grouped`` (``--runs``, not in the default list): the same with
  ``train_sampling_strategy="group_by_length"`` and ``pad_to_multiple_of=8``: HF batched the way
  trainforge batches, which separates the batching from the rest of the engine.
- ``trainforge-<arch>``: trainforge, its defaults for encoder-decoder models (rows grouped by length,
  padded to a multiple of 8; the fused chunked head and cross-entropy), ``precision: fp32``.

Hyperparameters are equal everywhere: AdamW (lr, betas, eps), weight decay 0 (see below), cosine decay
to ``min_lr_ratio`` x lr without warmup (the two schedules are then identical step for step),
global-norm clipping, seed, micro-batch size, epochs, no checkpoints, no in-training eval, dropout 0 in
the model configs. Weight decay is 0 because the two trainers exempt different parameters from it: HF
exempts every parameter whose name contains "bias" (T5's relative attention bias, a matrix), trainforge
exempts vectors (norms, biases); with 0 both optimizers are the same.

Measured per run:
- target tokens/s: real target tokens (the labels the loss is taken over, EOS included) trained /
  training-loop time (and per CPU-second: over the loop's process CPU time, which other work on a
  shared machine disturbs less). For HF a forward pre-hook counts ``labels != -100`` in every training forward and
  a callback times ``on_train_begin`` .. ``on_train_end``; for trainforge the target tokens of every
  optimizer step are counted as the step is taken, over its own loop time (the same definition).
- all tokens/s: the same with source tokens added (real encoder tokens + decoder tokens).
- wall: the whole job in that process, from before importing torch to the saved final weights
  (data preparation from cold caches included).
- peak memory: peak RSS of the run's process.
- eval loss: after training, the parent loads each run's final weights (``AutoModelForSeq2SeqLM``) and
  evaluates them with one function (target-token-weighted mean cross-entropy, fp32) on the same
  held-out rows.

fp32 on both sides: this CPU (AVX2, no native bf16) computes bf16 matmuls several times slower than
fp32, and trainforge's ``precision: auto`` picks fp32 here too. Needs the bench extra
(pip install 'trainforge[bench]': datasets). No network: HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

# the same machinery; compare_hf's module level imports the standard library only, and its T_START (a child's
# whole-job clock, read by run_in_child) starts here, before torch / transformers are imported
from compare_hf import (  # noqa: E402
    end_session,
    Counter,
    add_common_arguments,
    combine,
    function_pairs,
    hf_common_args,
    known_runs,
    launch_child,
    legend,
    run_in_child,
    run_rounds,
    start_session,
    train_timed,
    write_jsonl,
)

ARCHS = ("t5", "bart")


def run_names(arch: str) -> tuple[str, str, str]:
    return f"hf-{arch}", f"hf-{arch}-grouped", f"trainforge-{arch}"


def settings(args: argparse.Namespace) -> dict:
    """Sizes of models and data: the default, or --quick for a smoke check."""
    if args.quick:
        s = {
            "t5": {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4},
            "bart": {"d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
                     "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128},
            "vocab_size": 512,
            "data": {"rows": 48, "eval_rows": 16, "max_length": 64, "max_target_length": 64, "batch_size": 8, "epochs": 1},
        }
    else:
        s = {
            # 3 + 3 layers of width 128 (T5: gated-GELU feed-forward 512; BART: feed-forward 512), a 4k-token vocabulary
            "t5": {"d_model": 128, "d_kv": 32, "d_ff": 512, "num_layers": 3, "num_decoder_layers": 3, "num_heads": 4},
            "bart": {"d_model": 128, "encoder_layers": 3, "decoder_layers": 3, "encoder_attention_heads": 4,
                     "decoder_attention_heads": 4, "encoder_ffn_dim": 512, "decoder_ffn_dim": 512},
            "vocab_size": 4096,
            "data": {"rows": 256, "eval_rows": 64, "max_length": 96, "max_target_length": 96, "batch_size": 16, "epochs": 2},
        }
    if args.rows:
        s["data"]["rows"] = args.rows
    if args.epochs:
        s["data"]["epochs"] = args.epochs
    s["optim"] = {"lr": 1.0e-3, "min_lr_ratio": 0.1, "warmup_steps": 0, "weight_decay": 0.0, "betas": [0.9, 0.999],
                  "eps": 1.0e-8, "max_grad_norm": 1.0}
    s["seed"] = 0
    s["threads"] = args.threads
    return s


# ---------------------------------------------------------------- shared inputs (built once, untimed)


def build_inputs(work: Path, s: dict, archs: list[str]) -> dict:
    """The JSONL of source/target rows, and per architecture a tokenizer and the initial weights."""
    d = s["data"]
    rows = [{"source": p, "target": t} for p, t in function_pairs(d["rows"] + d["eval_rows"])]
    write_jsonl(work / "train.jsonl", rows[: d["rows"]])
    write_jsonl(work / "eval.jsonl", rows[d["rows"] :])
    texts = [t for r in rows[: d["rows"]] for t in (r["source"], r["target"])]
    s["paths"] = {"work": str(work), "train": str(work / "train.jsonl"), "eval": str(work / "eval.jsonl")}
    for arch in archs:
        model_dir = work / f"init-{arch}"
        s[f"{arch}_parameters"] = save_initial_model(arch, model_dir, build_tokenizer(arch, texts, s["vocab_size"]), s)
        s["paths"][f"{arch}_model"] = str(model_dir)
    return s


def build_tokenizer(arch: str, texts: list[str], vocab_size: int):
    """Byte-level BPE trained on the rows, in the architecture's layout of special tokens: T5 pad 0,
    EOS 1, UNK 2, inputs ending with EOS; BART BOS 0, pad 1, EOS 2, UNK 3, inputs wrapped in BOS ... EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "</s>", "<unk>"] if arch == "t5" else ["<s>", "<pad>", "</s>", "<unk>"]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(texts, trainer=trainer)
    ids = {t: core.token_to_id(t) for t in specials}
    if arch == "t5":
        core.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", ids["</s>"])])
        return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    core.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")


def save_initial_model(arch: str, model_dir: Path, tok, s: dict) -> int:
    import torch
    from transformers import AutoModelForSeq2SeqLM, BartConfig, T5Config

    if arch == "t5":  # gated GELU; the head shares the embeddings and scales its input by d_model**-0.5
        config = T5Config(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                          decoder_start_token_id=tok.pad_token_id, feed_forward_proj="gated-gelu", dropout_rate=0.0, **s["t5"])
    else:
        config = BartConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
                            eos_token_id=tok.eos_token_id, decoder_start_token_id=tok.eos_token_id,
                            forced_eos_token_id=tok.eos_token_id, max_position_embeddings=s["data"]["max_length"] + 8,
                            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, **s["bart"])
    torch.manual_seed(s["seed"])
    model = AutoModelForSeq2SeqLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    return sum(p.numel() for p in model.parameters())


def trainforge_config(s: dict, arch: str, cache_dir: Path) -> dict:
    """trainforge's config: only what both sides must agree on; everything else its defaults."""
    p, o, d = s["paths"], s["optim"], s["data"]
    return {
        "model": {"path": p[f"{arch}_model"]},
        "data": {"train": p["train"], "eval": None, "max_length": d["max_length"], "max_target_length": d["max_target_length"],
                 "cache_dir": str(cache_dir)},
        "train": {"epochs": d["epochs"], "micro_batch_size": d["batch_size"], "precision": "fp32", "seed": s["seed"]},
        "optim": {"lr": o["lr"], "weight_decay": o["weight_decay"], "betas": o["betas"], "eps": o["eps"], "schedule": "cosine",
                  "warmup_steps": o["warmup_steps"], "min_lr_ratio": o["min_lr_ratio"], "max_grad_norm": o["max_grad_norm"]},
        "checkpoint": {"every_minutes": None},  # the HF runs save no checkpoints either (save_strategy="no")
        "log": {"report": False, "report_to": []},
    }


# ---------------------------------------------------------------- children: one run each


def child(name: str, spec_path: Path, result_path: Path) -> None:
    arch = name.split("-")[1]
    run_in_child(spec_path, result_path, name, lambda s, out: run_trainforge(s, arch, out) if name.startswith("trainforge")
                 else run_hf(s, arch, out, grouped=name.endswith("grouped")))


def run_trainforge(s: dict, arch: str, out: Path) -> dict:
    import yaml

    import trainforge.engine.trainer as trainer_module
    from trainforge.config.run import load_config

    (out / "config.yaml").write_text(yaml.safe_dump(trainforge_config(s, arch, out / "cache"), sort_keys=False))
    cfg = load_config(out / "config.yaml")
    counted = {"targets": 0, "source": 0}
    step = trainer_module.forward_backward_adaptive

    def counting_step(run, micro_batches, *args, **kwargs):  # the target and source tokens of every step taken
        counted["targets"] += sum(mb.n_targets for mb in micro_batches)
        counted["source"] += sum(int(mb.attention_mask.sum()) for mb in micro_batches)
        return step(run, micro_batches, *args, **kwargs)

    trainer_module.forward_backward_adaptive = counting_step
    sm, cpu_s = train_timed(cfg, out / "run")
    return {
        "steps": sm["steps"],
        "target_tokens": counted["targets"],
        "all_tokens": counted["targets"] + counted["source"],
        "trainforge_tokens": sm["tokens"],  # its own count (source + decoder inputs): equals all_tokens
        "train_s": sm["train_time_s"],
        "train_cpu_s": cpu_s,
        "final_train_loss": sm["final_train_loss"],
        "final_dir": sm["final_dir"],
        "precision": sm["precision"],
        "epoch_target_tokens": sm["data"]["train_target_tokens"],
        "padding_efficiency": sm["data"].get("row_efficiency"),
        "settings": cfg.model_dump(mode="json"),
    }


class TargetCounter(Counter):
    """Target tokens (labels != -100) and real source tokens of every training forward; the loop's clock
    (compare_hf's callback)."""

    def __init__(self):
        super().__init__(pad_id=None)
        self.targets = self.source = 0

    def hook(self, module, args, kwargs):
        import torch

        if module.training and torch.is_grad_enabled():
            self.targets += int((kwargs["labels"] != -100).sum())
            self.source += int(kwargs["attention_mask"].sum())
            self.forwards += 1


def run_hf(s: dict, arch: str, out: Path, grouped: bool) -> dict:
    """Seq2SeqTrainer as the HF translation / summarization examples set it up."""
    import datasets
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments

    datasets.disable_progress_bars()
    p, d = s["paths"], s["data"]
    tok = AutoTokenizer.from_pretrained(p[f"{arch}_model"])
    raw = datasets.load_dataset("json", data_files=p["train"], split="train", cache_dir=str(out / "hf-cache"))

    def preprocess(batch):
        enc = tok(batch["source"], max_length=d["max_length"], truncation=True)
        enc["labels"] = tok(text_target=batch["target"], max_length=d["max_target_length"], truncation=True)["input_ids"]
        return enc

    ds = raw.map(preprocess, batched=True, remove_columns=raw.column_names)
    counter = TargetCounter()
    model = AutoModelForSeq2SeqLM.from_pretrained(p[f"{arch}_model"])  # fp32 as saved, sdpa
    model.register_forward_pre_hook(counter.hook, with_kwargs=True)
    args = Seq2SeqTrainingArguments(  # lr, cosine to a floor, AdamW, clipping, seed, no saves: compare_hf's
        **hf_common_args(s, out),
        per_device_train_batch_size=d["batch_size"],
        num_train_epochs=d["epochs"],
        **({"train_sampling_strategy": "group_by_length"} if grouped else {}),
    )
    collator = DataCollatorForSeq2Seq(tok, model=model, pad_to_multiple_of=8 if grouped else None)
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=ds, data_collator=collator, processing_class=tok,
                             callbacks=[counter.callback()])
    result = trainer.train()
    trainer.save_model(str(out / "final"))
    return {
        "steps": trainer.state.global_step,
        "target_tokens": counter.targets,
        "all_tokens": counter.targets + counter.source,
        "train_s": counter.t1 - counter.t0,
        "train_cpu_s": counter.cpu1 - counter.cpu0,
        "final_train_loss": result.training_loss,
        "final_dir": str(out / "final"),
        "precision": "fp32" if not (args.bf16 or args.fp16) else ("bf16" if args.bf16 else "fp16"),
        "epoch_target_tokens": sum(len(x) for x in ds["labels"]),
        "settings": {k: str(v) for k, v in args.to_dict().items()},
        "optim": str(args.optim),
        "attention": model.config._attn_implementation,
    }


# ---------------------------------------------------------------- the one eval, in the parent


def eval_batches_for(s: dict, arch: str, work: Path) -> list:
    """Held-out rows as source -> target batches, tokenized and cut by one pipeline for every run."""
    import numpy as np

    from trainforge.config.data import DataSettings
    from trainforge.data.loader import eval_batches
    from trainforge.data.packing import build_rows
    from trainforge.data.prepare import prepare_data
    from trainforge.data.seq2seq import Seq2SeqCollator
    from trainforge.model.tokenizer import load_tokenizer
    from transformers import AutoConfig

    d, model_dir = s["data"], s["paths"][f"{arch}_model"]
    tok = load_tokenizer(model_dir)
    data = DataSettings(train=s["paths"]["eval"], eval=None, max_length=d["max_length"], max_target_length=d["max_target_length"],
                        packing=False, cache_dir=work / "eval-cache" / arch, num_workers=1)
    store = prepare_data(data, tok, seed=0, log=lambda *_: None, seq2seq=True).train
    rows = build_rows(store, np.arange(len(store)), False, d["max_length"])
    start = AutoConfig.from_pretrained(model_dir).decoder_start_token_id
    return eval_batches(rows, Seq2SeqCollator(store, tok.pad_token_id, start, d["max_length"]), d["batch_size"])


def eval_loss(model_dir: str, batches: list) -> float:
    """Target-token-weighted mean cross-entropy of the decoder's predictions, fp32, no autocast."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForSeq2SeqLM

    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for b in batches:
            logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, decoder_input_ids=b.decoder_input_ids,
                           use_cache=False).logits.float()
            total += float(F.cross_entropy(logits.flatten(0, 1), b.labels.flatten(), ignore_index=-100, reduction="sum"))
            n += int((b.labels != -100).sum())
    return total / n


# ---------------------------------------------------------------- the parent


def run_child(name: str, spec: Path, work: Path, threads: int) -> dict:
    r = launch_child(__file__, name, spec, work, threads)
    if "error" in r:
        return r
    r["target_tokens_per_s"] = r["target_tokens"] / r["train_s"]
    r["all_tokens_per_s"] = r["all_tokens"] / r["train_s"]
    r["target_tokens_per_cpu_s"] = r["target_tokens"] / r["train_cpu_s"]
    print(f"  {name}: {r['steps']} steps, {r['target_tokens']:,} target tokens in {r['train_s']:.1f}s "
          f"({r['target_tokens_per_s']:,.0f}/s), wall {r['wall_s']:.1f}s, peak RSS {r['peak_rss_bytes'] / 2**20:,.0f} MiB, "
          f"load {r['load_before']:.1f} -> {r['load_after']:.1f}", flush=True)
    return r


TIMINGS = ("target_tokens_per_s", "all_tokens_per_s", "target_tokens_per_cpu_s", "train_s", "wall_s", "peak_rss_bytes",
           "load_before")


HEADER = (f"{'run':<20} {'steps':>5} {'targets':>8} {'train s':>7} {'tgt tok/s':>9} {'all tok/s':>9} {'tgt/cpu-s':>9} "
          f"{'wall s':>6} {'peak MiB':>8} {'load':>4} {'eval loss':>9}")


def fmt_row(r: dict) -> str:
    if "error" in r:
        return f"{r['name']:<20} FAILED: {r['error']}"
    return (f"{r['name']:<20} {r['steps']:>5} {r['target_tokens']:>8,} {r['train_s']:>7.1f} {r['target_tokens_per_s']:>9,.0f} "
            f"{r['all_tokens_per_s']:>9,.0f} {r['target_tokens_per_cpu_s']:>9,.0f} {r['wall_s']:>6.1f} {r['peak_rss_bytes'] / 2**20:>8,.0f} {r['load_before']:>4.1f} "
            f"{r.get('eval_loss', float('nan')):>9.4f}")


def compare(arch: str, names: list[str], results: dict) -> list[dict]:
    """trainforge (the last name) against each HF run: ratios trainforge / HF."""
    tf = results.get(names[-1])
    out = []
    if not tf or "error" in tf:
        return out
    for n in names[:-1]:
        base = results[n]
        if "error" in base:
            continue
        c = {
            "arch": arch,
            "baseline": n,
            "target_tokens_per_s_ratio": tf["target_tokens_per_s"] / base["target_tokens_per_s"],
            "target_tokens_per_cpu_s_ratio": tf["target_tokens_per_cpu_s"] / base["target_tokens_per_cpu_s"],
            "wall_ratio": tf["wall_s"] / base["wall_s"],
            "peak_rss_ratio": tf["peak_rss_bytes"] / base["peak_rss_bytes"],
            "eval_loss_trainforge": tf["eval_loss"],
            "eval_loss_baseline": base["eval_loss"],
            "eval_loss_rel_diff": (tf["eval_loss"] - base["eval_loss"]) / base["eval_loss"],
            "same_target_tokens": tf["target_tokens"] == base["target_tokens"],
        }
        out.append(c)
        print(f"  trainforge-{arch} / {n}: target tokens/s {c['target_tokens_per_s_ratio']:.2f}x (per CPU-second "
              f"{c['target_tokens_per_cpu_s_ratio']:.2f}x) | whole job "
              f"{c['wall_ratio']:.2f}x the time | peak RSS {c['peak_rss_ratio']:.2f}x | eval loss {c['eval_loss_trainforge']:.4f} "
              f"vs {c['eval_loss_baseline']:.4f} ({c['eval_loss_rel_diff']:+.2%})"
              + ("" if c["same_target_tokens"] else f" | NOTE: target tokens differ ({tf['target_tokens']:,} vs {base['target_tokens']:,})"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny models and data: a smoke check")
    ap.add_argument("--arch", default=",".join(ARCHS), help="t5, bart or both (default: t5,bart)")
    ap.add_argument("--runs", default=None, help="comma-separated run names (default: hf-ARCH,trainforge-ARCH per --arch; "
                                                 "also hf-ARCH-grouped)")
    ap.add_argument("--rows", type=int, default=None, help="training rows")
    ap.add_argument("--epochs", type=int, default=None, help="epochs over the training rows")
    add_common_arguments(ap)  # --repeat, --threads, --workdir, --out
    args = ap.parse_args()
    if args.child:
        child(args.child, args.spec, args.result)
        return 0

    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    if not archs or set(archs) - set(ARCHS):
        ap.error(f"--arch {args.arch!r}: choose from {', '.join(ARCHS)}")
    known = [n for a in archs for n in run_names(a)]
    if args.runs:
        runs = known_runs(ap, args.runs, tuple(known))
    else:
        runs = [n for a in archs for n in run_names(a) if not n.endswith("grouped")]
    work = start_session(args, "tf-compare-seq2seq-")  # offline, --threads, the work directory
    started = time.perf_counter()
    try:
        import torch

        s = build_inputs(work, settings(args), archs)
        spec = work / "spec.json"
        spec.write_text(json.dumps(s, indent=2))
        d = s["data"]
        for a in archs:
            print(f"{a}: {s[a]}, vocab {s['vocab_size']}, {s[f'{a}_parameters'] / 1e6:.2f}M parameters")
        print(f"data: {d['rows']} stdlib functions (signature + docstring -> body), {d['epochs']} epochs, micro-batch "
              f"{d['batch_size']}, source <= {d['max_length']} and target <= {d['max_target_length']} tokens; fp32; "
              f"{args.threads} threads per run; torch {torch.__version__}", flush=True)
        rounds = run_rounds(runs, args.repeat, lambda name: run_child(name, spec, work, args.threads))
        results = {n: combine(rs, TIMINGS, (*TIMINGS, "load_after", "error")) for n, rs in rounds.items()}

        print("evaluating every run's final weights with one function ...", flush=True)
        for a in archs:
            names = [n for n in run_names(a) if n in results and "error" not in results[n]]
            if not names:
                continue
            batches = eval_batches_for(s, a, work)
            s[f"{a}_eval_targets"] = sum(int((b.labels != -100).sum()) for b in batches)
            s[f"{a}_eval_loss_initial"] = eval_loss(s["paths"][f"{a}_model"], batches)
            for n in names:
                results[n]["eval_loss"] = eval_loss(results[n]["final_dir"], batches)

        print(legend(args, "targets: real target tokens trained (labels, EOS included); tgt tok/s: those over the training "
                           "loop; all tok/s: source + target tokens over it; tgt/cpu-s: target tokens over the loop's process "
                           "CPU time (less sensitive to other work on the machine)"))
        comparisons = []
        for a in archs:
            names = [n for n in run_names(a) if n in results]
            if not names:
                continue
            extra = (f" (eval: {s[f'{a}_eval_targets']:,} held-out target tokens, initial loss "
                     f"{s[f'{a}_eval_loss_initial']:.4f})") if f"{a}_eval_targets" in s else ""
            print(f"\n{a}: {s[f'{a}_parameters'] / 1e6:.2f}M parameters{extra}\n{HEADER}")
            for n in names:
                print(fmt_row(results[n]))
            if names[-1] == f"trainforge-{a}":
                comparisons += compare(a, names, results)
        end_session(args, started, settings=s, runs=results, comparisons=comparisons)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
