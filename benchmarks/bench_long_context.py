"""Long rows side by side: peak memory and tokens/s per row length, and the longest row under a memory cap, for
trainforge (its long-context levers on auto), Hugging Face ``Trainer`` + PEFT with gradient checkpointing, and TRL
``SFTTrainer`` with ``padding_free=True``; with trainforge's own prediction (``plan --longest``) beside them.

    python benchmarks/bench_long_context.py [--shape small] [--lengths 4096 8192 16384] [--longest] [--cap-gib 16]
        [--runs trainforge,hf-peft,trl-padding-free] [--steps 2] [--precision bf16|fp32] [--device cpu|cuda]
        [--threads N] [--workdir DIR] [--out results.json]

The model: a Llama shape built here (``--shape``: tiny, for a smoke run; small, 4 layers of 256 with a 32,000-token
vocabulary, the shape docs/long-context.md measured; 0.1b, 12 layers of 768), random weights saved once, a byte-level
BPE trained once on the Python standard library's sources; every run loads the same directory. LoRA r=16 (alpha 32,
no dropout) on every linear layer but the head, one row of exactly LENGTH tokens per step (each document is longer and
is cut there), AdamW at the same learning rate. ``--precision bf16``: the frozen base stored in bf16, adapters in
fp32, bf16 autocast (HF: ``bf16=True``); fp32 where the CPU has no native bf16 (emulated bf16 is several times slower).

The runs, each (length, run) in its own process:
- ``trainforge``: ``trainforge.train`` with ``activation_checkpointing``, ``tiled_mlp`` and ``activation_offload`` on
  auto and ``$TRAINFORGE_MEMORY_GIB`` at the cap, as a user with that much memory runs it (a length it predicts past
  the cap is refused before loading: exit 4, shown as ``refused``); its decisions are recorded;
- ``hf-peft``: ``transformers.Trainer`` on a PEFT model, ``gradient_checkpointing=True`` (non-reentrant), the model's
  default attention, rows tokenized and cut at LENGTH, ``labels = input_ids``;
- ``trl-padding-free``: ``trl.SFTTrainer`` with ``padding_free=True`` (with TRL's BFD packing, which TRL requires for
  ``padding_free`` under ``max_length``), ``gradient_checkpointing=True``, PEFT's ``LoraConfig``; skipped, and said,
  where TRL is not installed (pip install 'trainforge[bench]').

Measured per process: the peak RSS (``ru_maxrss``; ``--device cuda``: the GPU's peak reserved memory) and the last
step's seconds (the first step warms up: ``--steps 2`` or more for tokens/s; ``--steps 1`` gives the peak only).
The cap is enforced in every process: on a CPU a watchdog thread ends the process (exit 3) once its RSS passes the
cap, so a run past it never takes the machine's memory; on a GPU ``torch.cuda.set_per_process_memory_fraction``.

``--longest``: for each run, the longest length whose step stays under the cap, to within ``--tolerance`` (5%): a
bracket, then bisection, each probe one step in its own process. HF's and TRL's brackets double from ``--start``;
trainforge's starts at its own prediction (below) less the tolerance and goes on a step of twice the tolerance above
(three probes where the prediction holds, each near the ceiling: on a CPU the longest). For
trainforge the probes set ``activation_checkpointing`` and ``tiled_mlp`` true (what auto takes at such lengths) and
leave ``$TRAINFORGE_MEMORY_GIB`` unset, so that neither the levers' auto nor the refusal of a length predicted past
the cap decides the outcome: the cap alone does, as for the others. trainforge's prediction comes first, in a fresh
process with ``$TRAINFORGE_MEMORY_GIB`` at the cap: what ``trainforge plan CONFIG --longest`` prints as
``data.max_length: auto takes`` (``auto_length``; ``--plan-table``: the whole ``plan --longest``). The model declares
``--max-length`` positions, so the prediction is capped where the probes stop. After the searches the table adds HF's
longest length to ``--lengths`` (trainforge's peak there against HF's).

Prints one JSON line per measurement as it comes, then a summary; ``--out`` writes everything as JSON. No network.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

T0 = time.perf_counter()
SHAPES = {
    "tiny": dict(vocab_size=2048, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4),
    "small": dict(vocab_size=32000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4),
    "0.1b": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=12),
    # Llama-3.1-8B's shape (gpu_suite.py's part 6: its QLoRA's longest row on a GPU); built on the device in bf16
    "llama-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0),
}
TOKENIZER_VOCAB = 32000  # the BPE's size at most: a 128k-entry one takes minutes to train; the model's rows stay
RUNS = ("trainforge", "hf-peft", "trl-padding-free")
METHODS = ("lora", "qlora")  # QLoRA: the base in 4-bit NF4 with double quantization on both sides
LORA = {"r": 16, "alpha": 32, "dropout": 0.0}
LR = 2e-4
OVER_CAP = 3  # a child's exit code when its memory passed the cap
DOC_MARGIN = 1.05  # documents are this much (and 64 tokens) longer than the row, so every row is full after re-tokenizing


# ---------------------------------------------------------------- the shared model, tokenizer and documents


def prepare(work: Path, shape: str, positions: int, device: str = "cpu", corpus_files: int = 3000) -> Path:
    """The model directory (random Llama weights of ``shape``, ``positions`` rotary positions, a BPE of at most
    ``TOKENIZER_VOCAB`` tokens), built once per shape, position count and device: on a GPU built there in bf16 (an
    8B model's fp32 init on the host takes minutes and 32 GB), on a CPU in fp32."""
    on_gpu = device == "cuda"
    model_dir = work / f"model-{shape}-{positions}{'-bf16' if on_gpu else ''}"
    if (model_dir / "config.json").is_file():
        return model_dir
    import sysconfig

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from trainforge.model.tokenizer import train_bpe_tokenizer

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files[:corpus_files]]
    tok = train_bpe_tokenizer(texts, vocab_size=min(SHAPES[shape]["vocab_size"], TOKENIZER_VOCAB))
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=positions, tie_word_embeddings=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if on_gpu else torch.float32)
    model.save_pretrained(model_dir)
    del model
    tok.save_pretrained(model_dir)
    (work / f"corpus-{shape}.json").write_text(json.dumps([t for t in texts if t.strip()]))
    return model_dir


