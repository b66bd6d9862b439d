"""The GPU truth in one command: trainforge against what users would otherwise run, side by side.

    python benchmarks/gpu_suite.py --part all --out gpu-results      # on one H100, parts of < 9 minutes (1 to 5)
    python benchmarks/gpu_suite.py --part 1 --out gpu-results        # one part per call (the device's limit)
    python benchmarks/gpu_suite.py --table gpu-results               # the README table from the parts' JSON
    python benchmarks/gpu_suite.py --part first --out gpu-results    # the headline variants of parts 1 and 3, in one call
    python benchmarks/gpu_suite.py --tiny --part all --out /tmp/s    # the same harness on a CPU, in seconds

A session is lent 15 minutes of device time in all: ``benchmarks/gpu_session.sh`` is its one call (the
CUDA tests, ``--part first``, then selftest in the time left; ``PART=5`` runs the MoE row instead). Parts 1 to 5 are
for sessions with more.

Rows (real shapes, random init from config, nothing downloaded; ``--tiny`` shrinks every shape):
  part 1: Llama-3.2-1B (hidden 2048, 16 layers, 32/8 heads, 128,256 vocabulary, tied), full fine-tune,
          packed prompt/completion at 2,048 tokens (completion-only loss);
  part 2: Qwen2.5-0.5B (hidden 896, 24 layers, 14/2 heads, 151,936 vocabulary, tied), full fine-tune,
          text blocks at 2,048 tokens, then one row of 8,192 tokens;
  part 3: Llama-3.1-8B (hidden 4096, 32 layers, 32/8 heads, 128,256 vocabulary), LoRA r16 on all
          linear layers, bf16 base built on the device, packed prompt/completion at 2,048 tokens.
  part 4: online RL: Qwen2.5-0.5B, LoRA r16 on all linear layers, GRPO with 8 completions per prompt (8 prompts
          a step, prompts of at most 128 tokens, completions of 256), every step sampling then learning;
  part 5: mixture of experts: Qwen3-30B-A3B's layer (hidden 2048, 32/4 heads of 128, 128 experts of 768, top-8,
          151,936 vocabulary) with 12 of its 48 layers, LoRA r16 on attention and every expert (PEFT:
          ``target_parameters`` on the 3-D expert weights, transformers' ``grouped_mm`` experts, the router's
          load-balancing loss on both sides), bf16 base, packed prompt/completion at 2,048 tokens;
  part 6: the longest row: Llama-3.1-8B's shape, QLoRA r16 on all linear layers, one row per step at micro-batch 1,
          the longest length whose step stays under a 16 GiB cap (``--long-cap-gib``; the card's whole memory
          would take minutes of attention per probe) for trainforge (long-context levers as auto takes them) and HF
          + PEFT (bitsandbytes NF4, ``prepare_model_for_kbit_training``, gradient checkpointing), found by
          ``bench_long_context.py --longest`` (trainforge's search from its own prediction, HF's in one process
          that loads the model once), with trainforge's peak at HF's longest beside HF's;
  first:  the baselines and trainforge's defaults of parts 1 and 3 first (Llama-1B: HF, trainforge; 8B LoRA:
          HF + PEFT, trainforge), then HF + Liger and trainforge compiled on the 1B row, with fewer steps.
Variants, at the same micro-batch, sequence length, optimizer (AdamW, same lr/schedule) and steps:
  hf:          transformers ``Trainer``, bf16 autocast + SDPA (what a user gets); rows packed the
               ``run_clm.py`` way (documents concatenated, prompts masked in the labels);
  hf-liger:    the same with ``use_liger_kernel=True`` (a tuned user; CUDA and liger-kernel only);
  trl-packed:  TRL ``SFTTrainer`` with ``packing=True, padding_free=True`` (prompt/completion rows);
  hf-peft:     ``hf`` with PEFT LoRA (the LoRA row's baseline), and hf-peft-liger;
  trl-grpo-peft: TRL ``GRPOTrainer`` with ``peft_config`` (the GRPO row's baseline; sampling with ``generate``, no
               vLLM, gradient checkpointing off as trainforge's is where the step fits), the same G, prompts per
               step, completion length, temperature, loss (``grpo``), beta 0 and reward function;
  trainforge:  ``trainforge train`` on its defaults (precision, attention, kernels, compile: auto);
  trainforge-compiled: the same with ``train.compile: true`` (compile seconds and steady gain);
  trainforge-fp8-compiled: ``train.fp8: true`` (torchao's FP8 linear layers) and ``train.compile: true``
               (parts 1 and 3; ``--tiny`` runs ``trainforge-fp8`` eager, emulated on the CPU);
  trainforge-default-allocator: trainforge's defaults on torch's default CUDA allocator instead of the
               expandable segments trainforge asks for (part 1, last: what the setting saves in reserved memory).
GRPO rows count the tokens each step learns from (prompt and completion, no padding) over the whole step's
time, sampling included, and report the late mean reward instead of the loss (a policy-gradient loss has no
scale to compare); plan's memory is checked against them, its speed is not (it predicts the learning step only).
Every variant is its own process. Reported: real (non-padding) tokens/s in steady state (the steps
after ``--warmup``) and over the whole loop, MFU against the device's dense bf16 peak (one FLOP count,
trainforge's, for every variant), peak reserved GPU memory (RSS on CPU) beside the peak that tensors
held (allocated; the difference is the allocator's fragmentation), the first step's extra
seconds (compile, autotuning), and the mean training loss of the last quarter of steps beside the
baseline's. Beside trainforge rows: what ``trainforge plan`` predicted (``--hardware h100``, or this
machine with ``--tiny``) for peak memory and tokens/s, and the error (flagged above 15% / 25%).
The data is synthetic and learnable: each document follows its own affine recurrence over token ids,
so every trainer sees the same tokens and the loss falls. Needs ``pip install 'trainforge[bench,gpu]'``;
a missing package skips its variants with the reason.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

T0 = time.perf_counter()
MIN_VARIANT_S = 30.0  # a variant is not started with less of the part's budget left than this
MEMORY_TOL, SPEED_TOL = 0.15, 0.25  # plan's error beyond which its model of the device needs fixing


@dataclass
class Row:
    """One model, data shape and method, run by every variant that applies."""

    name: str
    arch: dict  # model.init-style architecture fields
    method: str  # full | lora
    data: str  # sft (packed prompt/completion) | text (blocks)
    seq: int
    micro_batch: int
    steps: int
    variants: list[str] = field(default_factory=list)
    rl: dict = field(default_factory=dict)  # grpo rows: num_generations, max_completion_length, grad_accum


LLAMA_1B = dict(architecture="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=8192)
QWEN_05B = dict(architecture="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=8192)
LLAMA_8B = dict(architecture="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0, max_position_embeddings=8192)
FULL = ["hf", "hf-liger", "trainforge", "trainforge-compiled"]
DEFAULT_ALLOCATOR = "trainforge-default-allocator"  # trainforge without the expandable segments it asks CUDA for


QWEN3_30B_A3B = dict(architecture="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, norm_topk_prob=True, router_aux_loss_coef=0.001, vocab_size=151936,
                     tie_word_embeddings=False, rope_theta=1000000.0, max_position_embeddings=8192)
MOE_LAYERS = 12  # of its 48: 7.6B parameters (15 GiB in bf16), one variant well inside a device call
# an MoE's LoRA on both sides: attention's projections and every expert (PEFT's target_parameters, the 3-D weights)
MOE_LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
MOE_LORA_EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
MOE_HF_EXPERTS = "grouped_mm"  # transformers' fastest experts implementation on a GPU (one grouped GEMM per projection)


def is_moe(arch: dict) -> bool:
    return "num_experts" in arch


PARTS = ("1", "2", "3", "4", "5", "6", "first")  # ``--part all`` runs 1 to 6
LONG_PART = "6"  # the longest row: benchmarks/bench_long_context.py's search, not a Row of variants
LONG_BENCH = Path(__file__).with_name("bench_long_context.py")
GRPO = ["trl-grpo-peft", "trainforge"]


def grpo_row(name: str, arch: dict, prompt: int, completion: int, micro_batch: int, accum: int, steps: int) -> Row:
    """A GRPO row: ``micro_batch`` completions a pass, ``accum`` passes a step, 8 completions per prompt."""
    return Row(name, arch, "lora", "grpo", prompt, micro_batch, steps, list(GRPO),
               rl={"num_generations": 8, "max_completion_length": completion, "grad_accum": accum})


def parts(tiny: bool) -> dict[str, list[Row]]:
    """The suite's rows by part; ``tiny``: the same rows in shapes a CPU runs in seconds. Rows of one name
    in a part are one row run in pieces (``first`` measures both baselines before the extra variants)."""
    if tiny:
        small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)
        llama_1b, llama_8b = {**LLAMA_1B, **small}, {**LLAMA_8B, **small}
        return {
            "1": [Row("llama-1b-shape", llama_1b, "full", "sft", 128, 2, 8, FULL + ["trl-packed", DEFAULT_ALLOCATOR])],
            "2": [Row("qwen-0.5b-shape", {**QWEN_05B, **small}, "full", "text", 128, 2, 8, ["hf", "trainforge"]),
                  Row("qwen-0.5b-shape-8k", {**QWEN_05B, **small}, "full", "text", 256, 1, 6, ["hf", "trainforge"])],
            "3": [Row("llama-8b-shape-lora", llama_8b, "lora", "sft", 128, 2, 8,
                      ["hf-peft", "hf-peft-liger", "trainforge", "trainforge-fp8"])],
            # the tiniest GRPO step: one prompt's 8 completions of 6 tokens, learned from in one pass
            "4": [grpo_row("qwen-0.5b-shape-grpo", {**QWEN_05B, **small}, prompt=16, completion=6, micro_batch=8, accum=1, steps=4)],
            "5": [Row("qwen3-30b-a3b-shape-lora", {**QWEN3_30B_A3B, **small, "head_dim": 16, "moe_intermediate_size": 32,
                                                    "num_experts": 8, "num_experts_per_tok": 2},
                      "lora", "sft", 128, 2, 8, ["hf-peft", "trainforge"])],
            "6": [],  # the longest row: run_long
            "first": first_part("llama-1b-shape", llama_1b, "llama-8b-shape-lora", llama_8b, seq=128, micro_batches=(2, 2), steps=(8, 6)),
        }
    return {
        "1": [Row("llama-1b", LLAMA_1B, "full", "sft", 2048, 4, 60, FULL + ["trl-packed", "trainforge-fp8-compiled", DEFAULT_ALLOCATOR])],
        "2": [Row("qwen-0.5b", QWEN_05B, "full", "text", 2048, 8, 60, FULL),
              Row("qwen-0.5b-8k", QWEN_05B, "full", "text", 8192, 2, 30, ["hf", "trainforge"])],
        "3": [Row("llama-8b-lora", LLAMA_8B, "lora", "sft", 2048, 4, 40,
                  ["hf-peft", "hf-peft-liger", "trainforge", "trainforge-fp8-compiled", "trainforge-compiled"])],
                # the 8B row at micro-batch 2: PEFT's LoRA keeps fp32 copies of each adapted layer's input, so
        # plan puts HF + PEFT at micro-batch 4 near an H100's 80 GiB (a lent machine may be an H100 or an H200)
        "4": [grpo_row("qwen-0.5b-grpo-lora", QWEN_05B, prompt=128, completion=256, micro_batch=16, accum=4, steps=16)],
        "5": [Row(f"qwen3-30b-a3b-{MOE_LAYERS}l-lora", {**QWEN3_30B_A3B, "num_hidden_layers": MOE_LAYERS}, "lora", "sft",
                  2048, 2, 30, ["hf-peft", "trainforge", "trainforge-compiled"])],
        "6": [],  # the longest row: run_long
        "first": first_part("llama-1b", LLAMA_1B, "llama-8b-lora", LLAMA_8B, seq=2048, micro_batches=(4, 2), steps=(40, 24)),
    }


def first_part(full_name: str, full_arch: dict, lora_name: str, lora_arch: dict, seq: int,
               micro_batches: tuple[int, int], steps: tuple[int, int]) -> list[Row]:
    """The part one short device call affords, most telling first: each row's baseline and trainforge's
    defaults, then HF + Liger and trainforge compiled on the full fine-tune (a spent budget skips the tail)."""
    full = dict(name=full_name, arch=full_arch, method="full", data="sft", seq=seq, micro_batch=micro_batches[0], steps=steps[0])
    lora = dict(name=lora_name, arch=lora_arch, method="lora", data="sft", seq=seq, micro_batch=micro_batches[1], steps=steps[1])
    return [Row(**full, variants=["hf", "trainforge"]), Row(**lora, variants=["hf-peft", "trainforge"]),
            Row(**full, variants=["hf-liger", "trainforge-compiled"])]


# ---------------------------------------------------------------- shared assets


def vocabulary(size: int) -> list[str]:
    """Word-level vocabulary: the specials, then one word per remaining id (``t4`` ... )."""
    return ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"t{i}" for i in range(4, size)]


def save_tokenizer(model_dir: Path, size: int) -> None:
    """A word-level tokenizer in which every word of the synthetic text is one token, for every trainer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = vocabulary(size)
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>")
    tok.save_pretrained(model_dir)


