"""Side by side: trainforge DPO (and KTO) against TRL ``DPOTrainer`` (``KTOTrainer``), all with LoRA, one command.

    python benchmarks/compare_dpo.py [--quick] [--pairs N] [--runs NAME,NAME] [--repeat N] [--threads 2]
                                     [--workdir DIR] [--out results.json]

One Llama-shaped model built here from seeded random weights and saved once (every run starts from the
same weights), a byte-level BPE trained once on the training pairs. Data: ``builtin:python-function-pairs``
(a documented stdlib function's signature and docstring as the prompt; its real body as ``chosen``, the
same lines in reverse order as ``rejected``), written once to a JSONL of TRL's ``{prompt, chosen,
rejected}`` rows that every run reads; held-out pairs are distinct functions.

Runs (each in its own subprocess, one after another, the same thread count):
- ``trl-dpo``: ``trl.DPOTrainer`` with a ``peft_config`` (the reference is the model with its adapters off,
  as TRL does by default with PEFT) and ``DPOConfig`` defaults otherwise: note TRL's own defaults
  bf16=True and gradient_checkpointing=True, and each batch padded to its longest sequence.
- ``trl-dpo-fp32`` (``--runs``, informational): the same with bf16 and gradient checkpointing off.
- ``trainforge-dpo``: ``train.objective: dpo``, ``model.method: lora``, its defaults otherwise (pairs
  packed whole into rows, one forward for chosen and rejected, the reference as adapters off,
  log-probabilities from the chunked fused head, precision auto).
- ``trl-kto`` and ``trainforge-kto`` (``--runs``, informational): the same pairs unpaired, every other
  function's real body labelled desirable and the others' reversed bodies undesirable (TRL's
  ``{prompt, completion, label}``), ``KTOConfig`` defaults against ``train.objective: kto``. Their speed
  column counts examples per second (each side also runs KL samples, differently), and their accuracy is
  the share of held-out examples whose reward is on the side of beta x KL their label asks for.

Equal everywhere: beta, the LoRA adapters (rank, alpha, dropout 0, every linear layer of the blocks),
AdamW (lr, betas, eps, weight decay), cosine decay to ``min_lr_ratio`` x lr without warmup, clipping, seed,
one epoch over the same pairs. Nothing is truncated on either side: TRL's ``max_length`` limits each side
(prompt + completion) and trainforge's a row holding both sides, so trainforge gets twice TRL's, and the
pair set keeps functions short enough for both. A packed step holds more pairs than a padded one, so the
trainforge run takes fewer optimizer steps over the same epoch.

Measured per run:
- pair tokens/s: real (non-pad) input tokens of the chosen and rejected sequences the policy trained on,
  over the training loop (a forward pre-hook counts them for TRL, with gradients on: the reference's
  forwards are not counted on either side; trainforge reports its own, the same definition);
- wall: the whole job in that process, imports and data preparation from cold caches included;
- peak memory: the process peak RSS;
- reward accuracy and margin: after training, the parent loads each run's adapter directory with PEFT
  and scores it with one function (trainforge's DPO objective code, fp32, reference = adapters off) on the
  same held-out pairs: the share of pairs whose chosen side gets the larger implicit reward.

Needs the bench extra (pip install 'trainforge[bench]'). No network: HF_HUB_OFFLINE=1.
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
    finish_hf,
    hf_common_args,
    known_runs,
    launch_child,
    legend,
    load_model,
    peak_memory,
    run_in_child,
    run_rounds,
    save_initial_model,
    start_session,
    train_timed,
    write_jsonl,
)

RUNS = ("trl-dpo", "trainforge-dpo")
EXTRA = ("trl-dpo-fp32", "trl-kto", "trainforge-kto")
TARGETS = {"trl-dpo": {"tokens_per_s": 3.0, "peak_memory": 0.7, "reward_accuracy_points": 2.0}}  # issue 27


def settings(args: argparse.Namespace) -> dict:
    """Sizes of model and data: the default, or --quick for a smoke check (about a minute)."""
    if args.quick:
        s = {"model": {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4},
             "vocab_size": 1024, "pairs": 48, "eval_pairs": 32, "batch_size": 4, "max_length": 256}
    else:
        # ~5.5M parameters: 4 x 0.85M in the blocks, 2 x 1M in embeddings and LM head
        s = {"model": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4},
             "vocab_size": 4096, "pairs": 400, "eval_pairs": 100, "batch_size": 4, "max_length": 256}
    if args.pairs:
        s["pairs"] = args.pairs
    s["optim"] = {"lr": 5.0e-4, "min_lr_ratio": 0.1, "warmup_steps": 0, "weight_decay": 0.0, "betas": [0.9, 0.95],
                  "eps": 1.0e-8, "max_grad_norm": 1.0}
    s["lora"] = {"r": 16, "alpha": 32}
    s["beta"] = 0.1
    s["seed"] = 0
    s["threads"] = args.threads
    return s


def build_inputs(work: Path, s: dict) -> dict:
    """The pair files, the tokenizer and the initial weights (untimed, once)."""
    from trainforge.data.sources import iter_python_function_pairs
    from trainforge.model.tokenizer import train_bpe_tokenizer

    rows: dict[tuple[str, str], dict] = {}
    for r in iter_python_function_pairs():  # distinct functions: no pair is both trained on and evaluated
        rows.setdefault((r.data["prompt"], r.data["chosen"]), r.data)
        if len(rows) == s["pairs"] + s["eval_pairs"]:
            break
    pairs = list(rows.values())
    write_jsonl(work / "pairs_train.jsonl", pairs[: s["pairs"]])
    write_jsonl(work / "pairs_eval.jsonl", pairs[s["pairs"] :])
    unpaired = [{"prompt": p["prompt"], "completion": p["chosen" if k % 2 == 0 else "rejected"], "label": k % 2 == 0}
                for k, p in enumerate(pairs)]  # KTO: the same functions, half of them reversed
    write_jsonl(work / "kto_train.jsonl", unpaired[: s["pairs"]])
    write_jsonl(work / "kto_eval.jsonl", unpaired[s["pairs"] :])
    tok = train_bpe_tokenizer((p[k] for p in pairs[: s["pairs"]] for k in ("prompt", "chosen", "rejected")), s["vocab_size"])
    longest = max(len(tok(p["prompt"] + max(p["chosen"], p["rejected"], key=len)).input_ids) for p in pairs)
    if longest + 2 > s["max_length"]:  # BOS / EOS around it
        raise SystemExit(f"a side of {longest} tokens would be truncated at max_length {s['max_length']}")
    model_dir = work / "init_model"
    save_initial_model(model_dir, tok, s)
    paths = {"work": str(work), "model_dir": str(model_dir), "train": str(work / "pairs_train.jsonl"),
             "eval": str(work / "pairs_eval.jsonl"), "kto_train": str(work / "kto_train.jsonl"),
             "kto_eval": str(work / "kto_eval.jsonl")}
    return {**s, "paths": paths, "longest_side_tokens": longest}


def trainforge_config(s: dict, cache_dir: Path, objective: str = "dpo") -> dict:
    p, o = s["paths"], s["optim"]
    return {
        "model": {"path": p["model_dir"], "method": "lora", "lora": {**s["lora"], "dropout": 0.0}},
        "data": {"train": p["kto_train" if objective == "kto" else "train"], "eval": None, "max_length": 2 * s["max_length"],
                 "cache_dir": str(cache_dir)},
        "train": {"objective": objective, "epochs": 1, "micro_batch_size": s["batch_size"], "seed": s["seed"]},
        "optim": {k: o[k] for k in ("lr", "weight_decay", "betas", "eps", "warmup_steps", "min_lr_ratio", "max_grad_norm")}
        | {"schedule": "cosine"},
        "preference": {"beta": s["beta"]},
        "checkpoint": {"every_minutes": None},  # TRL saves no checkpoints either (save_strategy="no")
        "log": {"report": False},
    }


# ---------------------------------------------------------------- children: one run each


def child(name: str, spec_path: Path, result_path: Path) -> None:
    objective = "kto" if name.endswith("kto") else "dpo"
    run_in_child(spec_path, result_path, name, lambda s, out: run_trainforge(s, out, objective) if name.startswith("trainforge")
                 else run_trl(s, out, tuned=name.endswith("fp32"), objective=objective))


def run_trainforge(s: dict, out: Path, objective: str = "dpo") -> dict:
    import yaml

    from trainforge.config.run import load_config

    (out / "config.yaml").write_text(yaml.safe_dump(trainforge_config(s, out / "cache", objective), sort_keys=False))
    sm, cpu_s = train_timed(load_config(out / "config.yaml"), out / "run")
    return {"steps": sm["steps"], "tokens": sm["tokens"], "train_s": sm["train_time_s"], "train_cpu_s": cpu_s,
            "examples": sm["data"]["train_sequences"] // 2,  # one epoch: each pair (KTO: example) once
            "tokens_per_s": sm["tokens_per_s"], "precision": sm["precision"], "final_dir": sm["final_dir"],
            "final_train_loss": sm["final_train_loss"], "data_stats": sm.get("data")}


def run_trl(s: dict, out: Path, tuned: bool, objective: str = "dpo") -> dict:
    """TRL DPOTrainer (KTOTrainer) with PEFT: its config's defaults but for what both sides share (tuned: bf16
    and gradient checkpointing off)."""
    import datasets
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer

    datasets.disable_progress_bars()
    p = s["paths"]
    tok = AutoTokenizer.from_pretrained(p["model_dir"])
    ds = datasets.load_dataset("json", data_files=p["kto_train" if objective == "kto" else "train"], split="train",
                               cache_dir=str(out / "hf-cache"))
    counter = Counter(tok.pad_token_id)
    model = load_model(s, counter)
    config, trainer_class = (KTOConfig, KTOTrainer) if objective == "kto" else (DPOConfig, DPOTrainer)
    args = config(**hf_common_args({**s, "gpu": False}, out), per_device_train_batch_size=s["batch_size"], num_train_epochs=1,
                  max_length=s["max_length"], beta=s["beta"], **({"bf16": False, "gradient_checkpointing": False} if tuned else {}))
    lora = LoraConfig(r=s["lora"]["r"], lora_alpha=s["lora"]["alpha"], lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")
    trainer = trainer_class(model=model, args=args, train_dataset=ds, processing_class=tok, peft_config=lora,
                            callbacks=[counter.callback()])
    result = trainer.train()
    r = finish_hf(trainer, counter, out, result)
    r["examples"] = len(ds)
    r.update(bf16=args.bf16, gradient_checkpointing=args.gradient_checkpointing, precision="bf16" if args.bf16 else "fp32")
    r.pop("settings", None)
    return r


# ---------------------------------------------------------------- the one eval, in the parent


def score(s: dict, adapter_dir: str | None, objective: str = "dpo") -> dict:
    """Held-out reward accuracy and margin of an adapter directory against its base (adapters off), with
    trainforge's objective code in fp32 (KTO: its label-sign accuracy); ``None``: the initial model."""
    import torch
    from peft import AutoPeftModelForCausalLM
    from rich.console import Console

    from trainforge.config.run import load_config
    from trainforge.data.loader import eval_batches
    from trainforge.data.plan import get_tokenizer, plan_data
    from trainforge.engine.evaluate import evaluate
    from trainforge.engine.objective import PairObjective
    from trainforge.hardware.device import PRECISIONS
    from trainforge.metrics.console import ConsoleReporter

    import yaml

    work = Path(s["paths"]["work"])
    cfg_dict = trainforge_config(s, work / "eval-cache", objective)
    cfg_dict["data"]["train"] = s["paths"]["kto_eval" if objective == "kto" else "eval"]
    (work / f"eval-{objective}.yaml").write_text(yaml.safe_dump(cfg_dict, sort_keys=False))
    cfg = load_config(work / f"eval-{objective}.yaml")
    quiet = ConsoleReporter(Console(quiet=True))
    tok = get_tokenizer(cfg, quiet)
    plan = plan_data(cfg, tok, quiet)
    batches = eval_batches(plan.train_rows, plan.collate, 8)
    if adapter_dir is None:
        return {"reward_accuracy": 0.0, "reward_margin": 0.0}
    model = AutoPeftModelForCausalLM.from_pretrained(adapter_dir, dtype=torch.float32)
    got = evaluate(model, batches, PRECISIONS["fp32"], torch.device("cpu"), objective=PairObjective(objective, cfg.preference, "adapters"))
    margin = got.get("eval_reward_margin", got.get("eval_rewards_desirable", 0.0) - got.get("eval_rewards_undesirable", 0.0))
    return {"reward_accuracy": got["eval_reward_accuracy"], "reward_margin": margin, "eval_pairs": got["eval_pairs"],
            f"{objective}_loss": got["eval_loss"]}