def documents(work: Path, shape: str, length: int, n: int, model_dir: Path) -> Path:
    """A JSONL of ``n`` text documents each longer than ``length`` tokens (the corpus's token stream cut in pieces, from
    its start, wrapping around), for every run alike."""
    path = work / f"docs-{shape}-{length}-{n}.jsonl"
    if path.is_file():
        return path
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = json.loads((work / f"corpus-{shape}.json").read_text())
    piece = int(length * DOC_MARGIN) + 64
    ids: list[int] = []
    for text in texts:  # enough of the stream for n pieces
        ids.extend(tok(text)["input_ids"])
        if len(ids) >= piece * n:
            break
    while len(ids) < piece * n:
        ids = ids + ids
    with path.open("w") as f:
        for k in range(n):
            f.write(json.dumps({"text": tok.decode(ids[k * piece:(k + 1) * piece])}) + "\n")
    return path


# ---------------------------------------------------------------- one measurement, in its own process


def guard(cap_bytes: int, device: str) -> None:
    """Hold this process under the cap: a CPU watchdog that ends it (exit ``OVER_CAP``) once its RSS passes the cap, or
    the GPU allocator's per-process fraction (an out-of-memory error past it)."""
    if device == "cuda":
        import torch

        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / torch.cuda.get_device_properties(0).total_memory))
        return

    def watch() -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while True:
            with open("/proc/self/statm") as f:
                if int(f.read().split()[1]) * page > cap_bytes:
                    sys.stderr.write(f"over the cap of {cap_bytes / 2**30:.2f} GiB: stopped\n")
                    sys.stderr.flush()
                    os._exit(OVER_CAP)
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()


def peak_bytes(device: str) -> int:
    if device == "cuda":
        import torch

        return int(torch.cuda.max_memory_reserved())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


class StepClock:
    """Seconds of each optimizer step of an HF / TRL trainer (a callback)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.start = 0.0

    def callback(self):
        from transformers import TrainerCallback

        clock = self

        class Clock(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                clock.start = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                clock.seconds.append(time.perf_counter() - clock.start)

        return Clock()


def hf_args(s: dict, out: Path) -> dict:
    """The TrainingArguments every HF-side run shares."""
    return dict(output_dir=str(out), per_device_train_batch_size=1, gradient_accumulation_steps=1, max_steps=s["steps"],
                learning_rate=LR, warmup_steps=0, lr_scheduler_type="constant", bf16=s["precision"] == "bf16",
                gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}, report_to="none",
                save_strategy="no", logging_steps=10**6, disable_tqdm=True, use_cpu=s["device"] == "cpu", seed=0,
                dataloader_num_workers=0)


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"], target_modules="all-linear",
                      task_type="CAUSAL_LM")


def base_model(s: dict):
    """The frozen base as trainforge stores it: bf16 or fp32 weights; ``qlora``: 4-bit NF4 with double quantization,
    computing in the run's precision (bitsandbytes, as PEFT's QLoRA guide and trainforge load it)."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if s["precision"] == "bf16" else torch.float32
    if s["method"] == "qlora":
        from transformers import BitsAndBytesConfig

        nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                 bnb_4bit_compute_dtype=dtype)
        return AutoModelForCausalLM.from_pretrained(s["model_dir"], dtype=dtype, quantization_config=nf4,
                                                    device_map={"": s["device"] if s["device"] == "cpu" else 0})
    return AutoModelForCausalLM.from_pretrained(s["model_dir"], dtype=dtype).to(s["device"])