def documents(n: int, vocab: int, seed: int, lengths: tuple[float, float]) -> list[list[int]]:
    """``n`` learnable documents: ids follow ``x -> (a x + b) mod span`` with per-document a, b; lengths
    drawn log-normal (median ``lengths[0]``, sigma ``lengths[1]``), as real prompt/completion sets spread."""
    rng = random.Random(seed)
    span = vocab - 4
    docs = []
    for _ in range(n):
        size = max(4, int(rng.lognormvariate(math.log(lengths[0]), lengths[1])))
        a, b, x = rng.choice((1, 3, 5, 7)), rng.randrange(1, 64), rng.randrange(span)
        ids = []
        for _ in range(size):
            ids.append(4 + x)
            x = (a * x + b) % span
        docs.append(ids)
    return docs


def text_of(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


REWARD = '''def continues(prompts, completions, answer, **row_fields):
    """The share of the document's next words the completion writes, in order (one float per completion)."""
    return [sum(w == g for w, g in zip(a.split(), c.split())) / len(a.split()) for c, a in zip(completions, answer)]
'''
"""The GRPO rows' reward, one function both trainers call as ``fn(prompts=..., completions=..., answer=..., ...)``."""


def write_prompts(work: Path, row: Row, seed: int = 0) -> dict:
    """A GRPO row's prompts: the start of each document (half to all of ``row.seq`` tokens) with its next words as
    the ``answer`` the reward reads, enough for every step; and the reward's file."""
    rl = row.rl
    prompts = row.steps * row.micro_batch * rl["grad_accum"] // rl["num_generations"]
    docs = documents(max(8, 2 * prompts), row.arch["vocab_size"], seed, (2 * row.seq, 0.1))
    rng = random.Random(seed + 1)
    paths = {"train": work / "prompts.jsonl", "reward": work / "grpo_reward.py"}
    with paths["train"].open("w") as f:
        for d in docs:
            cut = rng.randint(max(1, row.seq // 2), row.seq)
            f.write(json.dumps({"prompt": text_of(d[:cut]), "answer": text_of(d[cut : cut + 8])}) + "\n")
    paths["reward"].write_text(REWARD)
    return {k: str(v) for k, v in paths.items()}


def write_data(work: Path, row: Row, seed: int = 0) -> dict:
    """The row's data in the layouts the trainers read: prompt/completion JSONL (trainforge, TRL), text
    JSONL (trainforge), and rows packed the run_clm way for HF Trainer (ids, labels with prompts masked);
    a GRPO row's prompts (``write_prompts``)."""
    if row.data == "grpo":
        return write_prompts(work, row, seed)
    vocab = row.arch["vocab_size"]
    need = row.seq * row.micro_batch * row.steps * 2  # tokens: twice what the run consumes
    median = max(16, row.seq // 8)
    docs = documents(max(8, need // median), vocab, seed, (median, 0.6))
    docs = [d[: row.seq - 1] for d in docs]  # every document fits a row with its EOS
    paths = {}
    if row.data == "sft":
        rng = random.Random(seed + 1)
        pairs = [(d[: max(1, int(len(d) * rng.uniform(0.2, 0.6)))], d) for d in docs]
        paths["train"] = work / "train.jsonl"
        with paths["train"].open("w") as f:
            for prompt, doc in pairs:
                # the completion starts with a space: prompt + completion is the document's text, word for word
                f.write(json.dumps({"prompt": text_of(prompt), "completion": " " + text_of(doc[len(prompt):])}) + "\n")
        masked = [(doc + [1], len(prompt)) for prompt, doc in pairs]
    else:
        paths["train"] = work / "train.jsonl"
        with paths["train"].open("w") as f:
            for d in docs:
                f.write(json.dumps({"text": text_of(d)}) + "\n")
        masked = [(d + [1], 0) for d in docs]
    ids, labels, blocks = [], [], []
    for doc, prompt in masked:  # concatenated and cut into rows of seq tokens, as run_clm.py's group_texts
        ids += doc
        labels += [-100] * prompt + doc[prompt:]
    for s in range(0, len(ids) - row.seq + 1, row.seq):
        blocks.append({"input_ids": ids[s : s + row.seq], "labels": labels[s : s + row.seq]})
    paths["blocks"] = work / "blocks.json"
    paths["blocks"].write_text(json.dumps(blocks))
    return {k: str(v) for k, v in paths.items()}


OPTIM = dict(lr=2e-4, weight_decay=0.0, betas=[0.9, 0.95], eps=1e-8, warmup_steps=0, min_lr_ratio=0.1, max_grad_norm=1.0)


def trainforge_config(spec: dict, variant: str = "trainforge") -> dict:
    """trainforge's config for a variant: its defaults; ``-compiled``: ``train.compile: true``; ``-fp8``:
    ``train.fp8: true`` (torchao's FP8 linear layers; compiled on a GPU, as torchao's casts need)."""
    compiled, fp8 = variant.endswith("compiled"), "-fp8" in variant
    row = spec["row"]
    model = {"path": spec["model_dir"], "method": row["method"]}
    if row["method"] == "lora":
        targets = MOE_LORA_MODULES + [e.split(".")[-1] for e in MOE_LORA_EXPERTS] if is_moe(row["arch"]) else "all-linear"
        model["lora"] = {"r": 16, "alpha": 32, "target_modules": targets}
    data = {"train": spec["data"]["train"], "max_length": row["seq"], "eval": None, "cache_dir": str(Path(spec["work"]) / "tf-cache")}
    if row["data"] == "text":
        data |= {"packing": "concat", "too_long": "split"}
    config = {
        "model": model,
        "data": data,
        "train": {"max_steps": row["steps"], "micro_batch_size": row["micro_batch"], "seed": 0,
                  **({"compile": True} if compiled else {}),
                  # FP8 layers need bf16 for the rest of the step: what auto picks on a GPU, not on every CPU (--tiny)
                  **({"fp8": True, "precision": "bf16"} if fp8 else {})},
        "optim": {**OPTIM, "schedule": "cosine"},
        "checkpoint": {"every_minutes": None},
        # the last warm-up step is profiled (left out of the steady figures): where the step's time goes
        "log": {"every_steps": 1, "tensorboard": False, "profile_steps": [spec.get("profile_step", 1)]},
    }
    if row["data"] == "grpo":  # as trl-grpo-peft: sampled at temperature 1, TRL's grpo loss, no KL term
        rl = row["rl"]
        config["train"] |= {"objective": "grpo", "grad_accum": rl["grad_accum"]}
        config["rl"] = {"num_generations": rl["num_generations"], "max_completion_length": rl["max_completion_length"],
                        "temperature": 1.0, "loss": "grpo", "beta": 0.0,
                        "rewards": [{"function": f"{spec['data']['reward']}:continues"}]}
        config["log"]["sample_prompt"] = None
    return config


# ---------------------------------------------------------------- children: one variant each


def needs(variant: str) -> str | None:
    """Why ``variant`` cannot run here, or None."""
    import importlib.util

    import torch

    if "liger" in variant and not torch.cuda.is_available():
        return "needs CUDA (Liger's Triton kernels)"
    if "liger" in variant and importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel not installed (pip install 'trainforge[gpu]')"
    if "fp8" in variant and importlib.util.find_spec("torchao") is None:
        return "torchao not installed (pip install 'trainforge[gpu]')"
    if "fp8" in variant and torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        return "this GPU has no FP8 tensor cores (compute capability 8.9+)"
    if variant.startswith("trl") and importlib.util.find_spec("trl") is None:
        return "trl not installed (pip install 'trainforge[bench]')"
    if variant.startswith(("hf", "trl")) and importlib.util.find_spec("datasets") is None:
        return "datasets not installed (pip install 'trainforge[bench]')"
    return None


def prepare_model(spec: dict) -> None:
    """Random-init weights saved once (every variant starts from them): fp32 for a full fine-tune (loaded
    as users load a checkpoint, trained under autocast), bf16 built on the device for a LoRA base."""
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    row, out = spec["row"], Path(spec["model_dir"])
    arch = dict(row["arch"])
    config = CONFIG_MAPPING[arch.pop("architecture")](**arch, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if row["method"] == "lora" and device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out)
    save_tokenizer(out, arch["vocab_size"])


class StepClock:
    """Per optimizer step: wall time, real tokens and loss, for an HF/TRL trainer (a forward pre-hook
    counts non-padding input tokens, a callback stamps each step's end)."""

    def __init__(self, pad_id: int):
        self.pad_id, self.tokens, self.rows = pad_id, 0, []
        self.t_begin = None

    def hook(self, module, args, kwargs):
        import torch

        if module.training and torch.is_grad_enabled():
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.tokens += int((ids != self.pad_id).sum()) if "position_ids" not in kwargs else int(ids.numel())

    def callback(self):
        from transformers import TrainerCallback

        clock = self

        class Stamp(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                clock.t_begin = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                import torch

                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                clock.rows.append({"step": state.global_step, "elapsed_s": time.perf_counter() - clock.t_begin, "tokens": clock.tokens})

            def on_log(self, args, state, control, logs=None, **kw):
                for key in ("loss", "reward"):  # reward: GRPOTrainer's mean over the step's completions
                    if logs and key in logs and clock.rows:
                        clock.rows[-1][key] = logs[key]

        return Stamp()


def hf_arguments(spec: dict, name: str) -> dict:
    """TrainingArguments shared by the HF and TRL variants: the suite's batch, steps and optimizer;
    bf16 autocast on CUDA (as a user sets it), fp32 on a CPU; a loss logged every step, nothing saved."""
    import torch

    row, cuda = spec["row"], torch.cuda.is_available()
    return dict(
        output_dir=str(Path(spec["out"]) / name), per_device_train_batch_size=row["micro_batch"], max_steps=row["steps"],
        learning_rate=OPTIM["lr"], weight_decay=OPTIM["weight_decay"], adam_beta1=OPTIM["betas"][0], adam_beta2=OPTIM["betas"][1],
        adam_epsilon=OPTIM["eps"], max_grad_norm=OPTIM["max_grad_norm"], lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": OPTIM["min_lr_ratio"]}, seed=0, report_to="none", logging_steps=1,
        save_strategy="no", disable_tqdm=True, bf16=cuda, use_cpu=not cuda,
    )


def hf_lora_config(arch: dict):
    """PEFT's LoRA of the baseline: all linear layers; an MoE's attention and experts (what trainforge_config adapts)."""
    from peft import LoraConfig

    targets = dict(target_modules=MOE_LORA_MODULES, target_parameters=MOE_LORA_EXPERTS) if is_moe(arch) else dict(target_modules="all-linear")
    return LoraConfig(r=16, lora_alpha=32, task_type="CAUSAL_LM", **targets)


def run_hf(spec: dict, variant: str) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Trainer, TrainingArguments, default_data_collator

    row, cuda = spec["row"], torch.cuda.is_available()
    tok = PreTrainedTokenizerFast.from_pretrained(spec["model_dir"])  # the suite's word-level tokenizer.json, as saved
    clock = StepClock(tok.pad_token_id)
    moe = is_moe(row["arch"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], attn_implementation="sdpa",
                                                 **({"experts_implementation": MOE_HF_EXPERTS} if moe else {}))
    if moe:  # the load-balancing loss in the training loss, as trainforge adds it (model.router_aux_loss: true)
        model.config.output_router_logits = True
    if variant.startswith("hf-peft"):
        from peft import get_peft_model

        model = get_peft_model(model, hf_lora_config(row["arch"]))
    model.register_forward_pre_hook(clock.hook, with_kwargs=True)
    args = TrainingArguments(
        **hf_arguments(spec, "hf"), use_liger_kernel=variant.endswith("liger"),
        dataloader_pin_memory=cuda,
    )
    ds = datasets.Dataset.from_list(json.loads(Path(spec["data"]["blocks"]).read_text()))
    trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=default_data_collator, callbacks=[clock.callback()])
    trainer.train()
    return {"steps": clock.rows, "attention": model.config._attn_implementation, "flops_model": model}


def run_trl(spec: dict, variant: str) -> dict:
    import datasets
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    row = spec["row"]
    # as saved: AutoTokenizer would rebuild it as the architecture's own class (qwen2: Qwen2Tokenizer)
    tok = PreTrainedTokenizerFast.from_pretrained(spec["model_dir"])
    clock = StepClock(tok.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], attn_implementation="sdpa")
    model.register_forward_pre_hook(clock.hook, with_kwargs=True)
    args = SFTConfig(
        **hf_arguments(spec, "trl"), max_length=row["seq"], packing=True,
        padding_free=True, gradient_checkpointing=False,
    )
    ds = datasets.load_dataset("json", data_files=spec["data"]["train"], split="train")
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, callbacks=[clock.callback()])
    trainer.train()
    return {"steps": clock.rows, "attention": model.config._attn_implementation, "flops_model": model}


def run_trl_grpo(spec: dict, variant: str) -> dict:
    """TRL's GRPOTrainer with PEFT LoRA on the row's prompts and reward, the suite's optimizer, steps and batch."""
    import datasets
    import importlib.util
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    row, rl = spec["row"], spec["row"]["rl"]
    tok = PreTrainedTokenizerFast.from_pretrained(spec["model_dir"])
    clock = StepClock(tok.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], attn_implementation="sdpa")
    # on the input embeddings: PEFT's wrapper calls the base model's forward directly, past its hooks; the learning
    # passes only (sampling runs without gradients)
    model.get_input_embeddings().register_forward_pre_hook(clock.hook, with_kwargs=True)
    loaded = importlib.util.spec_from_file_location("grpo_reward", spec["data"]["reward"])
    reward = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(reward)
    # one generation per optimizer step (steps_per_generation defaults to the accumulation); gradient checkpointing
    # off (GRPOConfig turns it on by default), as trainforge has it where the step fits
    args = GRPOConfig(**hf_arguments(spec, "trl-grpo"), gradient_accumulation_steps=rl["grad_accum"],
                      num_generations=rl["num_generations"], max_completion_length=rl["max_completion_length"],
                      temperature=1.0, loss_type="grpo", beta=0.0, gradient_checkpointing=False)
    ds = datasets.load_dataset("json", data_files=spec["data"]["train"], split="train")
    trainer = GRPOTrainer(model=model, reward_funcs=[reward.continues], args=args, train_dataset=ds, processing_class=tok,
                          peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"),
                          callbacks=[clock.callback()])
    trainer.train()
    return {"steps": clock.rows, "attention": model.config._attn_implementation, "flops_model": model}


def run_trainforge(spec: dict, variant: str) -> dict:
    import yaml
    from rich.console import Console

    from trainforge.config.run import load_config
    from trainforge.engine.trainer import train
    from trainforge.metrics.console import ConsoleReporter

    out = Path(spec["out"])
    config = trainforge_config(spec, variant)
    (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    # a part run again into the same --out (after a timeout, a fix): a fresh run, not "this directory holds a run"
    shutil.rmtree(out / "run", ignore_errors=True)
    result = train(load_config(out / "config.yaml"), out / "run", ConsoleReporter(Console(quiet=True)))
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    profile = next(({"phases": r["profile"], **r.get("profile_ops", {})} for r in rows if "profile" in r), None)
    # a step record's "tokens" is the run's running total (tokens seen so far), as the StepClock's is
    steps = [{"step": r["step"], "elapsed_s": r["elapsed_s"], "tokens": r["tokens"], "loss": r["loss"],
              **({"reward": r["reward"]} if "reward" in r else {})} for r in rows if "loss" in r]
    sm = result.summary
    return {"steps": steps, "attention": sm.get("attention"), "kernels": sm.get("kernels"), "loss_head": sm.get("loss_head"),
            "precision": sm.get("precision"), "compile": sm.get("compile"), "compiled": sm.get("compiled"), "fp8": sm.get("fp8"), "flops_per_token": sm.get("flops_per_token"),
            "profile": profile, "cuda_allocator": sm.get("cuda_allocator")}


def child(variant: str, spec_path: Path, result_path: Path) -> None:
    """Run one variant and write its measurements (a separate process: a clean device and peak)."""
    import resource

    import torch

    spec = json.loads(spec_path.read_text())
    Path(spec["out"]).mkdir(parents=True, exist_ok=True)
    if variant == "prepare":
        prepare_model(spec)
        result_path.write_text("{}")
        return
    run = (run_trainforge if variant.startswith("trainforge") else run_trl_grpo if variant.startswith("trl-grpo")
           else run_trl if variant.startswith("trl") else run_hf)
    r = run(spec, variant)
    model = r.pop("flops_model", None)
    if model is not None:  # trainforge's FLOP count for every variant: MFU is then comparable
        from trainforge.metrics.flops import flops_per_token

        r["flops_per_token"] = flops_per_token(model, spec["row"]["seq"])
    r["peak_memory_bytes"] = torch.cuda.max_memory_reserved() if torch.cuda.is_available() else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if torch.cuda.is_available():  # what tensors held at most: reserved minus this is the allocator's fragmentation
        r["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    result_path.write_text(json.dumps(r))


# ---------------------------------------------------------------- the parent: rows, variants, report


def summarize(r: dict, warmup: int, peak_flops: float | None) -> dict:
    """Steady and whole-loop tokens/s, first-step overhead, MFU and late loss from a variant's step rows."""
    steps = r["steps"]
    if not steps:
        return {"status": "failed", "reason": "no steps recorded"}
    whole = steps[-1]["tokens"] / steps[-1]["elapsed_s"]
    w = min(warmup, len(steps) - 2)
    base = steps[w - 1] if w >= 1 else {"tokens": 0, "elapsed_s": 0.0}
    steady = (steps[-1]["tokens"] - base["tokens"]) / max(steps[-1]["elapsed_s"] - base["elapsed_s"], 1e-9)
    per_step = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(steps, steps[1:])]
    typical = sorted(per_step)[len(per_step) // 2] if per_step else 0.0
    losses = [s["loss"] for s in steps if s.get("loss") is not None]
    late = losses[-max(1, len(losses) // 4) :]
    rewards = [s["reward"] for s in steps if s.get("reward") is not None]
    if rewards:  # a GRPO row: its policy-gradient loss has no scale to compare, its reward has
        late, rewards = [], rewards[-max(1, len(rewards) // 4) :]
    fpt = r.get("flops_per_token")
    return {
        "status": "ok",
        "tokens_per_s": steady,
        "tokens_per_s_whole": whole,
        "first_step_extra_s": max(steps[0]["elapsed_s"] - typical, 0.0),
        "mfu": steady * fpt / peak_flops if fpt and peak_flops else None,
        "late_loss": sum(late) / len(late) if late else None,
        **({"late_reward": sum(rewards) / len(rewards)} if rewards else {}),
        "peak_memory_bytes": r.get("peak_memory_bytes"),
        "peak_allocated_bytes": r.get("peak_allocated_bytes"),
        "tokens": steps[-1]["tokens"],
        **{k: r[k] for k in ("attention", "kernels", "loss_head", "precision", "compile", "compiled", "fp8", "profile", "cuda_allocator") if r.get(k) is not None},
    }


# 2: trainforge's step rows read the running token total of metrics.jsonl as it is. Reports without this key
# (the suite before 2026-11-27) summed those totals, so trainforge's tokens grew as the square of the steps
TOKEN_ACCOUNTING = 2


def recount_summed_totals(report: dict, warmup: int = 10) -> dict:
    """A report written before TOKEN_ACCOUNTING 2, with its trainforge figures recounted: there step k counted
    k steps' tokens, so with (near) equal tokens per step, as packed rows have, the steady figure (steps
    w+1..n) was (n(n+1) - w(w+1)) / 2 steps' tokens where n - w were seen, and the whole-loop figure and the
    total n(n+1)/2 for n. Each recounted variant says so; the ratios and plan's errors are computed again."""
    if report.get("token_accounting", 1) >= TOKEN_ACCOUNTING:
        return report
    if report.get("tiny"):
        warmup = min(warmup, 2)  # as main() sets it for --tiny
    for row in report["rows"]:
        n = row["row"]["steps"]
        w = min(warmup, n - 2)
        steady, whole = 2 * (n - w) / (n * (n + 1) - w * (w + 1)), 2 / (n + 1)
        for name, r in row["results"].items():
            if not name.startswith("trainforge") or r.get("status") != "ok" or r.get("recounted"):
                continue
            r["tokens_per_s"] *= steady
            r["tokens_per_s_whole"] *= whole
            r["tokens"] = round(r["tokens"] * whole)
            if r.get("mfu") is not None:
                r["mfu"] *= steady
            r["recounted"] = f"from summed running totals ({n} steps, {w} warm-up)"
        add_ratios(row["results"], baseline_of(row["row"]))
    report["token_accounting"] = TOKEN_ACCOUNTING
    return report


def plan_prediction(spec: dict, hardware: str) -> dict:
    """What ``trainforge plan --hardware`` predicts for the trainforge variant's config."""
    import yaml

    from trainforge.config.run import load_config
    from trainforge.tools.plan import make_plan

    path = Path(spec["work"]) / "plan-config.yaml"
    path.write_text(yaml.safe_dump(trainforge_config(spec), sort_keys=False))
    plan = make_plan(load_config(path), hardware=hardware)
    memory = plan["memory"]
    # on a GPU the run's figure is torch's peak reserved, which holds no CUDA context: plan's tensors with its
    # allocator overhead are what compares with it; on a CPU (--tiny) the process's peak RSS, plan's process
    reserved = int(memory["peak_tensor_bytes"] * (1 + plan["hardware"]["allocator_overhead"]))
    out = {"hardware": hardware, "peak_memory_bytes": reserved if hardware != "this" else memory["peak_process_bytes"],
           "peak_process_bytes": memory["peak_process_bytes"], "peak_tensor_bytes": memory["peak_tensor_bytes"],
           "tokens_per_s": plan["time"]["tokens_per_s"]}
    if memory.get("rollout"):  # grpo: the phase that sets the peak, and no speed (the learning step's only)
        out |= {"peak_phase": memory["rollout"]["peak_phase"], "kv_cache_bytes": memory["rollout"]["parts"]["kv_cache"]}
        del out["tokens_per_s"]
    return out


def run_row(row: Row, work: Path, args: argparse.Namespace, peak_flops: float | None, deadline: float,
            save: Callable[[dict], None], report: dict | None = None) -> dict:
    """Every variant of ``row``, one process each; ``save`` gets the row's report after each variant, so
    a call stopped at the device's limit still returns what finished. A variant that would start after
    ``deadline`` (perf_counter seconds) is skipped, and the timeout of one that starts is cut to it.
    ``report``: the report of an earlier piece of the same row, which this piece extends."""
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    spec = {"row": asdict(row), "work": str(work), "model_dir": str(model_dir), "profile_step": max(1, min(args.warmup, row.steps - 2))}
    spec["data"] = write_data(work, row)
    if report is None:
        report = {"row": asdict(row), "results": {}}
    else:
        report["row"]["variants"] += row.variants
    results: dict[str, dict] = report["results"]
    if not (model_dir / "config.json").is_file():
        launch("prepare", spec, work / "prepare", max(deadline - time.perf_counter(), 1.0))
    for variant in row.variants:
        left = min(args.timeout, deadline - time.perf_counter())
        why = needs(variant) or (f"the part's budget (--budget {args.budget:.0f}s) was spent before it started" if left < MIN_VARIANT_S else None)
        if why:
            results[variant] = {"status": "skipped", "reason": why}
            save(report)
            continue
        t = time.perf_counter()
        raw = launch(variant, spec, work / variant, left, args.reuse)
        results[variant] = raw if raw.get("status") == "failed" else summarize(raw, args.warmup, peak_flops)
        if raw.get("reused"):
            results[variant]["reused"] = True  # measured by an earlier call (--reuse)
        results[variant]["job_s"] = time.perf_counter() - t
        if variant == "trainforge" and results[variant]["status"] == "ok":
            try:
                results[variant]["plan"] = plan_prediction(spec, "this" if args.tiny else args.hardware)
            except Exception as e:  # noqa: BLE001 - a failed prediction is reported, not fatal
                results[variant]["plan"] = {"error": f"{type(e).__name__}: {e}"}
        add_ratios(results, baseline_of(asdict(row)))
        save(report)
    return report


def variant_env(variant: str, base: dict[str, str] | os._Environ) -> dict[str, str]:
    """The environment a variant's process starts with: offline, and for ``DEFAULT_ALLOCATOR`` an allocator
    setting of the user's own (torch's default allocator), which trainforge leaves as it is."""
    env = {**base, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if variant == DEFAULT_ALLOCATOR:
        env |= {"PYTORCH_ALLOC_CONF": "expandable_segments:False", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    return env


def launch(variant: str, spec: dict, out: Path, timeout: float, reuse: bool = False) -> dict:
    """Run ``variant`` in its own process and return its raw result. ``reuse``: a result this folder holds from
    the same spec (an earlier call on the same warm device) is returned without running again."""
    out.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "out": str(out)}
    spec_path, result_path = out / "spec.json", out / "result.json"
    if reuse and result_path.is_file() and spec_path.is_file() and json.loads(spec_path.read_text()) == spec:
        return {**json.loads(result_path.read_text()), "reused": True}
    result_path.unlink(missing_ok=True)  # a run that fails must not return the result of an earlier one
    spec_path.write_text(json.dumps(spec))
    env = variant_env(variant, os.environ)
    try:
        done = subprocess.run([sys.executable, __file__, "--child", variant, str(spec_path), str(result_path)],
                              env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "reason": f"timed out after {timeout:.0f}s"}
    (out / "log.txt").write_text(done.stdout + done.stderr)
    if done.returncode != 0:  # a result written before a failure at the end (a CUDA error in teardown) is no result
        result_path.unlink(missing_ok=True)
    if done.returncode != 0 or not result_path.is_file():
        return {"status": "failed", "reason": (done.stderr.strip().splitlines() or ["exit %d" % done.returncode])[-1][:300]}
    return json.loads(result_path.read_text())


def baseline_of(row: dict) -> str:
    """The variant a row's others are compared with: TRL's GRPOTrainer + PEFT, HF + PEFT, or HF."""
    return "trl-grpo-peft" if row.get("data") == "grpo" else "hf-peft" if row["method"] == "lora" else "hf"


def add_ratios(results: dict, baseline: str) -> None:
    """Speed, memory and late loss of every variant relative to the baseline; plan's error on trainforge."""
    base = results.get(baseline, {})
    for r in results.values():
        if r.get("status") != "ok":
            continue
        if base.get("status") == "ok":
            r["speed_vs_baseline"] = r["tokens_per_s"] / base["tokens_per_s"]
            if r.get("peak_memory_bytes") and base.get("peak_memory_bytes"):
                r["memory_vs_baseline"] = r["peak_memory_bytes"] / base["peak_memory_bytes"]
            if r.get("late_loss") and base.get("late_loss"):
                r["loss_vs_baseline"] = r["late_loss"] / base["late_loss"]
        plan = r.get("plan", {})
        if "peak_memory_bytes" in plan:  # a GRPO row's plan has no speed: it predicts the learning step's only
            plan["memory_error"] = plan["peak_memory_bytes"] / r["peak_memory_bytes"] - 1 if r.get("peak_memory_bytes") else None
            plan["speed_error"] = plan["tokens_per_s"] / r["tokens_per_s"] - 1 if plan.get("tokens_per_s") else None
            plan["flag"] = bool((plan["memory_error"] is not None and abs(plan["memory_error"]) > MEMORY_TOL)
                                or (plan["speed_error"] is not None and abs(plan["speed_error"]) > SPEED_TOL))


def run_long(args: argparse.Namespace, work: Path, deadline: float) -> dict:
    """Part 6: trainforge's and HF + PEFT's longest QLoRA row under ``--long-cap-gib`` on this device, by
    ``bench_long_context.py --longest`` in its own process, cut at ``deadline``; its JSON (every probe, the
    predictions, the summary lines) or why there is none. ``--tiny``: the tiny shape on the CPU, lengths up to 1,024."""
    work.mkdir(parents=True, exist_ok=True)
    out = work / "long.json"
    out.unlink(missing_ok=True)
    left = deadline - time.perf_counter()
    if left < 2 * MIN_VARIANT_S:
        return {"status": "skipped", "reason": f"the part's budget (--budget {args.budget:.0f}s) was spent before it started"}
    shape = (["--shape", "tiny", "--device", "cpu", "--precision", "fp32", "--cap-gib", "1.0", "--max-length", "1024",
              "--start", "512", "--threads", "2", "--corpus-files", "300", "--steps", "1"] if args.tiny else
             ["--shape", "llama-8b", "--device", "cuda", "--precision", "bf16", "--cap-gib", str(args.long_cap_gib),
              "--max-length", "262144", "--start", "4096", "--granule", "512"])
    # HF's probes in one process on the CPU too (``--tiny`` rehearses the GPU's path; there a probe's peak is the
    # process's running maximum, an upper bound)
    steps = [] if args.tiny else ["--steps", "2"]  # the table's: the last step timed (--tiny: one, its peak)
    cmd = [sys.executable, str(LONG_BENCH), *shape, "--method", "qlora", "--longest", "--hf-search", "in-process",
           "--lengths", *steps,
           "--runs", "trainforge,hf-peft", "--budget-s", f"{left - 15:.0f}", "--workdir", str(work), "--out", str(out)]
    command = " ".join(["python", f"benchmarks/{LONG_BENCH.name}", *cmd[2:cmd.index("--budget-s")]])
    # its own process group: on a timeout the bench's children (a probe on the GPU, the plan's trace) end with it
    proc = subprocess.Popen(cmd, env=variant_env("long", os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=left)
        (work / "log.txt").write_text(stdout + stderr)
        why = None if proc.returncode == 0 else (stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        why = f"timed out after {left:.0f}s"
    if not out.is_file():  # the bench rewrites it after each search and measurement: a cut run keeps what ended
        return {"status": "failed", "reason": why or "no results written", "command": command}
    return {"status": "ok" if why is None else "partial", **({"reason": why} if why else {}), "command": command,
            **json.loads(out.read_text())}


def long_table(reports: list[dict]) -> str:
    """Part 6's figures under the table: the longest rows, the peaks at HF's longest, plan's prediction."""
    lines = []
    for report in reports:
        long = report.get("long")
        if not long:
            continue
        if long.get("status") not in ("ok", "partial"):
            lines.append(f"- {long.get('status')}: {long.get('reason', '')}")
            continue
        if long["status"] == "partial":
            lines.append(f"- cut short ({long.get('reason')}): what ended before")
        cap = long["settings"]["cap_gib"]
        summary = long.get("summary", [])
        lines += [f"- {line.strip()}" for line in summary if not line.strip()[:1].isdigit()]
        lines += [f"- at {line.strip()}" for line in summary if line.strip()[:1].isdigit()]
        lines.insert(0, f"Longest row under a {cap:g} GiB cap ({long['settings']['shape']} shape, "
                        f"{long['settings']['method']} r{long['lora']['r']}, `{long['command']}`):")
    return "\n\n" + "\n".join(lines) if lines else ""


def gpu_profile_name() -> str:
    """The plan profile of this machine's GPU (an H200 is lent as often as an H100), h100 without one."""
    import torch

    from trainforge.hardware.profiles import profile_for_gpu_name

    found = profile_for_gpu_name(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
    return found.name if found else "h100"


def environment(args: argparse.Namespace) -> dict:
    import importlib.metadata as md

    import torch

    def version(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    return {
        "device": device, "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "versions": {n: version(n) for n in ("torch", "transformers", "peft", "trl", "liger-kernel", "trainforge", "triton")},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "plan_hardware": args.hardware,
    }


def table(reports: list[dict]) -> str:
    """One markdown table over the parts' reports."""
    lines = [
        "| row | variant | tokens/s (steady) | vs baseline | MFU | peak memory reserved (allocated) | vs baseline | first-step extra | late loss vs baseline | plan: memory / tokens/s error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for report in reports:
        for row in report["rows"]:
            for name, r in row["results"].items():
                if r.get("status") != "ok":
                    lines.append(f"| {row['row']['name']} | {name} | {r.get('status')}: {r.get('reason', '')} | | | | | | | |")
                    continue
                plan = r.get("plan", {})
                speed = f"{plan['speed_error']:+.0%}" if plan.get("speed_error") is not None else "n/a"
                plan_cell = (f"{plan['memory_error']:+.0%} / {speed}" + (" (!)" if plan.get("flag") else "")
                             if "speed_error" in plan and plan.get("memory_error") is not None else plan.get("error", ""))
                lines.append(
                    f"| {row['row']['name']} | {name} | {r['tokens_per_s']:,.0f}{' (r)' if r.get('recounted') else ''} | {fmt(r.get('speed_vs_baseline'), 'x')} | "
                    f"{fmt(r.get('mfu'), '%')} | {memory_cell(r)} | {fmt(r.get('memory_vs_baseline'), 'x')} | "
                    f"{r['first_step_extra_s']:.1f} s | {late_cell(r)} | {plan_cell} |"
                )
    devices = sorted({r["environment"]["device"] for r in reports})
    stopped = [str(r["part"]) for r in reports if not r.get("complete", True)]
    note = f" Part {', '.join(stopped)} stopped before its last variant (the call's limit)." if stopped else ""
    if any(r.get("recounted") for report in reports for row in report["rows"] for r in row["results"].values()):
        note += (" (r): recounted from a report whose trainforge token counts summed running totals (the suite before"
                 " 2026-11-27), assuming equal tokens per step; measure again to confirm.")
    return ("\n".join(lines) + f"\n\nDevice: {', '.join(devices)}; torch {reports[0]['environment']['versions']['torch']}.{note}"
            + long_table(reports) + profile_table(reports))


def late_cell(r: dict) -> str:
    """The late loss against the baseline's; a GRPO row's late mean reward."""
    return f"reward {r['late_reward']:.3f}" if r.get("late_reward") is not None else fmt(r.get("loss_vs_baseline"), "x", 3)


def memory_cell(r: dict) -> str:
    """Peak reserved memory, and on a GPU the peak that tensors held beside it: ``20.1 GiB (18.3)``."""
    allocated = r.get("peak_allocated_bytes")
    return f"{r['peak_memory_bytes'] / 2**30:.1f} GiB" + (f" ({allocated / 2**30:.1f})" if allocated else "")


KINDS = ("matmul", "attention", "optimizer", "copy", "communication", "other")


def profile_table(reports: list[dict]) -> str:
    """Where each trainforge variant's profiled step went: the device's busy share of the step (the rest:
    host overhead and syncs), kernel time by kind, and the costliest kernel."""
    lines = []
    for report in reports:
        for row in report["rows"]:
            for name, r in row["results"].items():
                p = r.get("profile") if r.get("status") == "ok" else None
                if not p or not p.get("op_seconds"):
                    continue
                shares = " | ".join(f"{p['by_kind_s'].get(k, 0.0) / p['op_seconds']:.0%}" for k in KINDS)
                busy = f"{p['device_busy']:.0%}" if p.get("device_busy") is not None else "(host ops)"
                top = p["top"][0] if p.get("top") else {"name": "", "share": 0.0}
                lines.append(f"| {row['row']['name']} | {name} | {busy} | {shares} | `{top['name'][:48]}` {top['share']:.0%} |")
    if not lines:
        return ""
    head = ["", "", "Where trainforge's profiled step went (`log.profile_steps`, the last warm-up step):", "",
            "| row | variant | device busy | " + " | ".join(KINDS) + " | top kernel |", "|---" * (4 + len(KINDS)) + "|"]
    return "\n".join(head + lines)


def fmt(value: float | None, unit: str, digits: int = 2) -> str:
    if value is None:
        return ""
    return f"{value:.1%}" if unit == "%" else f"{value:.{digits}f}{unit}"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="all", choices=[*PARTS, "all"],
                    help="1, 2, 3, 4 (GRPO), 5 (MoE LoRA), 6 (the longest 8B QLoRA row), all (1 to 6; each part stays "
                    "under 9 minutes on one H100) or first (one short call)")
    ap.add_argument("--out", type=Path, default=Path("gpu-results"), help="folder for part-N.json")
    ap.add_argument("--work", type=Path, help="folder for the models, data and runs (default: OUT/work); keep it out "
                    "of the device's $OUT, whose files travel back")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: checks the harness in seconds")
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the steady-state figures")
    ap.add_argument("--hardware", default="auto",
                    help="the plan profile trainforge rows are compared with (auto: this GPU's, by its name; else h100)")
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds per variant before it is reported as failed")
    ap.add_argument("--budget", type=float, default=530.0,
                    help="seconds per part: variants that would start later are skipped (the device's calls stop at 600 s)")
    ap.add_argument("--reuse", action="store_true",
                    help="take a variant's result from --work when an earlier call ran it with the same spec (a second "
                    "call on the same warm device goes on where the first stopped)")
    ap.add_argument("--long-cap-gib", type=float, default=16.0, help="part 6: the memory cap of the longest row's search")
    ap.add_argument("--table", type=Path, help="print the markdown table of the part-*.json files in this folder and exit")
    args = ap.parse_args()
    if args.table:
        reports = [recount_summed_totals(json.loads(p.read_text()), args.warmup) for p in sorted(args.table.glob("part-*.json"))]
        print(table(reports))
        return 0
    if args.tiny:
        args.warmup = min(args.warmup, 2)
    from trainforge.hardware.profiles import find_profile

    if args.hardware == "auto":
        args.hardware = gpu_profile_name()
    peak = None if args.tiny else find_profile(args.hardware).peak_flops("bf16")
    chosen = parts(args.tiny)
    numbers = [p for p in PARTS if p != "first"] if args.part == "all" else [args.part]
    work = args.work or args.out / "work"
    reports = []
    args.out.mkdir(parents=True, exist_ok=True)
    for n in numbers:
        report = {"part": n, "tiny": args.tiny, "environment": environment(args), "rows": [], "complete": False,
                  "token_accounting": TOKEN_ACCOUNTING}
        # the first part's budget counts from this process's start, as a caller's time limit does (importing torch
        # and starting CUDA take seconds before this line)
        deadline = (T0 if not reports else time.perf_counter()) + args.budget

        def save(row_report: dict | None, report: dict = report, n: int = n) -> None:
            # rewritten after every variant (atomically): what finished survives a call killed at its limit
            if row_report is not None and row_report not in report["rows"]:
                report["rows"].append(row_report)
            report["elapsed_s"] = time.perf_counter() - T0
            tmp = args.out / f".part-{n}.json.tmp"
            tmp.write_text(json.dumps(report, indent=1))
            tmp.replace(args.out / f"part-{n}.json")

        pieces: dict[str, dict] = {}  # row name -> its report, extended by later pieces of the row
        if n == LONG_PART:
            print(f"part {n}: the longest QLoRA row (trainforge, hf-peft)", flush=True)
            report["long"] = run_long(args, work / "long", deadline)
        for row in chosen[n]:
            print(f"part {n}: {row.name} ({', '.join(row.variants)})", flush=True)
            pieces[row.name] = run_row(row, work / row.name, args, peak, deadline, save, pieces.get(row.name))
        report["complete"] = True
        save(report["rows"][-1] if report["rows"] else None)
        reports.append(report)
    print(table(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
