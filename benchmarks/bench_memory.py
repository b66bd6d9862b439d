"""Memory levers side by side: peak process memory and tokens/s of one model under each lever.

    python benchmarks/bench_memory.py [--quick] [--steps 3] [--runs NAME,NAME] [--batch-size 4] [--max-length 256] [--out results.json]

One Llama-shaped model (~170M parameters, untied; --quick: ~1M) saved once in fp32, one
prompt/completion JSONL (documented stdlib functions), the same hyperparameters everywhere:
micro-batch 4 rows of 256 tokens (`--batch-size`, `--max-length`), packed (TRL: packing=True, its padding-free BFD), LoRA r 16 /
alpha 32 on every linear layer of the blocks, lr 1e-4, `--steps` optimizer steps. Each run is
its own subprocess, one after another; its peak RSS is the process's own high-water mark over
the whole run, which is what decides whether a run fits.

Each trainforge run also records its memory by phase (Linux: the process's high-water mark `VmHWM`,
read and reset through `/proc/self/clear_refs` at each phase's end):
- `load`: from the start of the process to the first step (imports, data, building the model);
- `steps`: the training steps but the last (optimizer state created, steady state reached);
- `traced_step`: the last step, run under `trainforge plan --measure`'s tracer (`StepTracer`,
  every tensor counted as it is allocated and freed): its live tensor peak and parts;
- `finish`: what follows the last step (final/ saved, summary.json and report.html written).
The peak RSS of the whole run is the largest of them. TRL runs record `load` (to `on_train_begin`),
`steps` (to `on_train_end`) and `finish`.

trainforge runs (`trainforge.engine.trainer.train`, through the same config a CLI user writes):
- `tf-full-fp32`: full fine-tune, fp32.           - `tf-full-fp32-ckpt`: + activation checkpointing.
- `tf-lora-fp32`: LoRA on an fp32 base.           - `tf-lora-bf16`: LoRA, bf16 run: the frozen base in bf16.
- `tf-lora-bf16-ckpt`: + activation checkpointing. - `tf-qlora-bf16-ckpt`: NF4 base (bitsandbytes), bf16 compute.
- `tf-lora-bf16-peft`, `tf-qlora-bf16-ckpt-peft`: those two on PEFT's own LoRA forward (`model.lora.fused: false`).
What a user would otherwise run (TRL `SFTTrainer`, i.e. HF Trainer + PEFT, with `peft_config`):
- `trl-lora-bf16-ckpt`: the base loaded in bf16 (`model_init_kwargs={"dtype": bfloat16}`), `bf16=True`,
  `gradient_checkpointing=True` (TRL's defaults), packing=True.
- `trl-qlora-bf16-ckpt`: the same on an NF4 base (`BitsAndBytesConfig`, double quantization).

Needs the dev extra (pip install 'trainforge[bench]'), and bitsandbytes for the QLoRA runs
('trainforge[qlora]'). No network.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_hf import Counter, hf_common_args, write_jsonl  # noqa: E402  (one definition of the HF-side harness)

TF_RUNS = {  # name -> trainforge config overrides
    "tf-full-fp32": {"model.method": "full", "train.precision": "fp32"},
    "tf-full-fp32-ckpt": {"model.method": "full", "train.precision": "fp32", "train.activation_checkpointing": True},
    "tf-lora-fp32": {"model.method": "lora", "train.precision": "fp32"},
    "tf-lora-bf16": {"model.method": "lora", "train.precision": "bf16"},
    "tf-lora-bf16-ckpt": {"model.method": "lora", "train.precision": "bf16", "train.activation_checkpointing": True},
    "tf-qlora-bf16-ckpt": {"model.method": "qlora", "train.precision": "bf16", "train.activation_checkpointing": True},
    # the same on PEFT's own LoRA forward (model.lora.fused: false): what the fused layers save
    "tf-lora-bf16-peft": {"model.method": "lora", "train.precision": "bf16", "model.lora.fused": False},
    "tf-qlora-bf16-ckpt-peft": {"model.method": "qlora", "train.precision": "bf16", "train.activation_checkpointing": True,
                                "model.lora.fused": False},
}
TRL_RUNS = ("trl-lora-bf16-ckpt", "trl-qlora-bf16-ckpt")
RUNS = (*TF_RUNS, *TRL_RUNS)
# trainforge against TRL on the same settings, then the fused LoRA layers against PEFT's forward
PAIRS = (("tf-lora-bf16-ckpt", "trl-lora-bf16-ckpt"), ("tf-qlora-bf16-ckpt", "trl-qlora-bf16-ckpt"),
         ("tf-lora-bf16", "tf-lora-bf16-peft"), ("tf-qlora-bf16-ckpt", "tf-qlora-bf16-ckpt-peft"))


def settings(args: argparse.Namespace) -> dict:
    if args.quick:
        model = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4}
        vocab, rows = 2048, 64
    else:
        # ~170M parameters: 12 x 12.85M in the blocks, 2 x 8.4M in the untied embeddings and head
        model = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 12, "num_attention_heads": 16}
        vocab, rows = 8192, 400
    return {
        "model": model, "vocab_size": vocab, "rows": rows, "max_length": args.max_length, "batch_size": args.batch_size,
        "steps": args.steps,
        "lora": {"r": 16, "alpha": 32}, "lr": 1.0e-4, "seed": 0, "threads": args.threads,
        "optim": {"lr": 1.0e-4, "min_lr_ratio": 0.1, "warmup_steps": 0, "weight_decay": 0.0, "betas": [0.9, 0.999],
                  "eps": 1.0e-8, "max_grad_norm": 1.0},
    }  # fmt: skip


def build_inputs(work: Path, s: dict) -> dict:
    """The SFT rows, a tokenizer trained on them, and the fp32 model every run starts from."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from trainforge.data.sources import iter_python_functions
    from trainforge.model.tokenizer import train_bpe_tokenizer

    rows, seen = [], set()
    for r in iter_python_functions():
        key = (r.data["prompt"], r.data["completion"])
        if key not in seen:
            seen.add(key)
            rows.append({"prompt": key[0], "completion": key[1]})
        if len(rows) == s["rows"]:
            break
    write_jsonl(work / "sft.jsonl", rows)
    tok = train_bpe_tokenizer([r["prompt"] + r["completion"] for r in rows], s["vocab_size"])
    config = LlamaConfig(vocab_size=len(tok), num_key_value_heads=s["model"]["num_attention_heads"], max_position_embeddings=1024,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False, **s["model"])
    torch.manual_seed(s["seed"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(work / "model")
    tok.save_pretrained(work / "model")
    s["parameters"] = sum(p.numel() for p in model.parameters())
    s["paths"] = {"work": str(work), "model_dir": str(work / "model"), "sft_train": str(work / "sft.jsonl")}
    return s


# ---------------------------------------------------------------- children


GIB = 2**30
STATUS, CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def status_bytes(field: str) -> int | None:
    """A memory field of /proc/self/status in bytes: ``VmHWM`` (peak RSS since start or since the last
    ``reset_high_water``), ``VmRSS`` (now)."""
    try:
        line = next(x for x in STATUS.read_text().splitlines() if x.startswith(field + ":"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return None


def reset_high_water() -> bool:
    """Start a new high-water mark at the current RSS (``echo 5 > /proc/self/clear_refs``)."""
    try:
        CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


class Phases:
    """Peak RSS of each phase of a run: the high-water mark read, then reset, at each phase's end."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}
        self.rss_after: dict[str, int] = {}  # resident memory when the phase ended

    def end(self, phase: str) -> None:
        hwm, now = status_bytes("VmHWM"), status_bytes("VmRSS")
        if hwm is not None and reset_high_water():
            self.peaks[phase], self.rss_after[phase] = hwm, now

    def whole_run(self) -> int:
        """The run's peak RSS: the largest phase, or ``ru_maxrss`` where phases cannot be told apart."""
        rest = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # since the last reset, or since start
        return max([rest, *self.peaks.values()]) if self.peaks else rest


def trace_last_step(phases: Phases) -> dict:
    """Patch trainforge's loop so that its last step runs under ``StepTracer`` (the live tensor peak of a
    steady-state step, as ``trainforge plan --measure`` takes it), with the phases' ends marked around it."""
    from trainforge.engine import trainer
    from trainforge.engine.predict.trace import StepTracer

    found: dict = {}
    state: dict = {}
    loop, fb, opt_step = trainer.train_loop, trainer.forward_backward_adaptive, trainer.optimizer_step

    def train_loop(run):
        phases.end("load")
        loop(run)

    def forward_backward_adaptive(run, *args, **kwargs):
        if run.step == run.max_steps - 1 and run.step > 0:  # the last step, with optimizer state: steady state
            phases.end("steps")
            tracer = StepTracer()
            tracer.track_training_state(run.model, run.optimizer, run.params)
            tracer.__enter__()
            state["tracer"] = tracer
        return fb(run, *args, **kwargs)

    def optimizer_step(*args, **kwargs):
        out = opt_step(*args, **kwargs)
        tracer = state.pop("tracer", None)
        if tracer is not None:
            tracer.__exit__(None, None, None)
            tracer.close()
            tracer.ops.clear()
            found.update(live_tensor_peak_bytes=tracer.peak, live_tensor_parts=tracer.peak_parts)
            phases.end("traced_step")
        return out

    trainer.train_loop, trainer.forward_backward_adaptive, trainer.optimizer_step = train_loop, forward_backward_adaptive, optimizer_step
    return found


def run_trainforge(s: dict, name: str, out: Path, phases: Phases) -> dict:
    from rich.console import Console

    from trainforge.config.run import load_config
    from trainforge.engine.trainer import train
    from trainforge.metrics.console import ConsoleReporter

    o = s["optim"]
    overrides = {
        "model.path": s["paths"]["model_dir"], "model.lora.r": s["lora"]["r"], "model.lora.alpha": s["lora"]["alpha"],
        "data.train": s["paths"]["sft_train"], "data.eval": None, "data.max_length": s["max_length"],
        "data.cache_dir": str(out / "cache"), "train.max_steps": s["steps"], "train.micro_batch_size": s["batch_size"],
        "train.seed": s["seed"], "train.compile": False, "optim.lr": o["lr"], "optim.weight_decay": o["weight_decay"],
        "optim.betas": o["betas"], "optim.warmup_steps": 0, "optim.min_lr_ratio": o["min_lr_ratio"],
        "checkpoint.every_minutes": None, **TF_RUNS[name],
    }  # fmt: skip
    cfg = load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()] + ["model.init=null", "log.sample_prompt=null"])
    traced = trace_last_step(phases)
    sm = train(cfg, out / "run", ConsoleReporter(Console(quiet=True))).summary
    return {"steps": sm["steps"], "tokens": sm["tokens"], "train_s": sm["train_time_s"], "tokens_per_s": sm["tokens_per_s"],
            "final_train_loss": sm.get("final_train_loss"), "weights": sm.get("weights"), **traced}  # fmt: skip


def phase_callback(phases: Phases):
    """HF Trainer callback: the load phase ends where training begins, the steps phase where it ends."""
    from transformers import TrainerCallback

    class PhaseCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001 - transformers' signature
            phases.end("load")

        def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001
            phases.end("steps")

    return PhaseCallback()


def run_trl(s: dict, name: str, out: Path, phases: Phases) -> dict:
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    datasets.disable_progress_bars()
    tok = AutoTokenizer.from_pretrained(s["paths"]["model_dir"])
    ds = datasets.load_dataset("json", data_files=s["paths"]["sft_train"], split="train", cache_dir=str(out / "hf-cache"))
    kwargs = {"dtype": torch.bfloat16}
    if "qlora" in name:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16
        )
    model = AutoModelForCausalLM.from_pretrained(s["paths"]["model_dir"], **kwargs)
    counter = Counter(tok.pad_token_id)
    model.register_forward_pre_hook(counter.hook, with_kwargs=True)
    common = hf_common_args(s, out)
    common["lr_scheduler_type"] = "cosine_with_min_lr"
    args = SFTConfig(**common, per_device_train_batch_size=s["batch_size"], max_steps=s["steps"], max_length=s["max_length"],
                     packing=True, bf16=True, gradient_checkpointing=True)  # fmt: skip
    lora = LoraConfig(r=s["lora"]["r"], lora_alpha=s["lora"]["alpha"], target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, peft_config=lora,
                         callbacks=[counter.callback(), phase_callback(phases)])
    result = trainer.train()
    return {"steps": trainer.state.global_step, "tokens": counter.tokens, "train_s": counter.t1 - counter.t0,
            "tokens_per_s": counter.tokens / (counter.t1 - counter.t0), "final_train_loss": result.training_loss}  # fmt: skip


def child(name: str, spec: Path, result_path: Path) -> None:
    import torch

    s = json.loads(spec.read_text())
    torch.set_num_threads(s["threads"])
    out = Path(s["paths"]["work"]) / "runs" / name
    out.mkdir(parents=True, exist_ok=True)
    phases = Phases()
    r = run_trainforge(s, name, out, phases) if name in TF_RUNS else run_trl(s, name, out, phases)
    phases.end("finish")
    r["peak_rss_bytes"] = phases.whole_run()
    r["phase_peak_rss_bytes"], r["phase_end_rss_bytes"] = phases.peaks, phases.rss_after
    result_path.write_text(json.dumps(r, indent=2))


def run_child(name: str, spec: Path, work: Path, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore",
           "TRAINFORGE_CACHE": str(work / "tf-cache" / name)}  # fmt: skip
    result, log = work / f"result-{name}.json", work / f"log-{name}.txt"
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, __file__, "--child", name, "--spec", str(spec), "--result", str(result)],
                              env=env, stdout=f, stderr=subprocess.STDOUT)  # fmt: skip
    if proc.returncode != 0 or not result.is_file():
        tail = log.read_text()[-2500:]
        print(f"  {name}: FAILED (exit {proc.returncode})\n{tail}", flush=True)
        return {"name": name, "error": f"exit {proc.returncode}", "log_tail": tail}
    r = {"name": name, **json.loads(result.read_text())}
    by_phase = ", ".join(f"{k} {v / GIB:.2f}" for k, v in r.get("phase_peak_rss_bytes", {}).items())
    tensors = f", live tensors {r['live_tensor_peak_bytes'] / GIB:.3f} GiB" if "live_tensor_peak_bytes" in r else ""
    print(f"  {name}: {r['steps']} steps, {r['tokens']:,} tokens, {r['tokens_per_s']:,.0f} tok/s, "
          f"peak RSS {r['peak_rss_bytes'] / GIB:.2f} GiB ({by_phase}){tensors}", flush=True)  # fmt: skip
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    # shorter steps where bf16 is emulated (a CPU without AVX512-BF16/AMX multiplies bf16 at ~1 GFLOP/s):
    # weights, gradients and optimizer state do not depend on them, activations scale with them
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child")
    ap.add_argument("--spec", type=Path)
    ap.add_argument("--result", type=Path)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.spec, args.result)
        return 0
    work = Path(tempfile.mkdtemp(prefix="tf-memory-"))
    s = build_inputs(work, settings(args))
    spec = work / "spec.json"
    spec.write_text(json.dumps(s))
    print(f"model: {s['parameters'] / 1e6:.1f}M parameters; {s['steps']} steps of {s['batch_size']} x {s['max_length']} tokens", flush=True)
    results = {name: run_child(name, spec, work, args.threads) for name in args.runs.split(",")}
    base = results.get("tf-full-fp32", {}).get("peak_rss_bytes")
    print("\n| run | peak RSS | vs full fp32 | load phase | steps phase | live tensors of a step | tokens/s |\n|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | failed: {r['error']} | | | | | |")
            continue
        rel = f"{r['peak_rss_bytes'] / base:.2f}x" if base else ""
        ph = r.get("phase_peak_rss_bytes", {})
        load, steps = (f"{ph[k] / GIB:.2f} GiB" if k in ph else "-" for k in ("load", "steps"))
        live = f"{r['live_tensor_peak_bytes'] / GIB:.3f} GiB" if "live_tensor_peak_bytes" in r else "-"
        print(f"| {name} | {r['peak_rss_bytes'] / GIB:.2f} GiB | {rel} | {load} | {steps} | {live} | {r['tokens_per_s']:,.0f} |")
    for mine, theirs in PAIRS:
        a, b = results.get(mine, {}), results.get(theirs, {})
        if "peak_rss_bytes" in a and "peak_rss_bytes" in b:
            print(f"{mine} / {theirs}: peak RSS {a['peak_rss_bytes'] / b['peak_rss_bytes']:.2f}x, "
                  f"tokens/s {a['tokens_per_s'] / b['tokens_per_s']:.2f}x")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"settings": s, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