def hf_peft_model(s: dict):
    """HF's LoRA model: PEFT on the base; for QLoRA after ``prepare_model_for_kbit_training`` (the recipe of PEFT's and
    TRL's docs: norms, embeddings and head upcast to fp32, input gradients on for checkpointing)."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    model = base_model(s)
    if s["method"] == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
    return get_peft_model(model, lora_config())


def hf_peft_step(model, s: dict, out: Path) -> dict:
    """``s["steps"]`` steps of ``Trainer`` on ``model`` over ``s["docs"]`` cut at ``s["length"]``: the last step's seconds."""
    from datasets import Dataset
    from transformers import AutoTokenizer, Trainer, TrainingArguments, default_data_collator

    tok = AutoTokenizer.from_pretrained(s["model_dir"])
    texts = [json.loads(line)["text"] for line in Path(s["docs"]).read_text().splitlines()]
    ids = [tok(t, truncation=True, max_length=s["length"])["input_ids"] for t in texts]
    ds = Dataset.from_dict({"input_ids": ids, "labels": [list(x) for x in ids]})
    clock = StepClock()
    trainer = Trainer(model=model, args=TrainingArguments(**hf_args(s, out)), train_dataset=ds,
                      data_collator=default_data_collator, callbacks=[clock.callback()])
    trainer.train()
    return {"step_s": clock.seconds[-1], "row_tokens": len(ids[0]), "attention": model.config._attn_implementation,
            "nf4_layers": nf4_layers(model)}


def nf4_layers(model) -> int:
    """How many of the model's layers hold 4-bit weights (bitsandbytes' ``Linear4bit``): QLoRA's base, on both sides."""
    return sum(type(m).__name__ == "Linear4bit" for m in model.modules())


def run_hf_peft(s: dict, out: Path) -> dict:
    return hf_peft_step(hf_peft_model(s), s, out)


def run_trl(s: dict, out: Path) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(s["model_dir"])
    texts = [json.loads(line)["text"] for line in Path(s["docs"]).read_text().splitlines()]
    args = SFTConfig(**hf_args(s, out), max_length=s["length"], padding_free=True, packing=True, packing_strategy="bfd",
                     dataset_text_field="text")
    clock = StepClock()
    trainer = SFTTrainer(model=base_model(s), args=args, train_dataset=Dataset.from_dict({"text": texts}),
                         processing_class=tok, peft_config=lora_config(), callbacks=[clock.callback()])
    trainer.train()
    return {"step_s": clock.seconds[-1], "padding_free": trainer.padding_free}


def run_trainforge(s: dict, out: Path) -> dict:
    from rich.console import Console

    from trainforge.config.run import RunConfig
    from trainforge.engine.trainer import train
    from trainforge.metrics.console import ConsoleReporter

    levers = "auto" if not s.get("forced_levers") else True
    cfg = RunConfig.model_validate({
        "model": {"path": s["model_dir"], "method": s["method"],
                  "lora": {"r": LORA["r"], "alpha": LORA["alpha"], "dropout": LORA["dropout"], "target_modules": "all-linear"}},
        "data": {"train": s["docs"], "eval": None, "format": "text", "max_length": s["length"], "too_long": "truncate",
                 "cache_dir": str(Path(s["work"]) / "cache"), "num_workers": 1},
        "train": {"max_steps": s["steps"], "micro_batch_size": 1, "grad_accum": 1, "precision": s["precision"],
                  "device": s["device"], "compile": False, "activation_checkpointing": levers, "tiled_mlp": levers,
                  "activation_offload": "auto", "eval_every": None, "cpu_threads": s["threads"]},
        "optim": {"lr": LR, "warmup_steps": 0, "schedule": "constant"},
        "checkpoint": {"every_steps": None, "every_minutes": None},
        "log": {"every_steps": 1, "report": False, "sample_prompt": None},
    })
    result = train(cfg, out, ConsoleReporter(Console(quiet=True)))
    summary = result.summary
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "elapsed_s" in r and "step" in r]
    last = steps[-1]["elapsed_s"] - (steps[-2]["elapsed_s"] if len(steps) > 1 else 0.0)
    keys = ("max_length_reason", "activation_checkpointing", "micro_batch_size_reason", "activation_checkpointing_reason",
            "predicted_peak_memory_bytes")
    tiled = any(hasattr(m, "trainforge_tile_tokens") for m in result.model.modules())  # what tiled_mlp became
    return {"step_s": last, "decisions": {k: summary.get(k) for k in keys}, "tiled_mlp": tiled, "nf4_layers": nf4_layers(result.model)}


