"""`trainforge plan` beside published GPU memory measurements of the same model, method, batch and
sequence length. No GPU and no weights are needed: each model is a directory holding only the
architecture's config.json (public values), and plan traces the step on fake tensors.

    python benchmarks/plan_vs_published.py [--out results.json]

The published figures and their settings are listed in PUBLISHED with their sources; docs/plan.md
("Against published GPU measurements") discusses every gap over 15%.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

GIB = 2**30

ARCHITECTURES = {
    "llama-2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, tie_word_embeddings=True,
                         rope_theta=500000.0),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, tie_word_embeddings=False,
                         rope_theta=500000.0),
}

# (label, architecture, hardware, method, lora, micro-batch, sequence length, checkpointing, published GiB, what and where)
PUBLISHED = [
    ("LitGPT: Llama 2 7B LoRA r8 q,v, A100 40GB, 1 x 1304", "llama-2-7b", "a100-40gb", "lora", {"r": 8, "target_modules": ["q_proj", "v_proj"]},
     1, 1304, False, 21.30e9 / GIB, "max_memory_allocated, bf16-true; Lightning-AI/litgpt tutorials/resource-tables.md (2023-10)"),
    ("LitGPT: Llama 2 7B LoRA r8 q,v, A100 40GB, 2 x 1304", "llama-2-7b", "a100-40gb", "lora", {"r": 8, "target_modules": ["q_proj", "v_proj"]},
     2, 1304, False, 29.07e9 / GIB, "same table, micro-batch 2"),
    ("LitGPT: Llama 2 7B QLoRA (NF4, double quant) r8 q,v, 1 x 1304", "llama-2-7b", "a100-40gb", "qlora", {"r": 8, "target_modules": ["q_proj", "v_proj"]},
     1, 1304, False, 13.84e9 / GIB, "same table, nf4-dq"),
    ("torchtune: Llama 3.1 8B QLoRA r8 all linear, RTX 4090, 2 x 2048 packed, checkpointing", "llama-3.1-8b", "rtx4090", "qlora",
     {"r": 8, "target_modules": "all-linear"}, 2, 2048, True, 7.4, "pytorch/torchtune README 'Memory and training speed' (2024-09)"),
    ("PEFT MetaMathQA: Llama 3.2 3B LoRA r32 q,v, L40S, 4 x 768", "llama-3.2-3b", "l40s", "lora", {"r": 32, "alpha": 64, "target_modules": ["q_proj", "v_proj"],
                                                                                      "fused": False},  # PEFT's own forward, as measured
     4, 768, False, 20.1e9 / GIB, "99th percentile of reserved per step; huggingface/peft method_comparison/MetaMathQA"),
    ("torchtune: Llama 3.2 3B full, A100 80GB, 2 x 4096 packed, no checkpointing", "llama-3.2-3b", "a100-80gb", "full", None,
     2, 4096, False, 60.0, "peak active; pytorch/torchtune README 'Optimization flags' (2024-11), '+ packed' row"),
]


def write_model(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
              "bos_token_id": 1, "eos_token_id": 2, **ARCHITECTURES[name]}
    (path / "config.json").write_text(json.dumps(config))
    return path


def plan_one(root: Path, row: tuple) -> dict:
    label, arch, hardware, method, lora, mbs, length, ckpt, published, source = row
    data = root / "one.jsonl"
    data.write_text('{"text": "a"}\n')
    model = {"path": str(write_model(root, arch)), "method": method, **({"lora": lora} if lora else {})}
    cfg = {
        "model": model,
        "data": {"train": str(data), "max_length": length},
        "train": {"max_steps": 100, "micro_batch_size": mbs, "activation_checkpointing": ckpt, "precision": "bf16", "kernels": "torch"},
    }
    path = root / "plan.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "trainforge", "plan", str(path), "--hardware", hardware, "--json"],
                       capture_output=True, text=True, env=env)
    if r.returncode not in (0, 1, 5):  # 5: a finding is an error (it does not fit the card): the plan is still printed
        return {"label": label, "error": r.stderr[-1500:]}
    plan = json.loads(r.stdout)
    m = plan["memory"]
    return {
        "label": label, "source": source, "published_gib": published,
        "tensors_gib": m["peak_tensor_bytes"] / GIB, "reserved_gib": m["peak_process_bytes"] / GIB,
        "parts_gib": {k: v / GIB for k, v in m["parts"].items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="trainforge-published-"))
    rows = [plan_one(root, row) for row in PUBLISHED]
    print("| published setup | published GiB | plan: tensors GiB | plan / published | plan: parts (GiB) |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['label']} | failed | {r['error'].splitlines()[-1][:80]} | | |")
            continue
        parts = ", ".join(f"{k} {v:.1f}" for k, v in r["parts_gib"].items() if v >= 0.05)
        print(f"| {r['label']} | {r['published_gib']:.1f} | {r['tensors_gib']:.1f} | {r['tensors_gib'] / r['published_gib']:.2f} | {parts} |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