HEADER = (f"{'run':<16} {'steps':>5} {'pair tokens':>11} {'train s':>7} {'tok/s':>7} {'examples/s':>10} {'wall s':>6} {'peak MiB':>8} "
          f"{'load':>4} {'accuracy':>8} {'margin':>7}")


def fmt_row(r: dict) -> str:
    if "error" in r:
        return f"{r['name']:<16} FAILED: {r['error']}"
    return (f"{r['name']:<16} {r['steps']:>5} {r['tokens']:>11,} {r['train_s']:>7.1f} {r['tokens_per_s']:>7,.0f} "
            f"{r.get('examples_per_s', float('nan')):>10.1f} {r['wall_s']:>6.1f} {peak_memory(r) / 2**20:>8,.0f} {r['load_before']:>4.1f} "
            f"{r.get('reward_accuracy', float('nan')):>8.1%} {r.get('reward_margin', float('nan')):>7.3f}")


def compare(results: dict) -> list[dict]:
    """trainforge's DPO run against each TRL DPO run (and KTO against KTO): the ratios, and the issue's targets."""
    out = []
    for name, base in results.items():
        objective = name.split("-")[1]
        tf = results.get(f"trainforge-{objective}")
        if name.startswith("trainforge") or "error" in base or not tf or "error" in tf:
            continue
        rate = "examples_per_s" if objective == "kto" else "tokens_per_s"
        c = {"baseline": name, "trainforge": f"trainforge-{objective}", f"{rate}_ratio": tf[rate] / base[rate],
             "wall_speedup": base["wall_s"] / tf["wall_s"], "peak_memory_ratio": peak_memory(tf) / peak_memory(base),
             "reward_accuracy_points": 100 * (tf["reward_accuracy"] - base["reward_accuracy"])}
        target = TARGETS.get(name)
        c["meets"] = None if target is None else {
            "tokens_per_s": c[f"{rate}_ratio"] >= target["tokens_per_s"],
            "peak_memory": c["peak_memory_ratio"] <= target["peak_memory"],
            "reward_accuracy": c["reward_accuracy_points"] >= -target["reward_accuracy_points"],
        }
        verdict = "" if target is None else " | " + ", ".join(f"{k} {'ok' if v else 'MISSED'}" for k, v in c["meets"].items())
        what = "examples/s" if objective == "kto" else "pair tokens/s"
        print(f"  trainforge vs {name}: {what} {c[f'{rate}_ratio']:.2f}x | whole job {c['wall_speedup']:.2f}x faster | "
              f"peak memory {c['peak_memory_ratio']:.2f}x | reward accuracy {c['reward_accuracy_points']:+.1f} points{verdict}")
        out.append(c)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny settings: a smoke check in about a minute")
    ap.add_argument("--pairs", type=int, default=None, help="training pairs (one epoch)")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated: {', '.join(RUNS + EXTRA)}")
    add_common_arguments(ap)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.spec, args.result)
        return 0
    runs = known_runs(ap, args.runs, RUNS + EXTRA)
    work = start_session(args, "tf-compare-dpo-")
    started = time.perf_counter()
    try:
        import torch

        s = build_inputs(work, settings(args))
        spec = work / "spec.json"
        spec.write_text(json.dumps(s, indent=2))
        print(f"model: llama {s['model']}, vocab {s['vocab_size']}; {s['pairs']} training pairs (one epoch), {s['eval_pairs']} "
              f"held out; longest side {s['longest_side_tokens']} tokens; {args.threads} threads per run; torch {torch.__version__}")

        def run_one(name: str) -> dict:
            r = launch_child(__file__, name, spec, work, args.threads)
            if "error" not in r:
                print(f"  {name}: {r['steps']} steps, {r['tokens']:,} pair tokens in {r['train_s']:.1f}s "
                      f"({r['tokens_per_s']:,.0f} tok/s), wall {r['wall_s']:.1f}s, peak RSS {r['peak_rss_bytes'] / 2**20:,.0f} MiB",
                      flush=True)
            return r

        results = {n: combine(rs) for n, rs in run_rounds(runs, args.repeat, run_one).items()}
        print("scoring every run's adapters with one function ...")
        for r in results.values():
            if "error" not in r:
                r["examples_per_s"] = r["examples"] / r["train_s"]
                r.update(score(s, r["final_dir"], "kto" if r["name"].endswith("kto") else "dpo"))
        print(legend(args, "pair tokens: real (non-pad) input tokens of chosen and rejected the policy trained on; tok/s: "
                           "over the training loop; accuracy / margin: held-out pairs, trainforge's DPO code, fp32"))
        print(f"\n{HEADER}")
        for n in runs:
            print(fmt_row(results[n]))
        comparisons = compare(results)
        end_session(args, started, settings=s, runs=results, comparisons=comparisons)
        return 0
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
