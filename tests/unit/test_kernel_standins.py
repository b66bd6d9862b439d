"""plan with Liger's kernels (train.kernels: auto/liger on a GPU): the traced step keeps what Liger's RMSNorm and
SwiGLU keep, so the predicted activations drop by exactly the tensors torch's versions keep and Liger's do not."""

from __future__ import annotations

import dataclasses

import pytest

from trainforge.config.run import RunConfig
from trainforge.engine.predict.fit import planned_kernels, predict_memory
from trainforge.engine.predict.trace import trace_training_step
from trainforge.hardware.device import PRECISIONS
from trainforge.model.tokenizer import load_tokenizer
from trainforge.hardware.profiles import find_profile

pytest.importorskip("liger_kernel")
H, I, L, ROWS, LENGTH = 64, 256, 2, 2, 128


def config(toy_data_dir, tiny_tokenizer_dir, architecture: str = "llama", kernels: str = "auto") -> RunConfig:
    init = {"architecture": architecture, "hidden_size": H, "intermediate_size": I, "num_hidden_layers": L,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
    if architecture == "gpt2":  # GPT-2 names its sizes its own way
        init = {"architecture": "gpt2", "n_embd": H, "n_inner": I, "n_layer": L, "n_head": 4, "n_positions": 256}
    return RunConfig.model_validate({
        "model": {"init": init, "tokenizer": str(tiny_tokenizer_dir)},
        "data": {"train": str(toy_data_dir / "text_train.jsonl"), "max_length": LENGTH},
        "train": {"precision": "bf16", "kernels": kernels},
    })


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_liger_frees_the_normalized_inputs_and_silu_outputs(toy_data_dir, tiny_tokenizer_dir, architecture):
    cfg = config(toy_data_dir, tiny_tokenizer_dir, architecture)
    tok = load_tokenizer(tiny_tokenizer_dir)
    torch_path, liger = (trace_training_step(cfg, tok, PRECISIONS["bf16"], ROWS, False, 1, "cuda", k) for k in ("torch", "liger"))
    tokens = ROWS * LENGTH
    # per norm (2 a layer and the final one) an fp32 row x hidden tensor; per layer a bf16 silu(gate)
    freed = (2 * L + 1) * tokens * H * 4 + L * tokens * I * 2
    assert torch_path.parts["activations"] - liger.parts["activations"] == freed
    assert {k: v for k, v in torch_path.parts.items() if k != "activations"} == {k: v for k, v in liger.parts.items() if k != "activations"}


def test_an_architecture_liger_does_not_know_is_traced_as_torch(toy_data_dir, tiny_tokenizer_dir):
    cfg = config(toy_data_dir, tiny_tokenizer_dir, "gpt2")
    tok = load_tokenizer(tiny_tokenizer_dir)
    torch_path, liger = (trace_training_step(cfg, tok, PRECISIONS["bf16"], ROWS, False, 1, "cuda", k) for k in ("torch", "liger"))
    assert torch_path.parts == liger.parts


def test_a_gpu_plan_counts_liger_where_it_would_run(toy_data_dir, tiny_tokenizer_dir):
    tok = load_tokenizer(tiny_tokenizer_dir)
    h100 = find_profile("h100")
    cpu = dataclasses.replace(h100, kind="cpu")
    auto, off = config(toy_data_dir, tiny_tokenizer_dir), config(toy_data_dir, tiny_tokenizer_dir, kernels="torch")
    assert planned_kernels(auto, h100) == "liger" and planned_kernels(off, h100) == "torch" and planned_kernels(auto, cpu) == "torch"
    with_liger, without = (predict_memory(c, tok, PRECISIONS["bf16"], h100, ROWS, False) for c in (auto, off))
    assert with_liger.parts["activations"] < without.parts["activations"]
