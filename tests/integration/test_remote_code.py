"""Hostile model directories through the real CLI: a directory whose config.json or tokenizer_config.json maps
to Python files of its own (``auto_map``), an adapter on such a base, a ``model_type`` transformers does not
know. Every entry point that loads a config, tokenizer or model exits 2 with one line naming the directory;
nothing prompts (``y`` waits on stdin all the same) and the directory's code never runs (its marker file
never appears)."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path

import pytest
from hostile_dirs import adapter_on, custom_code_model, custom_code_tokenizer, unknown_architecture
from integration_helpers import cli_command, root_conftest, show

write_config = root_conftest().write_config
SHIPPED_ONLY = "trainforge loads only architectures that transformers ships"


def _run(args: list, tmp_path: Path) -> subprocess.CompletedProcess:
    """The CLI with a user answering ``y`` to any prompt (there must be none)."""
    argv, env = cli_command(args)
    env["HF_MODULES_CACHE"] = str(tmp_path / "hf-modules")  # were code imported, it would land here, not in ~
    return subprocess.run(argv, cwd=tmp_path, env=env, input="y\n" * 10, capture_output=True, text=True, timeout=180)


def _assert_refused(proc: subprocess.CompletedProcess, marker: Path, *expected: str) -> None:
    assert proc.returncode == 2, show(proc)
    assert "Traceback" not in proc.stderr, show(proc)
    assert "Do you wish to run the custom code" not in proc.stdout + proc.stderr, show(proc)
    for text in expected:
        assert text in proc.stderr, f"{text!r} not in the message\n{show(proc)}"
    assert not marker.exists(), f"the directory's own code ran\n{show(proc)}"


@pytest.fixture
def marker(tmp_path) -> Path:
    return tmp_path / "MARKER"


@pytest.fixture
def evil_model(tiny_model_dir, tmp_path, marker) -> Path:
    return custom_code_model(tiny_model_dir, tmp_path / "evil-model", marker)


def _train_config(tmp_path: Path, finetune_config: dict, **model) -> Path:
    cfg = copy.deepcopy(finetune_config)
    cfg["model"].update(model)
    cfg["train"]["max_steps"] = 1
    return write_config(tmp_path / "train.yaml", cfg)


@pytest.mark.parametrize("key", ["path", "tokenizer"])
def test_train_refuses_a_directory_with_custom_code(key, tmp_path, finetune_config, tiny_model_dir, tiny_tokenizer_dir, marker):
    evil = (custom_code_model(tiny_model_dir, tmp_path / "evil-model", marker) if key == "path"
            else custom_code_tokenizer(tiny_tokenizer_dir, tmp_path / "evil-tok", marker))
    out = tmp_path / "run"
    proc = _run(["train", _train_config(tmp_path, finetune_config, **{key: str(evil)}), "--output", out], tmp_path)
    _assert_refused(proc, marker, f"model.{key}: {evil} needs custom code", "auto_map", SHIPPED_ONLY)
    assert not out.exists()


def test_train_refuses_an_adapter_whose_base_has_custom_code(tmp_path, finetune_config, tiny_tokenizer_dir, evil_model, marker):
    adapter = adapter_on(evil_model, tmp_path / "adapter")
    config = _train_config(tmp_path, finetune_config, path=str(adapter), tokenizer=str(tiny_tokenizer_dir))
    proc = _run(["train", config, "--output", tmp_path / "run"], tmp_path)
    _assert_refused(proc, marker, f"the adapter in {adapter} adapts {evil_model}: {evil_model} needs custom code")


def test_train_names_a_model_type_transformers_does_not_know(tmp_path, finetune_config, tiny_model_dir, marker):
    odd = unknown_architecture(tiny_model_dir, tmp_path / "odd")
    proc = _run(["train", _train_config(tmp_path, finetune_config, path=str(odd)), "--output", tmp_path / "run"], tmp_path)
    _assert_refused(proc, marker, f"model.path: {odd}: config.json names model_type 'mystery'", SHIPPED_ONLY)


def test_plan_refuses_a_directory_with_custom_code(tmp_path, finetune_config, evil_model, marker):
    proc = _run(["plan", _train_config(tmp_path, finetune_config, path=str(evil_model)), "--hardware", "H100"], tmp_path)
    _assert_refused(proc, marker, f"model.path: {evil_model} needs custom code", SHIPPED_ONLY)


def test_eval_and_generate_refuse_a_directory_with_custom_code(tmp_path, toy_data_dir, evil_model, marker):
    proc = _run(["eval", evil_model, "--data", toy_data_dir / "pc_eval.jsonl"], tmp_path)
    _assert_refused(proc, marker, f"{evil_model} needs custom code (config.json auto_map: AutoConfig=configuration_evil.EvilConfig", SHIPPED_ONLY)
    proc = _run(["generate", evil_model, "--prompt", "alpha", "--max-new-tokens", "2"], tmp_path)
    _assert_refused(proc, marker, f"{evil_model} needs custom code", SHIPPED_ONLY)


def test_eval_refuses_a_model_whose_tokenizer_has_custom_code(tmp_path, toy_data_dir, tiny_model_dir, marker):
    model = custom_code_tokenizer(tiny_model_dir, tmp_path / "evil-tok-model", marker)
    proc = _run(["eval", model, "--data", toy_data_dir / "pc_eval.jsonl"], tmp_path)
    _assert_refused(proc, marker, f"{model} needs custom code (tokenizer_config.json auto_map: AutoTokenizer=tokenization_evil", SHIPPED_ONLY)


def test_export_merge_refuses_an_adapter_whose_base_has_custom_code(tmp_path, evil_model, marker):
    adapter = adapter_on(evil_model, tmp_path / "adapter")
    out = tmp_path / "merged"
    proc = _run(["export", adapter, "--merge", "--out", out], tmp_path)
    _assert_refused(proc, marker, f"{evil_model} needs custom code", SHIPPED_ONLY)
    assert not out.exists()
    proc = _run(["export", evil_model, "--merge", "--out", out], tmp_path)
    _assert_refused(proc, marker, f"{evil_model} needs custom code", SHIPPED_ONLY)
    assert not out.exists()