def settle(s: dict) -> None:
    """A measuring process's set-up: the cap enforced, the CPU's threads."""
    guard(int(s["cap_gib"] * 2**30), s["device"])
    import torch

    if s["device"] == "cpu":
        torch.set_num_threads(s["threads"])


def finish(result: dict, s: dict, peak: int) -> dict:
    return {**result, "peak_gib": round(peak / 2**30, 3), "tokens_per_s": round(s["length"] / result["step_s"], 1),
            "step_s": round(result["step_s"], 2)}


def child(spec: str) -> None:
    s = json.loads(spec)
    settle(s)
    out = Path(s["work"]) / "runs" / f"{s['run']}-{s['length']}-{os.getpid()}"
    result = {"trainforge": run_trainforge, "hf-peft": run_hf_peft, "trl-padding-free": run_trl}[s["run"]](s, out)
    print("RESULT " + json.dumps(finish(result, s, peak_bytes(s["device"]))), flush=True)


def serve(spec: str) -> None:
    """HF + PEFT's probes in one process (``--hf-search in-process``): the model loaded once, then one step per length
    read from stdin (``{"length": N, "docs": PATH}``), its result (``PROBE {...}``) or ``over the cap`` where the step ran
    out of memory (on a GPU the allocator's cap raises, the process frees the step and goes on). On a CPU the
    watchdog ends the process past the cap (the parent starts another) and a probe's peak is the process's running
    maximum, an upper bound: there the per-probe processes measure each length alone."""
    import gc

    import torch

    s = json.loads(spec)
    settle(s)
    model = hf_peft_model(s)
    print("READY", flush=True)
    for line in sys.stdin:
        ask = {**s, **json.loads(line), "steps": 1}
        if s["device"] == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            result = {"status": "ok", **finish(hf_peft_step(model, ask, Path(s["work"]) / "runs" / f"hf-peft-{ask['length']}"),
                                                ask, peak_bytes(s["device"]))}
        except torch.OutOfMemoryError as e:
            result = {"status": "over the cap", "error": str(e).splitlines()[0][:300]}
        except Exception as e:  # noqa: BLE001 - reported as the probe's outcome
            result = {"status": "failed", "error": f"{type(e).__name__}: {str(e)[:300]}"}
        model.zero_grad(set_to_none=True)  # what a step that ran out of memory left behind
        gc.collect()
        print("PROBE " + json.dumps(result), flush=True)


def child_env(run: str, s: dict, forced_levers: bool) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("TRAINFORGE_MEMORY_GIB", None)
    if run == "trainforge" and not forced_levers:  # auto decides for a machine of the cap's size, as a user's run does
        env["TRAINFORGE_MEMORY_GIB"] = str(s["cap_gib"])
    return env


def failure(returncode: int | None, stderr: str) -> dict:
    """Why a process gave no result: over the cap (the watchdog's exit, or an out-of-memory error), refused, killed."""
    status = {OVER_CAP: "over the cap", 4: "refused", -9: "killed"}.get(returncode, "failed")
    if "out of memory" in stderr.lower() and status == "failed":
        status = "over the cap"
    return {"status": status, "returncode": returncode, "error": (stderr.strip().splitlines() or ["(no output)"])[-1][:300]}


