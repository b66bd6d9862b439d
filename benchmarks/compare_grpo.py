"""Side by side: trainforge GRPO (``train.objective: grpo``) against TRL ``GRPOTrainer`` + PEFT LoRA, no vLLM.

    python benchmarks/compare_grpo.py [--quick] [--small] [--steps N] [--hidden N --layers N --sft-steps N] [--eval-samples N]
                                      [--precision auto|bf16|fp32] [--runs NAME,NAME] [--repeat N] [--threads 2]
                                      [--workdir DIR] [--out results.json]

The default model is a Llama of about 20M parameters (hidden 512, 6 layers, MLP 1536, 8 heads), as issue 44 asks
(tens of millions: big enough that rollouts, activations and optimizer state, not the imports, set the peak RSS);
its SFT warm start takes most of the wall time (several minutes on 2 cores: untimed). ``--small`` is the earlier
0.14M model (hidden 64, 2 layers: about a minute on 2 idle cores, where the RSS is mostly the imports). The JSON
goes to benchmarks/results/; ``--steps 40`` (or more) for a longer run, ``--hidden N --layers N --sft-steps N``
for another size, ``--quick`` for a smoke check (few SFT and GRPO steps: its rewards mean nothing). On a shared
machine, read the load column: other jobs' bursts slow whichever run they hit.

Shared inputs (built once, untimed):
- prompts: ``builtin:arithmetic`` (400 sums ``"7+12="`` with ``answer: "19"``), written once to a JSONL of
  ``{prompt, answer}`` rows that both sides read;
- a Llama-shaped model (about 20M parameters; ``--small``: 0.14M) from seeded random weights with a byte-level BPE
  trained on the sums, saved once;
- the starting policy: that model after a short trainforge SFT on the sums (``sft`` run), so that the groups of
  completions earn rewards that differ (a random model earns none, and GRPO learns nothing from equal rewards).

Runs (each its own subprocess, one after another, the same thread count):
- ``trl-grpo``: ``trl.GRPOTrainer`` with a ``peft_config`` and ``GRPOConfig`` defaults except what both sides
  share (note TRL's default ``gradient_checkpointing=True``); sampling with transformers' ``generate``. With
  ``bf16=True`` on a CPU its training forwards run under bf16 autocast and its sampling does not (accelerate's
  autocast wraps the prepared model's ``forward``, and ``generate`` reaches the decoder around it): the run
  records which (``generation_autocast``), trainforge samples in the run's precision;
- ``trl-grpo-nogc`` (``--runs``, informational): the same with gradient checkpointing off;
- ``trainforge-grpo``: ``train.objective: grpo``, ``model.method: lora``, its defaults otherwise;
- ``rollout``: trainforge's sampler against transformers' ``generate`` on the same batches (the step's prompts x
  ``num_generations``), the same model (the starting policy with fresh LoRA adapters, as both trainers sample),
  the same precision: ``benchmarks/bench_rollout.py``'s two functions, imported.

Equal on both sides: the starting weights, the prompts, the reward (trainforge's ``final_number``, handed to TRL
as a reward function), ``num_generations`` 8, ``max_completion_length``, temperature 1 (no top-k / top-p),
completions per step (micro-batch x grad_accum), the loss (``grpo``: each completion's token mean, then the mean
over completions), beta 0 (no reference model), one iteration per batch, group-scaled advantages, the LoRA
adapters (rank, alpha, dropout 0, every linear layer of the blocks), AdamW (lr, betas, eps, no weight decay) at a
constant lr, gradient clipping, the seed, the steps, and the precision (``--precision auto``: bf16 autocast where the CPU has native bf16, else fp32; in bf16 TRL's
``bf16=True`` with ``use_cpu=True``, trainforge's ``train.precision: bf16``). The prompts of each step differ
(each side shuffles them with its own seeded sampler).

Measured per run:
- completions/s: steady state, the steps after the first (the first one warms up: allocations, lazy imports),
  from each side's own step clock (a callback's ``on_step_end`` for TRL, ``elapsed_s`` of metrics.jsonl for
  trainforge, logged every step on both): completions per step over the median step time (the headline: a load
  spike on a shared machine moves it least), and over the mean step time;
- gen s / gen tok/s: seconds a step spends generating (trainforge's ``gen_s``: sampling and scoring; TRL: its
  ``_generate``, sampling and decoding), and completion tokens per second of them;
- peak RSS: the process peak;
- training reward: the mean reward of the completions the run trained on, first step and last steps;
- final reward: after training, the parent samples every run's policy (and the starting policy) with one
  function (trainforge's sampler, fp32, a fixed seed) on all the prompts, ``--eval-samples`` completions each
  and scores them with ``final_number``: the mean reward, with its standard error.

Targets (issue 44): completions/s >= 3x TRL, peak RSS <= 0.6x TRL, generation tokens/s >= 2x transformers'
``generate``, final reward the same (within two standard errors of the difference) or better.

Needs the bench extra (pip install 'trainforge[bench]'). No network: HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import time
from pathlib import Path

# compare_hf's module level imports the standard library only, and its T_START (a child's whole-job clock, read
# by run_in_child) starts here, before torch / transformers are imported
from compare_hf import (
    end_session,
    add_common_arguments,
    combine,
    known_runs,
    launch_child,
    legend,
    run_in_child,
    run_rounds,
    save_initial_model,
    start_session,
    train_timed,
    write_jsonl,
)

RUNS = ("trl-grpo", "trainforge-grpo", "rollout")
EXTRA = ("trl-grpo-nogc",)
TARGETS = {"completions_per_s": 3.0, "peak_memory": 0.6, "generation_tokens_per_s": 2.0}  # issue 44
RESULTS = Path(__file__).resolve().parent / "results"


def settings(args: argparse.Namespace) -> dict:
    """Sizes of model, SFT warm start and GRPO run: the default, or --quick for a smoke check."""
    if args.small:  # ~0.14M parameters (2 x 53k in the blocks, 2 x 18k in embeddings and LM head)
        s = {"model": {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4},
             "sft": {"steps": 200, "batch_size": 32, "lr": 3.0e-3}, "steps": 10, "eval_samples": 4}
    else:  # ~20M parameters (6 x 3.4M in the blocks; a vocabulary of ~300): a lower SFT lr for the deeper model
        s = {"model": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 6, "num_attention_heads": 8},
             "sft": {"steps": 200, "batch_size": 32, "lr": 1.0e-3}, "steps": 10, "eval_samples": 4}
    if args.quick:
        s.update(sft={**s["sft"], "steps": 20}, steps=2, eval_samples=1)
    if args.steps:
        s["steps"] = args.steps
    if s["steps"] < 2:
        raise SystemExit("--steps: at least 2 (the first one is the warm-up, not timed)")
    if args.hidden:
        s["model"].update(hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_attention_heads=max(args.hidden // 16, 1))
    if args.layers:
        s["model"]["num_hidden_layers"] = args.layers
    if args.sft_steps:
        s["sft"]["steps"] = args.sft_steps
    if args.eval_samples:
        s["eval_samples"] = args.eval_samples
    s["vocab_size"] = 300  # byte-level BPE: 256 bytes, EOS, PAD, and a few merges of digits
    s["grpo"] = {"num_generations": 8, "prompts_per_step": 8, "micro_batch_size": 32, "grad_accum": 2,
                 "max_completion_length": 16, "temperature": 1.0, "loss": "grpo", "beta": 0.0, "scale_rewards": "group",
                 "prompt_max_length": 16}
    s["optim"] = {"lr": 1.0e-3, "betas": [0.9, 0.99], "eps": 1.0e-8, "weight_decay": 0.0, "max_grad_norm": 1.0}
    s["lora"] = {"r": 16, "alpha": 32}
    s["precision"] = args.precision
    s["rollout_rounds"] = 2 if args.quick else 6
    s["seed"] = 0
    s["threads"] = args.threads
    g = s["grpo"]
    if g["micro_batch_size"] * g["grad_accum"] != g["prompts_per_step"] * g["num_generations"]:
        raise SystemExit("micro_batch_size x grad_accum must be prompts_per_step x num_generations")
    return s


def build_inputs(work: Path, s: dict) -> dict:
    """The prompt file, the tokenizer and the initial weights (untimed, once); the SFT warm start is a child run."""
    from trainforge.data.sources import iter_arithmetic
    from trainforge.model.tokenizer import train_bpe_tokenizer

    rows = [r.data for r in iter_arithmetic()]
    write_jsonl(work / "prompts.jsonl", [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    write_jsonl(work / "sft.jsonl", [{"prompt": r["prompt"], "completion": r["completion"]} for r in rows])
    tok = train_bpe_tokenizer([r["prompt"] + r["completion"] for r in rows], s["vocab_size"])
    longest = max(len(tok(r["prompt"]).input_ids) for r in rows)
    if longest > s["grpo"]["prompt_max_length"]:
        raise SystemExit(f"a prompt of {longest} tokens is over prompt_max_length {s['grpo']['prompt_max_length']}")
    model_dir = work / "init_model"
    save_initial_model(model_dir, tok, s)
    paths = {"work": str(work), "model_dir": str(model_dir), "prompts": str(work / "prompts.jsonl"),
             "sft_data": str(work / "sft.jsonl"), "policy": str(work / "runs" / "sft" / "run" / "final")}
    return {**s, "paths": paths, "prompts": len(rows), "longest_prompt_tokens": longest}


# ---------------------------------------------------------------- trainforge configs


def optim_config(s: dict, lr: float) -> dict:
    o = s["optim"]
    return {"lr": lr, "schedule": "constant", "warmup_steps": 0, "weight_decay": o["weight_decay"], "betas": o["betas"],
            "eps": o["eps"], "max_grad_norm": o["max_grad_norm"]}


def sft_config(s: dict, cache_dir: Path) -> dict:
    """The warm start: a full fine-tune of the initial weights on the sums, fp32 (the same for every run)."""
    f = s["sft"]
    return {"model": {"path": s["paths"]["model_dir"]},
            "data": {"train": s["paths"]["sft_data"], "eval": None, "max_length": 32, "format": "prompt_completion",
                     "cache_dir": str(cache_dir)},
            "train": {"max_steps": f["steps"], "micro_batch_size": f["batch_size"], "seed": s["seed"], "precision": "fp32",
                      "eval_every": None, "compile": False},  # a set-up step: compiling would cost more than it saves
            "optim": optim_config(s, f["lr"]) | {"schedule": "cosine", "warmup_steps": 10, "min_lr_ratio": 0.1},
            "checkpoint": {"every_minutes": None}, "log": {"report": False}}


def grpo_config(s: dict, cache_dir: Path) -> dict:
    g = s["grpo"]
    return {
        "model": {"path": s["paths"]["policy"], "method": "lora", "lora": {**s["lora"], "dropout": 0.0}},
        "data": {"train": s["paths"]["prompts"], "eval": None, "max_length": g["prompt_max_length"], "cache_dir": str(cache_dir)},
        "train": {"objective": "grpo", "max_steps": s["steps"], "micro_batch_size": g["micro_batch_size"],
                  "grad_accum": g["grad_accum"], "seed": s["seed"], "precision": s["precision"], "eval_every": None},
        "optim": optim_config(s, s["optim"]["lr"]),
        "rl": {"num_generations": g["num_generations"], "max_completion_length": g["max_completion_length"],
               "temperature": g["temperature"], "loss": g["loss"], "beta": g["beta"], "scale_rewards": g["scale_rewards"],
               "rewards": [{"name": "final_number"}]},
        "checkpoint": {"every_minutes": None},  # TRL saves none either (save_strategy="no")
        "log": {"every_steps": 1, "report": False},  # every step, as TRL's logging_steps=1: the per-step clock and reward
    }


# ---------------------------------------------------------------- children: one run each


def child(name: str, spec_path: Path, result_path: Path) -> None:
    runners = {"sft": run_sft, "trainforge-grpo": run_trainforge, "rollout": run_rollout,
               "trl-grpo": lambda s, out: run_trl(s, out, checkpointing=None),
               "trl-grpo-nogc": lambda s, out: run_trl(s, out, checkpointing=False)}
    run_in_child(spec_path, result_path, name, runners[name])


def run_sft(s: dict, out: Path) -> dict:
    import yaml

    from trainforge.config.run import load_config

    (out / "config.yaml").write_text(yaml.safe_dump(sft_config(s, out / "cache"), sort_keys=False))
    sm, _ = train_timed(load_config(out / "config.yaml"), out / "run")
    if Path(sm["final_dir"]).resolve() != Path(s["paths"]["policy"]).resolve():
        raise SystemExit(f"the SFT run saved its weights in {sm['final_dir']}, not {s['paths']['policy']}")
    return {"steps": sm["steps"], "train_s": sm["train_time_s"], "final_train_loss": sm["final_train_loss"]}


def rates(ends: list[float], cpu_ends: list[float], gen_s: list[float], gen_tokens: list[float], per_step: int) -> dict:
    """A run's speeds from the clock at each step's end (seconds from the loop's start), each step's generation
    seconds and completion tokens: over the steps after the first (it warms up), the median step (what a load spike
    on the shared machine moves least: the headline), the fastest (best: the least slowed by other work, as
    bench_rollout.py takes the best of its repeats) and the mean, and over every step; and completions per second
    of the process's CPU time over the steps after the first (``cpu_ends``: its CPU clock at each step's end)."""
    import statistics

    steps = [b - a for a, b in zip([0.0] + ends[:-1], ends)]
    later = steps[1:] or steps
    gen = [(t, s) for t, s in zip(gen_tokens[1:] or gen_tokens, gen_s[1:] or gen_s) if s > 0]
    return {"step_s": steps, "gen_s": gen_s, "gen_tokens": gen_tokens,
            "completions_per_s": per_step / statistics.median(later), "completions_per_s_best": per_step / min(later),
            "completions_per_s_mean": per_step * len(later) / sum(later),
            "completions_per_s_all": per_step * len(steps) / sum(steps),
            "completions_per_cpu_s": per_step * (len(cpu_ends) - 1) / (cpu_ends[-1] - cpu_ends[0]),
            "gen_s_per_step": statistics.median(s for _, s in gen), "gen_tokens_per_s": statistics.median(t / s for t, s in gen)}


def run_trainforge(s: dict, out: Path) -> dict:
    import yaml

    import trainforge.engine.trainer as trainer_module
    from trainforge.config.run import load_config

    (out / "config.yaml").write_text(yaml.safe_dump(grpo_config(s, out / "cache"), sort_keys=False))
    cpu_ends, log_step = [], trainer_module.log_step

    def clocked_log_step(*args, **kwargs):  # called once a step (log.every_steps 1), right after the step
        cpu_ends.append(time.process_time())
        return log_step(*args, **kwargs)

    trainer_module.log_step = clocked_log_step
    try:
        sm, cpu_s = train_timed(load_config(out / "config.yaml"), out / "run")
    finally:
        trainer_module.log_step = log_step
    lines = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "reward" in r and "elapsed_s" in r]
    g = s["grpo"]
    per_step = g["micro_batch_size"] * g["grad_accum"]
    ends = [r["elapsed_s"] for r in steps]
    return {"steps": sm["steps"], "completions": per_step * len(steps), "train_s": sm["train_time_s"], "train_cpu_s": cpu_s,
            **rates(ends, cpu_ends, [r["gen_s"] for r in steps], [r["completion_length"] * per_step for r in steps], per_step),
            "rewards": [r["reward"] for r in steps], "completion_length": [r["completion_length"] for r in steps],
            "truncated": [r["truncated"] for r in steps],
            "precision": sm["precision"], "final_dir": sm["final_dir"]}


def run_trl(s: dict, out: Path, checkpointing: bool | None) -> dict:
    """TRL GRPOTrainer with PEFT: GRPOConfig's defaults but for what both sides share (``checkpointing`` None: TRL's
    default gradient checkpointing)."""
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trainforge.config.rewards import RewardSettings
    from trainforge.rl.reward_builtins import make_builtin

    datasets.disable_progress_bars()
    p, g, o = s["paths"], s["grpo"], s["optim"]
    scorer = make_builtin(RewardSettings(name="final_number"), None).score

    def final_number(prompts, completions, answer, **kwargs):  # trainforge's own reward, the same for both sides
        return scorer(completions, [{"answer": a} for a in answer])

    tok = AutoTokenizer.from_pretrained(p["policy"])
    ds = datasets.load_dataset("json", data_files=p["prompts"], split="train", cache_dir=str(out / "hf-cache"))
    model = AutoModelForCausalLM.from_pretrained(p["policy"])  # fp32 as saved, sdpa: transformers' defaults
    ends: list[float] = []
    cpu_ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            ends.append(time.perf_counter())
            cpu_ends.append(time.process_time())

    args = GRPOConfig(
        output_dir=str(out / "trainer"), learning_rate=o["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=o["weight_decay"], adam_beta1=o["betas"][0], adam_beta2=o["betas"][1], adam_epsilon=o["eps"],
        max_grad_norm=o["max_grad_norm"], seed=s["seed"], report_to="none", logging_steps=1, save_strategy="no",
        disable_tqdm=True, use_cpu=True,  # TrainingArguments refuses bf16 without a GPU unless told to use the CPU
        bf16=s["precision"] == "bf16", max_steps=s["steps"], per_device_train_batch_size=g["micro_batch_size"],
        gradient_accumulation_steps=g["grad_accum"], num_generations=g["num_generations"],
        max_completion_length=g["max_completion_length"], temperature=g["temperature"], top_p=1.0, top_k=0,
        loss_type=g["loss"], beta=g["beta"], scale_rewards=g["scale_rewards"], num_iterations=1,
        **({} if checkpointing is None else {"gradient_checkpointing": checkpointing}),
    )
    lora = LoraConfig(r=s["lora"]["r"], lora_alpha=s["lora"]["alpha"], lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=[final_number], args=args, train_dataset=ds, processing_class=tok,
                          peft_config=lora, callbacks=[StepClock()])
    gen_s: list[float] = []
    gen_tokens: list[int] = []
    generate = trainer._generate

    def timed_generate(prompts):  # sampling and decoding, as trainforge's gen_s (which also scores, a few ms)
        t = time.perf_counter()
        result = generate(prompts)
        gen_s.append(time.perf_counter() - t)
        gen_tokens.append(sum(len(c) for c in result[1]))  # completion ids, up to and with the EOS, no padding
        return result

    trainer._generate = timed_generate
    # whether sampling ran under autocast: TRL's bf16 autocast wraps the training forward (accelerate patches the
    # wrapped model's forward), and generate() may reach the decoder without passing through it
    sampled_under = set()
    layer = trainer.model.get_base_model().model.layers[0]
    probe = layer.register_forward_pre_hook(
        lambda module, inputs: sampled_under.add(torch.is_autocast_enabled("cpu")) if not torch.is_grad_enabled() else None)
    trainer.train()
    probe.remove()
    trainer.save_model(str(out / "final"))
    logs = [h for h in trainer.state.log_history if "reward" in h]
    per_step = g["micro_batch_size"] * g["grad_accum"]
    return {"steps": trainer.state.global_step, "completions": per_step * trainer.state.global_step,
            "train_s": ends[-1] - ends[0], **rates([e - ends[0] for e in ends[1:]], cpu_ends, gen_s, gen_tokens, per_step),
            "rewards": [h["reward"] for h in logs], "completion_length": [h.get("completions/mean_length") for h in logs],
            "truncated": [h.get("completions/clipped_ratio") for h in logs], "final_dir": str(out / "final"),
            "generation_autocast": sorted(sampled_under), "bf16": args.bf16,
            "gradient_checkpointing": args.gradient_checkpointing, "loss_type": args.loss_type,
            "precision": "bf16" if args.bf16 else "fp32", "model_dtype": str(next(trainer.model.parameters()).dtype)}


def run_rollout(s: dict, out: Path) -> dict:
    """trainforge's sampler against transformers' ``generate`` on the same batches: bench_rollout.py's two functions
    (each samples a batch and returns its completion tokens up to each row's end token)."""
    import contextlib

    import torch
    from bench_rollout import ours, theirs
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p, g = s["paths"], s["grpo"]
    tok = AutoTokenizer.from_pretrained(p["policy"])
    model = AutoModelForCausalLM.from_pretrained(p["policy"])
    lora = LoraConfig(r=s["lora"]["r"], lora_alpha=s["lora"]["alpha"], lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")
    model = get_peft_model(model, lora).eval()  # as both trainers sample: the adapters on, unmerged
    prompts = [json.loads(x)["prompt"] for x in Path(p["prompts"]).read_text().splitlines()]
    ids = [tok(t)["input_ids"] for t in prompts]
    n, k = g["prompts_per_step"], g["num_generations"]
    batches = [[q for q in ids[r * n : (r + 1) * n] for _ in range(k)] for r in range(s["rollout_rounds"])]

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16) if s["precision"] == "bf16" else contextlib.nullcontext()

    stop, new = tok.eos_token_id, g["max_completion_length"]
    rounds: dict[str, list[dict]] = {"trainforge": [], "generate": []}
    with autocast():
        ours(model, batches[0], new, stop, k), theirs(model, batches[0], new, stop)  # warm-up
        for batch in batches:  # alternating: a slow spell of the machine falls on both
            for name, fn in (("trainforge", lambda *a: ours(*a, k)), ("generate", theirs)):
                t, cpu = time.perf_counter(), time.process_time()
                tokens = fn(model, batch, new, stop)
                rounds[name].append({"tokens": tokens, "s": time.perf_counter() - t, "cpu_s": time.process_time() - cpu})
    import statistics

    # medians over the batches (each a round of both): a load spike on the shared machine moves them least
    rate = {name: [r["tokens"] / r["s"] for r in rs] for name, rs in rounds.items()}
    cpu_rate = {name: sum(r["tokens"] for r in rs) / sum(r["cpu_s"] for r in rs) for name, rs in rounds.items()}
    return {"batches": len(batches), "completions_per_batch": n * k, "per_batch": rounds,
            **{f"{name}_tokens_per_s": statistics.median(v) for name, v in rate.items()},
            **{f"{name}_tokens_per_s_best": max(v) for name, v in rate.items()},
            **{f"{name}_tokens_per_cpu_s": v for name, v in cpu_rate.items()},
            "ratio_per_batch": [a / b for a, b in zip(rate["trainforge"], rate["generate"])]}


# ---------------------------------------------------------------- the one evaluation, in the parent


def final_reward(s: dict, adapter_dir: str | None) -> dict:
    """Mean ``final_number`` reward of a policy (an adapter directory; None: the starting policy) sampled at the
    run's temperature with one function and a fixed seed, fp32, on every prompt ``eval_samples`` times; and the
    standard error of that mean."""
    import numpy as np
    import torch
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainforge.config.rewards import RewardSettings
    from trainforge.model.generate import stop_token_ids
    from trainforge.rl.rewards import RewardSet
    from trainforge.rl.rollout import Sampling, sample, stream_keys

    p, g = s["paths"], s["grpo"]
    tok = AutoTokenizer.from_pretrained(p["policy"])
    if adapter_dir is None:
        model = AutoModelForCausalLM.from_pretrained(p["policy"], dtype=torch.float32)
    else:
        model = AutoPeftModelForCausalLM.from_pretrained(adapter_dir, dtype=torch.float32)
    model.eval()
    rows = [json.loads(x) for x in Path(p["prompts"]).read_text().splitlines()]
    rewards = RewardSet.from_settings([RewardSettings(name="final_number")], 30)
    sampling = Sampling(g["max_completion_length"], g["temperature"], stop_ids=tuple(stop_token_ids(model, tok)))
    keys = stream_keys(1234, range(len(rows) * s["eval_samples"]))  # each completion's draws: its own
    flat = [r for r in rows for _ in range(s["eval_samples"])]
    scores: list[float] = []
    for i in range(0, len(flat), 200):
        part = flat[i : i + 200]
        out = sample(model, [tok(r["prompt"])["input_ids"] for r in part], sampling, keys[i : i + 200], tok.pad_token_id)
        texts = [tok.decode(c, skip_special_tokens=True) for c in out.tokens]
        scores += rewards.score([r["prompt"] for r in part], texts, [{"answer": r["answer"]} for r in part],
                                [f"eval:{i + k}" for k in range(len(part))]).total
    x = np.asarray(scores)
    return {"final_reward": float(x.mean()), "final_reward_se": float(x.std(ddof=1) / np.sqrt(len(x))),
            "final_reward_completions": len(x)}


# ---------------------------------------------------------------- the report


def tail_mean(values: list, k: int = 3) -> float:
    vals = [v for v in values if v is not None][-k:]
    return sum(vals) / len(vals) if vals else float("nan")


HEADER = (f"{'run':<16} {'steps':>5} {'compl/s':>8} {'best':>6} {'mean':>6} {'all':>6} {'/cpu-s':>6} {'gen s':>6} "
          f"{'gen tok/s':>9} {'wall s':>6} {'peak MiB':>8} {'load':>4} {'reward 1st':>10} {'last 3':>6} {'final reward':>14}")


def fmt_row(r: dict) -> str:
    if "error" in r:
        return f"{r['name']:<16} FAILED: {r['error']}"
    final = f"{r['final_reward']:.3f} ± {r['final_reward_se']:.3f}" if "final_reward" in r else "-"
    return (f"{r['name']:<16} {r['steps']:>5} {r['completions_per_s']:>8.1f} {r['completions_per_s_best']:>6.1f} "
            f"{r['completions_per_s_mean']:>6.1f} {r['completions_per_s_all']:>6.1f} {r['completions_per_cpu_s']:>6.1f} "
            f"{r['gen_s_per_step']:>6.2f} {r['gen_tokens_per_s']:>9,.0f} {r['wall_s']:>6.1f} "
            f"{r['peak_rss_bytes'] / 2**20:>8,.0f} {r['load_before']:>4.1f} {r['rewards'][0]:>10.3f} "
            f"{tail_mean(r['rewards']):>6.3f} {final:>14}")


def ok(flag: bool) -> str:
    return "ok" if flag else "MISSED"


def compare(results: dict) -> list[dict]:
    """trainforge against each TRL run and its sampler against ``generate``: the ratios, and the issue's targets
    (judged against TRL's defaults, ``trl-grpo``)."""
    tf, roll = results.get("trainforge-grpo"), results.get("rollout")
    out = []
    if roll and "error" not in roll:
        ratio = roll["trainforge_tokens_per_s"] / roll["generate_tokens_per_s"]
        met = ratio >= TARGETS["generation_tokens_per_s"]
        cpu = roll["trainforge_tokens_per_cpu_s"] / roll["generate_tokens_per_cpu_s"]
        best = roll["trainforge_tokens_per_s_best"] / roll["generate_tokens_per_s_best"]
        print(f"  generation, same batches: trainforge {roll['trainforge_tokens_per_s']:,.0f} tok/s, transformers generate "
              f"{roll['generate_tokens_per_s']:,.0f} tok/s: {ratio:.2f}x (target >= {TARGETS['generation_tokens_per_s']}x: "
              f"{ok(met)}); best batch {best:.2f}x; per CPU second {cpu:.2f}x")
        out.append({"baseline": "transformers generate", "generation_tokens_per_s_ratio": ratio,
                    "generation_tokens_per_s_best_ratio": best,
                    "generation_tokens_per_cpu_s_ratio": cpu, "meets": met})
    if not tf or "error" in tf:
        return out
    for name, base in results.items():
        if not name.startswith("trl") or "error" in base:
            continue
        diff = tf["final_reward"] - base["final_reward"]
        se = (tf["final_reward_se"] ** 2 + base["final_reward_se"] ** 2) ** 0.5
        c = {"baseline": name, **{f"{k}_ratio": tf[k] / base[k] for k in (
                 "completions_per_s", "completions_per_s_best", "completions_per_s_mean", "completions_per_s_all",
                 "completions_per_cpu_s", "gen_tokens_per_s")},
             "wall_speedup": base["wall_s"] / tf["wall_s"], "peak_memory_ratio": tf["peak_rss_bytes"] / base["peak_rss_bytes"],
             "final_reward_diff": diff, "final_reward_diff_se": se}
        informational = name != "trl-grpo"
        c["meets"] = None if informational else {
            "completions_per_s": c["completions_per_s_ratio"] >= TARGETS["completions_per_s"],
            "peak_memory": c["peak_memory_ratio"] <= TARGETS["peak_memory"],
            "final_reward": diff >= -2 * se,
        }
        verdict = "" if informational else " | " + ", ".join(f"{k} {ok(v)}" for k, v in c["meets"].items())
        print(f"  trainforge vs {name}{' (informational)' if informational else ''}: completions/s "
              f"{c['completions_per_s_ratio']:.2f}x (best step {c['completions_per_s_best_ratio']:.2f}x, mean step "
              f"{c['completions_per_s_mean_ratio']:.2f}x, all steps "
              f"{c['completions_per_s_all_ratio']:.2f}x, per CPU second {c['completions_per_cpu_s_ratio']:.2f}x) | whole "
              f"job {c['wall_speedup']:.2f}x faster | peak RSS "
              f"{c['peak_memory_ratio']:.2f}x | in-run generation tok/s {c['gen_tokens_per_s_ratio']:.2f}x | final reward "
              f"{tf['final_reward']:.3f} vs {base['final_reward']:.3f} ({diff:+.3f} ± {se:.3f}){verdict}")
        out.append(c)
    return out


MEDIAN_KEYS = ("completions_per_s", "completions_per_s_best", "completions_per_s_mean", "completions_per_s_all", "completions_per_cpu_s",
               "gen_s_per_step", "gen_tokens_per_s", "wall_s", "peak_rss_bytes", "load_before", "trainforge_tokens_per_s",
               "generate_tokens_per_s", "trainforge_tokens_per_s_best", "generate_tokens_per_s_best",
               "trainforge_tokens_per_cpu_s", "generate_tokens_per_cpu_s")
ROUND_KEYS = MEDIAN_KEYS + ("error",)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="few steps: a smoke check (its rewards mean nothing)")
    ap.add_argument("--small", action="store_true", help="the 0.14M-parameter model of earlier figures (default: ~20M)")
    ap.add_argument("--steps", type=int, default=None, help="GRPO optimizer steps of each run (default 10; the first is "
                    "the warm-up)")
    ap.add_argument("--hidden", type=int, default=None, help="the model's hidden size (default 512; MLP 3x, heads of 16)")
    ap.add_argument("--layers", type=int, default=None, help="the model's layers (default 6)")
    ap.add_argument("--sft-steps", type=int, default=None, help="steps of the SFT warm start (default 200)")
    ap.add_argument("--eval-samples", type=int, default=None, help="completions per prompt when scoring the final "
                    "policies (default 4)")
    ap.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                    help="both sides: auto (default) is bf16 autocast where the CPU has native bf16 (AVX512-BF16 / AMX), "
                    "as trainforge's precision: auto decides, else fp32 (emulated bf16 matmuls ran ~25x slower than fp32 "
                    "on an AVX2 CPU, and both sides then measure torch's emulation)")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated: {', '.join(RUNS + EXTRA)}")
    add_common_arguments(ap)
    args = ap.parse_args()
    if args.precision == "auto":
        from trainforge.hardware.device import cpu_has_native_bf16

        args.precision = "bf16" if cpu_has_native_bf16() else "fp32"
    if args.out is None:  # one file per model size and precision: a day's runs do not overwrite each other
        size = "small" if args.small else f"h{args.hidden}" if args.hidden else "20m"
        args.out = RESULTS / f"compare_grpo-{size}-{args.precision}-{datetime.date.today().isoformat()}.json"
    if args.child:
        child(args.child, args.spec, args.result)
        return 0
    runs = known_runs(ap, args.runs, RUNS + EXTRA)
    work = start_session(args, "tf-compare-grpo-")
    started = time.perf_counter()
    try:
        import torch

        s = build_inputs(work, settings(args))
        spec = work / "spec.json"
        spec.write_text(json.dumps(s, indent=2))
        g = s["grpo"]
        print(f"model: llama {s['model']}, vocab {s['vocab_size']}, {s['parameters'] / 1e6:.2f}M parameters; "
              f"{s['prompts']} builtin:arithmetic prompts; {s['steps']} steps of {g['prompts_per_step']} prompts x "
              f"{g['num_generations']} completions (micro-batch {g['micro_batch_size']} x grad_accum {g['grad_accum']}), "
              f"up to {g['max_completion_length']} tokens, loss {g['loss']}, beta {g['beta']}, {s['precision']}; "
              f"{args.threads} threads per run; torch {torch.__version__}", flush=True)
        sft = launch_child(__file__, "sft", spec, work, args.threads)
        if "error" in sft:
            return 1
        print(f"  sft (the starting policy, untimed): {sft['steps']} steps in {sft['train_s']:.1f}s, final loss "
              f"{sft['final_train_loss']:.3f}", flush=True)

        def run_one(name: str) -> dict:
            r = launch_child(__file__, name, spec, work, args.threads)
            if "error" in r:
                return r
            if name == "rollout":
                print(f"  rollout: trainforge {r['trainforge_tokens_per_s']:,.0f} tok/s, generate "
                      f"{r['generate_tokens_per_s']:,.0f} tok/s (medians of {r['batches']} batches of "
                      f"{r['completions_per_batch']}; per batch {', '.join(f'{x:.2f}x' for x in r['ratio_per_batch'])})",
                      flush=True)
            else:
                print(f"  {name}: {r['steps']} steps, {r['completions_per_s']:.1f} completions/s (median step after the "
                      f"first; {r['completions_per_s_all']:.1f} over all), wall {r['wall_s']:.1f}s, peak RSS "
                      f"{r['peak_rss_bytes'] / 2**20:,.0f} MiB, reward {r['rewards'][0]:.3f} -> {tail_mean(r['rewards']):.3f}",
                      flush=True)
            return r

        results = {n: combine(rs, MEDIAN_KEYS, ROUND_KEYS) for n, rs in run_rounds(runs, args.repeat, run_one).items()}
        print("sampling every policy with one function (fp32, a fixed seed) ...", flush=True)
        start = final_reward(s, None)
        for r in results.values():
            if "error" not in r and "final_dir" in r:
                r.update(final_reward(s, r["final_dir"]))
        print(legend(args, "compl/s: completions per second of the median step after the first (best: of the fastest; mean: of those "
                           "steps' total time; all: over every step; /cpu-s: per second of the process's CPU time, after the first "
                           "step); gen: seconds a step spends sampling (trainforge: "
                           "and scoring) and its completion tokens/s, medians over the steps after the first; reward: the "
                           "training reward of the first step and the mean of the last 3; final reward: every prompt "
                           f"sampled {s['eval_samples']} times at temperature {g['temperature']}, mean ± standard error")
              .rsplit("; eval:", 1)[0])  # the shared legend's last clause is about held-out rows: here all the prompts
        print(f"\nstarting policy (the SFT model): final reward {start['final_reward']:.3f} ± {start['final_reward_se']:.3f}")
        print(HEADER)
        for n in runs:
            if n != "rollout":
                print(fmt_row(results[n]))
        for n in runs:
            r = results[n]
            if n.startswith("trl") and "error" not in r and r["bf16"] and r["generation_autocast"] == [False]:
                print(f"  {n}: bf16 autocast in its training forwards only; it sampled without autocast (fp32)")
        comparisons = compare(results)
        end_session(args, started, settings=s, starting_policy=start, sft=sft, runs=results, comparisons=comparisons,
                    date=datetime.date.today().isoformat())
        if args.out:
            print(f"wrote {args.out}")
        return 0
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
