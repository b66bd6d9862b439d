"""An image-text checkpoint (Gemma 3, Llama 3.2 Vision: text_config + vision_config) as model.path with text data: its
language model trains, the vision tower stays frozen, and the saved model is still the full image-text model.
(Mllama's causal-LM class is its language model alone: through it the vision parts were dropped.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from integration_helpers import root_conftest, run_cli, show

write_config = root_conftest().write_config
VISION = ("vision_tower", "vision_model", "multi_modal_projector")
CLASSES = {"gemma3": "Gemma3ForConditionalGeneration", "mllama": "MllamaForConditionalGeneration"}


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """A tiny random Gemma3ForConditionalGeneration saved with save_pretrained, with the session's tokenizer."""
    import torch
    from transformers import AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    n = len(tok)
    text = dict(vocab_size=n + 4, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=128, sliding_window=16,
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=n + 1,
                          boi_token_index=n + 2, eoi_token_index=n + 3)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gemma3-image-text")
    Gemma3ForConditionalGeneration(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def mllama_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """A tiny random MllamaForConditionalGeneration (a cross-attention layer, a vision model) as published: the full
    config, model_type mllama."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from trainforge.tools.family_shrink import tiny_config

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("mllama-image-text")
    AutoModelForImageTextToText.from_config(tiny_config("mllama", len(tok))).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(params=sorted(CLASSES))
def image_text(request) -> tuple[str, Path]:
    """(the family, its tiny image-text directory)."""
    return request.param, request.getfixturevalue(f"{request.param}_dir")


def settings(model: dict, data_dir: Path) -> dict:
    return {
        "model": model,
        "data": {"train": str(data_dir / "text_train.jsonl"), "max_length": 64},
        "train": {"max_steps": 2, "micro_batch_size": 2, "precision": "fp32", "device": "cpu"},
        "optim": {"lr": 0.01},
        "log": {"every_steps": 1, "report": False, "sample_prompt": None},
    }


def weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def assert_text_trained_vision_kept(before: dict, after: dict) -> None:
    import torch

    assert before.keys() == after.keys()
    vision = [k for k in before if any(v in k for v in VISION)]
    assert vision and all(torch.equal(before[k], after[k]) for k in vision)  # bit for bit
    assert any(not torch.equal(before[k], after[k]) for k in before if "language_model" in k)


def test_full_finetune_trains_the_language_model_and_keeps_the_vision_tower(tmp_path, image_text, toy_data_dir):
    from transformers import AutoModelForImageTextToText

    family, model_dir = image_text
    cfg = write_config(tmp_path / "g.yaml", settings({"path": str(model_dir)}, toy_data_dir))
    proc = run_cli(["train", cfg, "--output", tmp_path / "run"], tmp_path)
    assert proc.returncode == 0, show(proc)
    assert f"image-text model ({CLASSES[family]})" in proc.stdout + proc.stderr, show(proc)
    assert_text_trained_vision_kept(weights(model_dir), weights(tmp_path / "run" / "final"))
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "run" / "final")
    assert type(model).__name__ == CLASSES[family]


def test_lora_adapts_the_language_model_only_and_merges_into_the_full_model(tmp_path, image_text, toy_data_dir):
    import json

    _, model_dir = image_text
    cfg = write_config(tmp_path / "g.yaml", settings({"path": str(model_dir), "method": "lora"}, toy_data_dir))
    proc = run_cli(["train", cfg, "--output", tmp_path / "run"], tmp_path)
    assert proc.returncode == 0, show(proc)
    from safetensors.torch import load_file

    adapters = load_file(tmp_path / "run" / "final" / "adapter_model.safetensors")
    assert adapters and all("language_model" in k for k in adapters), sorted(adapters)[:5]
    assert json.loads((tmp_path / "run" / "final" / "adapter_config.json").read_text())["exclude_modules"]
    proc = run_cli(["export", tmp_path / "run", "--merge", "--out", tmp_path / "merged"], tmp_path)
    assert proc.returncode == 0, show(proc)
    assert_text_trained_vision_kept(weights(model_dir), weights(tmp_path / "merged"))