def measure(s: dict, run: str, length: int, steps: int, forced_levers: bool = False, timeout: float | None = None) -> dict:
    """One (run, length) in its own process: its result, or why it has none (over the cap, refused, failed)."""
    spec = {**s, "run": run, "length": length, "steps": steps, "forced_levers": forced_levers,
            "docs": str(documents(Path(s["work"]), s["shape"], length, steps + 1, Path(s["model_dir"])))}
    row = {"run": run, "length": length, "steps": steps}
    timeout = s["probe_timeout_s"] if timeout is None else timeout
    started = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                           env=child_env(run, s, forced_levers), timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**row, "status": "timeout", "wall_s": round(timeout, 1)}
    row["wall_s"] = round(time.perf_counter() - started, 1)
    found = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    if p.returncode == 0 and found:
        return {**row, "status": "ok", **json.loads(found[-1][7:])}
    return {**row, **failure(p.returncode, p.stderr)}


class ProbeServer:
    """The parent's side of ``serve``: one HF + PEFT process answering probes, started again where one died."""

    def __init__(self, s: dict) -> None:
        self.s, self.proc, self.lines, self.log_file = s, None, None, None
        self.log = Path(s["work"]) / "hf-peft-serve.log"
        self.log_from = 0  # where this process's output starts in the log (it is appended to across starts)

    def _start(self, timeout: float) -> str | None:
        import queue

        self.lines = queue.Queue()
        self.log_from = self.log.stat().st_size if self.log.is_file() else 0
        self.log_file = self.log.open("a")
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", json.dumps({**self.s, "run": "hf-peft"})],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log_file, text=True,
                                     env=child_env("hf-peft", self.s, False))

        def pump(out, lines) -> None:  # stdout to a queue, so a wait has a timeout; None: the process ended
            for line in out:
                lines.put(line.rstrip("\n"))
            lines.put(None)

        threading.Thread(target=pump, args=(self.proc.stdout, self.lines), daemon=True).start()
        return self._wait("READY", timeout)

    def _wait(self, prefix: str, timeout: float) -> str | None:
        import queue

        end = time.perf_counter() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, end - time.perf_counter()))
            except queue.Empty:
                self.close()
                return "timeout"
            if line is None:
                return None
            if line.startswith(prefix):
                return line

    def probe(self, length: int, timeout: float) -> dict:
        row = {"run": "hf-peft", "length": length, "steps": 1, "in_process": True}
        docs = str(documents(Path(self.s["work"]), self.s["shape"], length, 2, Path(self.s["model_dir"])))
        started = time.perf_counter()
        line = "READY" if self.proc is not None and self.proc.poll() is None else self._start(timeout)
        if line not in (None, "timeout"):
            try:
                self.proc.stdin.write(json.dumps({"length": length, "docs": docs}) + "\n")
                self.proc.stdin.flush()
                line = self._wait("PROBE ", timeout - (time.perf_counter() - started))
            except OSError:  # it ended between the look and the write (a broken pipe): as if it ended in the probe
                line = None
        row["wall_s"] = round(time.perf_counter() - started, 1)
        if line == "timeout":
            return {**row, "status": "timeout"}
        if line is None:  # the process ended: the watchdog's cap, or a crash (the log has its output)
            code = self.proc.wait()
            self.close()
            with self.log.open() as f:
                f.seek(self.log_from)
                return {**row, **failure(code, f.read()[-2000:])}
        return {**row, **json.loads(line[6:])}

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
        if self.log_file is not None:
            self.log_file.close()
            self.log_file = None


# ---------------------------------------------------------------- the longest row, the plan's prediction, the summary


