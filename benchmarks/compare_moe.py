"""Side by side: trainforge against HF `Trainer` (and TRL `SFTTrainer` + PEFT) on a small Qwen3-MoE, one command.

    python benchmarks/compare_moe.py [--quick] [--steps N] [--sft-rows N] [--hf-best grouped_mm] [--runs NAME,NAME]
                                     [--precision bf16|fp32] [--repeat N] [--threads 2] [--workdir DIR]
                                     [--out results.json]

One Qwen3-MoE shape built here from seeded random weights and saved once (every run starts from the same
weights): 16 experts, top-2 per token, 4 layers, hidden 256 (experts of 256, 4 heads of 64, 2 key-value heads),
every layer routed, ``router_aux_loss_coef`` 0.001 (Qwen3-MoE's default); a byte-level BPE trained once on the
corpus. All runs compute in bf16 on the CPU (autocast over fp32 master weights, both sides); ``--precision fp32``:
in fp32 on both sides (``bf16=False``), for a CPU without native bf16, where a bf16 GEMM is emulated on one core and
the emulation, not either trainer, takes most of each step.

Full fine-tune on pretraining blocks (standard-library source files joined and cut into blocks of
``max_length`` tokens, labels = inputs; the HF side prepares them the ``run_clm.py`` way, trainforge with
``data.packing: concat``), the same steps of the same batch size, so the same tokens:
- ``hf-eager``: ``transformers.Trainer``, ``bf16=True`` (fp32: ``False``), the model loaded with ``experts_implementation="eager"``
  (a Python loop over the experts hit); cross-entropy only (``output_router_logits`` off, HF's default).
- ``hf-best``: the same with HF's best experts implementation on this CPU, ``--hf-best`` (default
  ``grouped_mm``: tokens sorted by expert, a loop of GEMMs; transformers' own default, and 1.6x faster than
  eager over a 16-expert layer's forward and backward on this CPU, docs/models.md).
- ``hf-router``: ``hf-best`` with ``output_router_logits=True``: its loss adds ``router_aux_loss_coef x`` the
  load-balancing loss, the objective trainforge trains by default (``model.router_aux_loss: true``).
- ``trainforge-moe``: trainforge, ``precision: bf16`` (or ``fp32``), its defaults otherwise (``experts_implementation: auto``,
  the router aux loss on, the fused chunked head).
LoRA on prompt/completion rows (documented stdlib functions: signature + docstring -> body; loss on the
completion; one epoch over the same rows), adapters on attention (q, k, v, o) and on the experts' 3-D weights
(``gate_up_proj``, ``down_proj``: PEFT's ``target_parameters``) with the same rank, alpha and dropout 0:
- ``trl-lora`` (when trl is importable): ``trl.SFTTrainer`` with a ``peft_config``, ``SFTConfig`` defaults
  otherwise (TRL's own bf16=True, False under ``--precision fp32``, and gradient_checkpointing=True), ``output_router_logits=True``.
- ``trainforge-lora``: ``model.method: lora``, ``precision: bf16`` (or ``fp32``), its defaults otherwise (packing on).

Hyperparameters equal everywhere: AdamW (lr, betas, eps, weight decay), cosine to ``min_lr_ratio`` x lr
without warmup, clipping, seed, micro-batch size, max length; no checkpoints, no in-training eval.

Measured per run (each its own subprocess, one after another, the same thread count), as compare_hf.py:
tokens/s (real input tokens over the training loop; a forward pre-hook counts them on the HF side), wall
(the whole job), peak memory (process peak RSS), and the loss at equal tokens: after training the parent
evaluates every run's final weights (LoRA: base + adapters) with one function, fp32, on the same held-out rows.
Targets (issue 45): tokens/s >= 4x hf-eager and >= 2x HF's best implementation (hf-best, hf-router); peak
memory <= 0.7x each HF run's; eval loss within 1% of hf-router's (the same objective; hf-eager's and hf-best's
train cross-entropy alone and are shown for information); LoRA tokens/s >= 3x trl-lora.

Needs the bench extra (pip install 'trainforge[bench]'; trl and peft for the LoRA pair). No network.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

# compare_hf's module level imports the standard library only; its T_START (a child's whole-job clock, read
# by run_in_child) starts here, before torch / transformers are imported
from compare_hf import (  # noqa: E402
    end_session,
    HEADER,
    Counter,
    add_common_arguments,
    build_inputs,
    combine,
    eval_batches_for,
    finish_hf,
    fmt_row,
    hf_common_args,
    known_runs,
    launch_child,
    legend,
    peak_memory,
    run_in_child,
    run_rounds,
    start_session,
    train_timed,
)

FULL = ("hf-eager", "hf-best", "hf-router", "trainforge-moe")
LORA = ("trl-lora", "trainforge-lora")
RUNS = FULL + LORA
TARGETS = {  # issue 45: trainforge's tokens/s over the baseline's, its peak memory over the baseline's, eval loss
    "hf-eager": {"tokens_per_s": 4.0, "peak_memory": 0.7},
    "hf-best": {"tokens_per_s": 2.0, "peak_memory": 0.7},
    "hf-router": {"tokens_per_s": 2.0, "peak_memory": 0.7, "eval_loss": 0.01},
    "trl-lora": {"tokens_per_s": 3.0},
}
LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA_EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]  # PEFT target_parameters, as trainforge resolves them


def settings(args: argparse.Namespace) -> dict:
    """Sizes: the benchmark's Qwen3-MoE shape, or --quick for a smoke check (the same 16 experts, top-2)."""
    moe = {"num_experts": 16, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001}
    if args.quick:
        s = {"model": {**moe, "hidden_size": 64, "moe_intermediate_size": 64, "intermediate_size": 128,
                       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
             "vocab_size": 512,
             "a": {"documents": 6, "eval_documents": 2, "max_length": 64, "batch_size": 2, "steps": 2},
             "b": {"rows": 8, "eval_rows": 4, "max_length": 96, "batch_size": 4},
             "eval_max_batches": 2}
    else:
        s = {"model": {**moe, "hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 768,
                       "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64},
             "vocab_size": 4096,
             "a": {"documents": 60, "eval_documents": 8, "max_length": 256, "batch_size": 8, "steps": 20},
             "b": {"rows": 200, "eval_rows": 64, "max_length": 256, "batch_size": 4},
             "eval_max_batches": 16}
    if args.steps:
        s["a"]["steps"] = args.steps
    if args.sft_rows:
        s["b"]["rows"] = args.sft_rows
    s["optim"] = {"lr": 1.0e-3, "min_lr_ratio": 0.1, "warmup_steps": 0, "weight_decay": 0.1, "betas": [0.9, 0.95],
                  "eps": 1.0e-8, "max_grad_norm": 1.0}  # no warmup: HF's and trainforge's cosine then agree step for step
    s["lora"] = {"r": 16, "alpha": 32}
    s["hf_best"] = args.hf_best
    s["precision"] = args.precision
    s["seed"], s["threads"], s["gpu"] = 0, args.threads, False
    return s


# ---------------------------------------------------------------- shared inputs (built once, untimed)


def save_moe(model_dir: Path, tok, s: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=len(tok), max_position_embeddings=2048, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, tie_word_embeddings=False,
                            **s["model"])
    torch.manual_seed(s["seed"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    s["parameters"] = sum(p.numel() for p in model.parameters())
    s["active_parameters"] = s["parameters"] - experts + experts * s["model"]["num_experts_per_tok"] // s["model"]["num_experts"]


def trainforge_config(s: dict, name: str, cache_dir: Path) -> dict:
    """trainforge's config of a run: only what both sides must agree on; everything else its defaults."""
    p, o = s["paths"], s["optim"]
    if name == "trainforge-moe":
        model = {"path": p["model_dir"]}
        data = {"train": p["text_train"], "max_length": s["a"]["max_length"], "too_long": "split", "packing": "concat"}
        train = {"max_steps": s["a"]["steps"], "micro_batch_size": s["a"]["batch_size"]}
    else:
        model = {"path": p["model_dir"], "method": "lora",
                 "lora": {**s["lora"], "dropout": 0.0, "target_modules": LORA_MODULES + [e.split(".")[-1] for e in LORA_EXPERTS]}}
        data = {"train": p["sft_train"], "max_length": s["b"]["max_length"]}  # packing: true is the default
        train = {"epochs": 1, "micro_batch_size": s["b"]["batch_size"]}
    return {
        "model": model,
        "data": {**data, "eval": None, "cache_dir": str(cache_dir)},
        "train": {**train, "seed": s["seed"], "precision": s["precision"]},
        "optim": {k: o[k] for k in ("lr", "weight_decay", "betas", "eps", "warmup_steps", "min_lr_ratio", "max_grad_norm")}
        | {"schedule": "cosine"},
        "checkpoint": {"every_minutes": None},  # the HF runs save no checkpoints either (save_strategy="no")
        "log": {"report": False},
    }


# ---------------------------------------------------------------- children: one run each


def child(name: str, spec_path: Path, result_path: Path) -> None:
    def run(s: dict, out: Path) -> dict:
        if name.startswith("trainforge"):
            return run_trainforge(s, name, out)
        if name == "trl-lora":
            return run_trl_lora(s, out)
        return run_hf(s, out, experts="eager" if name == "hf-eager" else s["hf_best"], router=name == "hf-router")

    run_in_child(spec_path, result_path, name, run)


def run_trainforge(s: dict, name: str, out: Path) -> dict:
    import yaml

    from trainforge.config.run import load_config

    (out / "config.yaml").write_text(yaml.safe_dump(trainforge_config(s, name, out / "cache"), sort_keys=False))
    sm, cpu_s = train_timed(load_config(out / "config.yaml"), out / "run")
    return {"steps": sm["steps"], "tokens": sm["tokens"], "train_s": sm["train_time_s"], "train_cpu_s": cpu_s,
            "tokens_per_s": sm["tokens_per_s"], "precision": sm["precision"], "final_dir": sm["final_dir"],
            "final_train_loss": sm["final_train_loss"], "experts_implementation": sm.get("experts_implementation"),
            "data_stats": sm.get("data")}


def load_moe(s: dict, counter: Counter, experts: str, router: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(s["paths"]["model_dir"], experts_implementation=experts)
    model.config.output_router_logits = router  # on: the model's loss adds router_aux_loss_coef x the aux loss
    model.register_forward_pre_hook(counter.hook, with_kwargs=True)
    return model


def run_hf(s: dict, out: Path, experts: str, router: bool) -> dict:
    """HF Trainer on pretraining blocks (run_clm.py's data preparation), in the benchmark's precision on the CPU."""
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
        blocks = [joined[i : i + block] for i in range(0, len(joined) // block * block, block)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    ds = raw.map(tokenize, batched=True, remove_columns=raw.column_names).map(group_texts, batched=True)
    counter = Counter(tok.pad_token_id)
    model = load_moe(s, counter, experts, router)
    args = TrainingArguments(**hf_common_args(s, out), per_device_train_batch_size=a["batch_size"], max_steps=a["steps"],
                             bf16=s["precision"] == "bf16")
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[counter.callback()])
    r = finish_hf(trainer, counter, out, trainer.train())
    r.pop("settings", None)
    return {**r, "experts_implementation": experts, "output_router_logits": router, "precision": s["precision"]}


def run_trl_lora(s: dict, out: Path) -> dict:
    """TRL SFTTrainer with PEFT adapters on attention and the experts: SFTConfig defaults but what both sides share."""
    import datasets
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    datasets.disable_progress_bars()
    b, p = s["b"], s["paths"]
    tok = AutoTokenizer.from_pretrained(p["model_dir"])
    ds = datasets.load_dataset("json", data_files=p["sft_train"], split="train", cache_dir=str(out / "hf-cache"))
    counter = Counter(tok.pad_token_id)
    model = load_moe(s, counter, s["hf_best"], router=True)
    args = SFTConfig(**hf_common_args(s, out), per_device_train_batch_size=b["batch_size"], num_train_epochs=1,
                     max_length=b["max_length"], bf16=s["precision"] == "bf16")
    lora = LoraConfig(r=s["lora"]["r"], lora_alpha=s["lora"]["alpha"], lora_dropout=0.0, target_modules=LORA_MODULES,
                      target_parameters=LORA_EXPERTS, task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, peft_config=lora,
                         callbacks=[counter.callback()])
    r = finish_hf(trainer, counter, out, trainer.train())
    r.pop("settings", None)
    return {**r, "examples": len(ds), "bf16": args.bf16, "gradient_checkpointing": args.gradient_checkpointing,
            "precision": "bf16" if args.bf16 else "fp32", "experts_implementation": s["hf_best"], "output_router_logits": True}


# ---------------------------------------------------------------- the one eval, in the parent


def eval_loss(final_dir: str, batches: list) -> float:
    """Token-weighted mean next-token cross-entropy over the labelled tokens, fp32 (an adapter directory: its base
    with the adapters), the same function for every run."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    if (Path(final_dir) / "adapter_config.json").is_file():
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(final_dir, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(final_dir, dtype=torch.float32)
    model.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for b in batches:  # right padding under causal attention: pads affect nothing before them
            logits = model(input_ids=b.input_ids, use_cache=False).logits.float()
            total += float(F.cross_entropy(logits.flatten(0, 1), b.labels.flatten(), ignore_index=-100, reduction="sum"))
            n += int((b.labels != -100).sum())
    return total / n


def compare(results: dict) -> list[dict]:
    """trainforge's full run against each HF run, its LoRA run against TRL's: the ratios and the issue's targets."""
    out = []
    for name, base in results.items():
        tf = results.get("trainforge-lora" if name == "trl-lora" else "trainforge-moe")
        if name.startswith("trainforge") or "error" in base or not tf or "error" in tf:
            continue
        c = {"baseline": name, "trainforge": tf["name"], "tokens_per_s_ratio": tf["tokens_per_s"] / base["tokens_per_s"],
             "wall_speedup": base["wall_s"] / tf["wall_s"], "peak_memory_ratio": peak_memory(tf) / peak_memory(base),
             "eval_loss_trainforge": tf.get("eval_loss"), "eval_loss_baseline": base.get("eval_loss")}
        c["eval_loss_rel_diff"] = (c["eval_loss_trainforge"] - c["eval_loss_baseline"]) / c["eval_loss_baseline"]
        target = TARGETS.get(name, {})
        c["meets"] = {
            "tokens_per_s": c["tokens_per_s_ratio"] >= target["tokens_per_s"] if "tokens_per_s" in target else None,
            "peak_memory": c["peak_memory_ratio"] <= target["peak_memory"] if "peak_memory" in target else None,
            "eval_loss": abs(c["eval_loss_rel_diff"]) <= target["eval_loss"] if "eval_loss" in target else None,
        }
        verdict = "".join(f" ({k} {'ok' if v else 'MISSED'})" if v is not None else "" for k, v in c["meets"].items())
        print(f"  {tf['name']} vs {name}: tokens/s {c['tokens_per_s_ratio']:.2f}x | whole job {c['wall_speedup']:.2f}x "
              f"faster | peak memory {c['peak_memory_ratio']:.2f}x | eval loss {c['eval_loss_trainforge']:.4f} vs "
              f"{c['eval_loss_baseline']:.4f} ({c['eval_loss_rel_diff']:+.2%}){verdict}")
        out.append(c)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny settings: a smoke check in a couple of minutes")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps of the full fine-tune (pretraining blocks)")
    ap.add_argument("--sft-rows", type=int, default=None, help="training rows of the LoRA pair (one epoch)")
    ap.add_argument("--hf-best", default="grouped_mm", choices=("eager", "batched_mm", "grouped_mm"),
                    help="HF's experts implementation in hf-best, hf-router and trl-lora")
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp32"),
                    help="both sides' compute: bf16 autocast (the issue's setting) or fp32 (a CPU without native bf16)")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, in this order: {', '.join(RUNS)}")
    add_common_arguments(ap)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.spec, args.result)
        return 0
    runs = known_runs(ap, args.runs, RUNS)
    if "trl-lora" in runs and importlib.util.find_spec("trl") is None:
        print("trl is not installed: trl-lora is left out (pip install trl)")
        runs.remove("trl-lora")
    work = start_session(args, "tf-compare-moe-")
    started = time.perf_counter()
    try:
        import torch

        s = build_inputs(work, settings(args), save_moe)
        spec = work / "spec.json"
        spec.write_text(json.dumps(s, indent=2))
        a, b, m = s["a"], s["b"], s["model"]
        print(f"model: qwen3_moe, {m['num_experts']} experts top-{m['num_experts_per_tok']}, {m['num_hidden_layers']} layers, "
              f"hidden {m['hidden_size']}, vocab {s['vocab_size']}: {s['parameters'] / 1e6:.2f}M parameters, "
              f"{s['active_parameters'] / 1e6:.2f}M active per token; {s['precision']}; {args.threads} threads per run; torch {torch.__version__}")
        print(f"full: {a['documents']} stdlib files, {a['steps']} steps x {a['batch_size']} blocks of {a['max_length']} tokens")
        print(f"LoRA: {b['rows']} prompt/completion rows, one epoch, micro-batch {b['batch_size']}, max_length {b['max_length']}")

        def run_one(name: str) -> dict:
            r = launch_child(__file__, name, spec, work, args.threads)
            if "error" not in r:
                r["tokens_per_cpu_s"] = r["tokens"] / r["train_cpu_s"] if r.get("train_cpu_s") else None
                print(f"  {name}: {r['steps']} steps, {r['tokens']:,} tokens in {r['train_s']:.1f}s ({r['tokens_per_s']:,.0f} "
                      f"tok/s), wall {r['wall_s']:.1f}s, peak RSS {r['peak_rss_bytes'] / 2**20:,.0f} MiB", flush=True)
            return r

        results = {n: combine(rs) for n, rs in run_rounds(runs, args.repeat, run_one).items()}
        print("evaluating every run's final weights with one function ...")
        for pair, names in (("a", FULL), ("b", LORA)):
            todo = [n for n in names if n in results and "error" not in results[n]]
            if todo:
                batches = eval_batches_for(s, pair, work)
                s[pair]["eval_tokens"] = sum(int((bt.labels != -100).sum()) for bt in batches)
                s[pair]["eval_loss_initial"] = eval_loss(s["paths"]["model_dir"], batches)
                for n in todo:
                    results[n]["eval_loss"] = eval_loss(results[n]["final_dir"], batches)
        print(legend(args, "tokens: real (non-pad) input tokens trained; tok/s: over the training loop; tok/cpu-s: over "
                           "its process CPU time"))
        for pair, title in (("a", "full fine-tune, pretraining blocks"), ("b", "LoRA, prompt/completion, one epoch")):
            if "eval_tokens" in s[pair]:
                print(f"\n{title} (eval: {s[pair]['eval_tokens']:,} held-out tokens, initial loss "
                      f"{s[pair]['eval_loss_initial']:.4f})\n{HEADER}")
                for n in (FULL if pair == "a" else LORA):
                    if n in results:
                        print(fmt_row(results[n]))
        comparisons = compare(results)
        end_session(args, started, settings=s, runs=results, comparisons=comparisons)
        return 0
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