def search(fits: Callable[[int], bool | None], start: int, granule: int, tolerance: float, max_length: int,
           seed: int | None = None) -> dict:
    """The longest length (a multiple of ``granule``, at most ``max_length``) for which ``fits`` says True, to within
    ``tolerance``: a bracket first (from ``seed`` less the tolerance when given, then a step of twice the tolerance
    above it; else doubling from ``start``; halving where the first probe does not fit), then bisection. ``fits``
    answers None where it cannot tell (a failure, a timeout, the budget spent): the search ends there, undecided."""
    g, tol = granule, tolerance

    def snap(n: float) -> int:
        return max(g, int(n) // g * g)

    lo, hi = 0, None
    n, grow = (snap(seed * (1 - tol)), 1 + 2 * tol) if seed else (snap(start), 2.0)
    if seed and seed >= max_length:  # the prediction is the longest allowed (the model's positions): probe that first
        n = snap(max_length)
    while n <= max_length:
        verdict = fits(n)
        if verdict is None:
            return {"longest": lo, "undecided_at": n}
        if verdict:
            lo = n
            if hi is not None:
                break
            n, grow = max(snap(n * grow), n + g), 2.0
            if n > max_length and lo < snap(max_length):  # the step overshoots the longest allowed: probe that one
                n = snap(max_length)
        else:
            hi = n
            if lo or n == g:
                break
            n = snap(n / (grow if seed else 2))  # below a prediction: a step of the same size down
    while hi is not None and hi - lo > max(g, tol * lo):
        mid = snap((lo + hi) / 2)
        if mid in (lo, hi):
            break
        verdict = fits(mid)
        if verdict is None:
            return {"longest": lo, "undecided_at": mid}
        lo, hi = (mid, hi) if verdict else (lo, mid)
    return {"longest": lo, "first_over": hi}


MIN_PROBE_S = 20.0  # a probe is not started with less of --budget-s left


def longest(s: dict, run: str, say, seed: int | None = None) -> dict:
    """``run``'s longest length whose one-step probe fits the cap (``search``; trainforge's from ``seed``, its own
    prediction), each probe in its own process, or HF + PEFT's in one (``--hf-search in-process``)."""
    probes: list[dict] = []
    server = ProbeServer(s) if run == "hf-peft" and s["hf_search"] == "in-process" else None

    def fits(n: int) -> bool | None:
        left = s["deadline"] - time.perf_counter()
        if left < MIN_PROBE_S:
            probes.append({"run": run, "length": n, "status": "budget spent"})
            return None
        timeout = min(s["probe_timeout_s"], left)
        r = server.probe(n, timeout) if server else measure(s, run, n, 1, forced_levers=run == "trainforge", timeout=timeout)
        if r["status"] == "ok" and r["peak_gib"] > s["cap_gib"]:  # past the cap between two of the watchdog's looks
            r = {**r, "status": "over the cap", "error": f"peak {r['peak_gib']} GiB, over the cap after the step"}
        probes.append(r)
        say(r)
        return None if r["status"] in ("timeout", "failed") else r["status"] == "ok"

    try:
        found = search(fits, s["start"], s["granule"], s["tolerance"], s["max_length"], seed)
    finally:
        if server:
            server.close()
    return {"run": run, **found, "probes": probes}


PREDICT = """
import json, sys
from dataclasses import replace
from trainforge.config.run import load_config
from trainforge.engine.predict.fit import FIT_MARGIN
from trainforge.engine.predict.longest import auto_length
from trainforge.tools.plan import plan_precision, plan_tokenizer, resolve_profile
cfg = load_config(sys.argv[1])
profile, device = resolve_profile("this", cfg)
precision, _ = plan_precision(cfg, profile, device)
tokenizer = plan_tokenizer(cfg)
# the whole cap to fill: this profile with the cap over FIT_MARGIN as its memory, its fixed cost read at the same moment
# (this process's memory before any trace), as a fresh process given that cap reads it on a machine that has it.
# First: the longest search starts from it, and a timeout keeps what ended
at_cap = replace(profile, memory_gib=profile.memory_gib / FIT_MARGIN)
machines = {"both": [("at-cap", at_cap), ("plan", profile)], "at-cap": [("at-cap", at_cap)]}[sys.argv[2]]
for which, machine in machines:
    found = auto_length(cfg, tokenizer, precision, machine)
    print(json.dumps({"which": which, "max_length": found.length, "why": found.why, "capacity_gib": machine.memory_gib}),
          flush=True)
"""


def predicted_longest(s: dict) -> tuple[dict, dict]:
    """trainforge's predicted longest lengths at the trainforge run's config on this machine capped at ``--cap-gib``, in
    one fresh process: (what ``trainforge plan CONFIG --longest`` prints as ``data.max_length: auto takes``, which keeps
    10% of the memory free (FIT_MARGIN); the memory model's longest with the whole cap to fill, the figure the measured
    longest, every process under the cap itself, checks). ``--plan-table``: the first from the whole ``plan --longest``
    in a process of its own (its table of levers too: a search per row)."""
    import yaml

    work = Path(s["work"])
    config = {"model": {"path": s["model_dir"], "method": s["method"], "lora": {"r": LORA["r"], "alpha": LORA["alpha"],
                                                                       "target_modules": "all-linear"}},
              "data": {"train": str(documents(work, s["shape"], s["start"], 2, Path(s["model_dir"]))), "eval": None,
                       "max_length": "auto", "cache_dir": str(work / "cache")},
              "train": {"micro_batch_size": 1, "precision": s["precision"], "device": s["device"], "cpu_threads": s["threads"]}}
    path = work / "plan-longest.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "TRAINFORGE_MEMORY_GIB": str(s["cap_gib"]), "HF_HUB_OFFLINE": "1"}

    def run(argv: list[str], lines: bool = True) -> tuple[list[dict], str | None]:
        """The answers (one JSON object a line; ``lines=False``: the whole output) and why there are none or fewer."""
        try:  # within --budget-s: on a device call a slow trace must not take the probes' time (nor the call's)
            p = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env,
                               timeout=max(1.0, min(s["deadline"] - time.perf_counter(), s["probe_timeout_s"])))
        except subprocess.TimeoutExpired as e:  # an answer that ended before the timeout is kept
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            return [json.loads(line) for line in out.splitlines() if lines and line.startswith("{")], "timed out (--budget-s)"
        error = None if p.returncode == 0 else (p.stderr.strip().splitlines() or ["?"])[-1]
        if not lines:
            return ([json.loads(p.stdout)] if error is None else []), error
        return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")], error

    def answer(found: list[dict], which: str, error: str | None) -> dict:
        got = [{k: v for k, v in x.items() if k != "which"} for x in found if x.get("which") == which]
        return {"auto": got[0]} if got else {"error": error or "no answer"}

    if not s["plan_table"]:
        found, error = run(["-c", PREDICT, str(path), "both"])
        return answer(found, "plan", error), answer(found, "at-cap", error)
    table, error = run(["-m", "trainforge", "plan", str(path), "--longest", "--json"], lines=False)
    plan = {"auto": table[0]["auto"], "table": table[0]} if table else {"error": error or "no answer"}
    found, error = run(["-c", PREDICT, str(path), "at-cap"])
    return plan, answer(found, "at-cap", error)


def summarize(results: dict) -> list[str]:
    """The figures the issue asks for, where the measurements give them."""
    lines, table = [], results["table"]
    by = {(r["run"], r["length"]): r for r in table if r["status"] == "ok"}
    for r in table:
        what = (f"peak {r['peak_gib']:.2f} GiB, {r['tokens_per_s']:,.0f} tokens/s" if r["status"] == "ok"
                else f"{r['status']} ({r.get('error', '')})")
        lines.append(f"{r['length']:>8,}  {r['run']:<17} {what}")
    longest_of = {x["run"]: x["longest"] for x in results.get("longest", [])}
    if longest_of:
        lines.append("longest under the cap: " + ", ".join(f"{k} {v:,}" for k, v in longest_of.items()))
        tf, hf = longest_of.get("trainforge"), longest_of.get("hf-peft")
        if tf and hf:
            lines.append(f"trainforge / hf-peft longest: x{tf / hf:.2f} (target >= 4x)")
            if ("trainforge", hf) in by and ("hf-peft", hf) in by:
                share = by[("trainforge", hf)]["peak_gib"] / by[("hf-peft", hf)]["peak_gib"]
                lines.append(f"peak at hf-peft's longest ({hf:,}): trainforge x{share:.2f} of hf-peft's (target <= 0.4x)")
        plan = results.get("plan", {}).get("auto", {}).get("max_length")
        model = results.get("model_at_cap", {}).get("auto", {}).get("max_length")
        if model and tf:
            lines.append(f"the memory model's longest with the whole cap: {model:,}, measured {tf:,}: {model / tf - 1:+.1%} "
                         "(target within 10%)")
        if plan and tf:
            lines.append(f"plan --longest (10% of the cap kept free) predicted {plan:,}: {plan / tf - 1:+.1%} of the measured")
    for n in sorted({r["length"] for r in table}):
        if ("trainforge", n) in by and ("hf-peft", n) in by:
            ratio = by[("trainforge", n)]["tokens_per_s"] / by[("hf-peft", n)]["tokens_per_s"]
            lines.append(f"tokens/s at {n:,}: trainforge x{ratio:.2f} of hf-peft's (target >= 1x)")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="small")
    ap.add_argument("--lengths", type=int, nargs="*", default=[4096, 8192, 16384])
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated, from " + ", ".join(RUNS))
    ap.add_argument("--steps", type=int, default=2, help="steps per table measurement (the last is timed)")
    ap.add_argument("--method", choices=METHODS, default="lora", help="qlora: the base in NF4 on both sides")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--cap-gib", type=float, default=16.0, help="the memory every process must stay under")
    ap.add_argument("--longest", action="store_true", help="also search each run's longest length under the cap")
    ap.add_argument("--start", type=int, default=4096, help="--longest: the first length probed")
    ap.add_argument("--granule", type=int, default=256, help="--longest: lengths are multiples of this")
    ap.add_argument("--tolerance", type=float, default=0.05,
                    help="--longest: the search ends where the longest that fits and the shortest that does not are "
                    "this share (or one granule) apart")
    ap.add_argument("--max-length", type=int, default=1 << 20,
                    help="--longest: no probe past this length (also the model's max_position_embeddings: the cap of "
                    "trainforge's predicted longest)")
    ap.add_argument("--plan-table", action="store_true", help="--longest: the prediction by the whole `plan --longest` "
                    "(its table of levers too: a search per row, minutes at long lengths)")
    ap.add_argument("--probe-timeout-s", type=float, default=4 * 3600.0, help="a measurement running longer is undecided")
    ap.add_argument("--hf-search", choices=["auto", "in-process", "per-probe"], default="auto",
                    help="--longest: HF + PEFT's probes in one process that loads the model once (auto: on a GPU, where "
                    "the allocator's peak resets per probe and an 8B model loads in tens of seconds) or each in its own")
    ap.add_argument("--budget-s", type=float, default=float("inf"),
                    help="no probe or measurement starts after this many seconds (a device call's limit); the searches "
                    "end undecided there")
    ap.add_argument("--corpus-files", type=int, default=3000,
                    help="standard-library files the BPE and the documents are made of (fewer: a quicker rehearsal)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--workdir", type=Path, default=Path("runs/bench_long_context"))
    ap.add_argument("--out", type=Path, help="write every measurement and the summary as JSON")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child)
    if args.serve:
        return serve(args.serve)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if set(runs) - set(RUNS):
        ap.error(f"unknown runs: {', '.join(sorted(set(runs) - set(RUNS)))}")
    try:
        import trl  # noqa: F401
    except ImportError:
        if "trl-padding-free" in runs:
            runs.remove("trl-padding-free")
            print("trl-padding-free: skipped, TRL is not installed (pip install 'trainforge[bench]')", flush=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    hf_search = args.hf_search if args.hf_search != "auto" else "in-process" if args.device == "cuda" else "per-probe"
    s = {"shape": args.shape, "method": args.method, "hf_search": hf_search, "precision": args.precision, "device": args.device, "cap_gib": args.cap_gib,
         "threads": args.threads, "work": str(args.workdir.resolve()), "start": args.start, "granule": args.granule, "tolerance": args.tolerance,
         "max_length": args.max_length, "probe_timeout_s": args.probe_timeout_s, "plan_table": args.plan_table,
         "model_dir": str(prepare(args.workdir.resolve(), args.shape, args.max_length, args.device, args.corpus_files)),
         "deadline": T0 + args.budget_s}
    results: dict = {"settings": {k: v for k, v in s.items() if k not in ("work", "deadline")}, "lora": LORA, "shape": SHAPES[args.shape],
                     "table": [], "started": time.strftime("%Y-%m-%d %H:%M:%S")}

    def say(r: dict) -> None:  # each measurement as it comes; --out rewritten, so a run cut short keeps what ended
        print(json.dumps(r), flush=True)
        if args.out:
            tmp = args.out.with_suffix(".tmp")
            tmp.write_text(json.dumps({**results, "summary": summarize(results)}, indent=2))
            tmp.replace(args.out)

    lengths = sorted(set(args.lengths))
    if args.longest:
        if "trainforge" in runs:  # first: its answer is where trainforge's search starts
            results["plan"], results["model_at_cap"] = predicted_longest(s)
            say({"plan": results["plan"], "model_at_cap": results["model_at_cap"]})
        seed = results.get("model_at_cap", {}).get("auto", {}).get("max_length") or None
        results["longest"] = []
        for run in runs:
            results["longest"].append(longest(s, run, say, seed if run == "trainforge" else None))
            say({"longest": {k: v for k, v in results["longest"][-1].items() if k != "probes"}})
        hf = next((x["longest"] for x in results["longest"] if x["run"] == "hf-peft"), 0)
        lengths = sorted(set(lengths) | ({hf} if hf else set()))
    for n in lengths:
        for run in runs:
            left = s["deadline"] - time.perf_counter()
            row = ({"run": run, "length": n, "steps": args.steps, "status": "budget spent"} if left < MIN_PROBE_S
                   else measure(s, run, n, args.steps, timeout=min(s["probe_timeout_s"], left)))
            results["table"].append(row)
            say(row)
    results["summary"] = summarize(results)
    print("\n".join(results["summary"]))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
