"""Broken and hostile files through the real CLI: a documented exit code, one paragraph naming the
file, no traceback, nothing of the user's lost.

Each case is one class of input a careless or hostile user hands over: data nested past the
parser's recursion, a model directory whose JSON does not parse or whose weights are damaged or pickled
objects, a chat template that reaches for Python internals. (Configs: test_hostile_config.py; ``--output`` at a user's folder: test_cli_train.py;
code in model directories: test_remote_code.py; damaged checkpoints: test_resume_faults.py.)
"""

from __future__ import annotations

import json
import shutil

import pytest
from hostile_dirs import damaged_weights, pickled_weights
from integration_helpers import root_conftest, run_cli, show

write_config = root_conftest().write_config

NESTED = "[" * 100_000 + "]" * 100_000  # past any JSON parser's recursion limit


def assert_refused(proc, *named: str, code: int = 2) -> None:
    assert proc.returncode == code, show(proc)
    assert "Traceback" not in proc.stderr, show(proc)
    for what in named:
        assert what in proc.stderr, f"{what!r} not named\n{show(proc)}"


@pytest.mark.parametrize("layout", ["jsonl-row", "json-file"])
def test_data_nested_past_the_parser_is_bad_input_naming_the_file(tmp_path, finetune_config, toy_data_dir, layout):
    if layout == "jsonl-row":
        bad = tmp_path / "nested.jsonl"
        first = (toy_data_dir / "pc_train.jsonl").read_text().splitlines()[0]
        bad.write_text(first + "\n" + '{"prompt": ' + NESTED + "}\n")
        named = f"{bad}:2"
    else:
        bad = tmp_path / "nested.json"
        bad.write_text(NESTED)
        named = str(bad)
    cfg = dict(finetune_config, data={**finetune_config["data"], "train": str(bad)})
    out = tmp_path / "out"
    proc = run_cli(["train", write_config(tmp_path / "c.yaml", cfg), "--output", out], tmp_path, timeout=120)
    assert_refused(proc, named, "nested too deeply")
    assert not out.exists()


def test_eval_data_nested_past_the_parser_is_bad_input(tmp_path, tiny_model_dir):
    bad = tmp_path / "nested.json"
    bad.write_text(NESTED)
    proc = run_cli(["eval", tiny_model_dir, "--data", bad], tmp_path, timeout=120)
    assert_refused(proc, str(bad), "nested too deeply")


@pytest.mark.parametrize("damage", ["not-json", "a-list", "nested"])
def test_a_model_directory_whose_config_does_not_parse_is_refused(tmp_path, tiny_model_dir, finetune_config, damage):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "config.json").write_text({"not-json": '{"model_type": "llama",', "a-list": "[1, 2]", "nested": NESTED}[damage])
    proc = run_cli(["generate", model, "--prompt", "alpha", "--max-new-tokens", "2"], tmp_path, timeout=120)
    assert_refused(proc, str(model), "config.json")

    cfg = dict(finetune_config, model={"path": str(model), "method": "full"})
    out = tmp_path / "out"
    proc = run_cli(["train", write_config(tmp_path / "c.yaml", cfg), "--output", out], tmp_path, timeout=120)
    assert_refused(proc, str(model), "config.json")
    assert not out.exists()


def test_generate_chat_with_a_template_escaping_the_sandbox_is_bad_input(tmp_path, tiny_model_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    tok_config = json.loads((model / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = "{{ ''.__class__.__mro__[1].__subclasses__() }}{% for m in messages %}{{ m.content }}{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps(tok_config))
    proc = run_cli(["generate", model, "--chat", "--max-new-tokens", "2"], tmp_path, timeout=120, input="user: hi\n")
    assert_refused(proc, "--chat", "chat template")


@pytest.mark.parametrize("damage", ["header", "empty", "shard"])
def test_damaged_weights_are_refused_naming_the_file_before_a_run_directory(tmp_path, tiny_model_dir, finetune_config, damage):
    model = tmp_path / "m"
    bad = damaged_weights(tiny_model_dir, model, damage)
    said = "is empty (0 bytes)" if damage == "empty" else "corrupt header"
    cfg = write_config(tmp_path / "c.yaml", dict(finetune_config, model={"path": str(model), "method": "full"}))
    out = tmp_path / "out"
    proc = run_cli(["train", cfg, "--output", out], tmp_path, timeout=120)
    assert_refused(proc, f"{bad}: {said}", "download or save the model there again")
    assert not out.exists()  # refused at validation: no run directory holding only config.yaml
    if damage != "header":
        return
    proc = run_cli(["plan", cfg], tmp_path, timeout=120)
    assert_refused(proc, f"{bad}: corrupt header")
    proc = run_cli(["generate", model, "--prompt", "alpha", "--max-new-tokens", "2"], tmp_path, timeout=120)
    assert_refused(proc, f"{bad}: corrupt header")
    proc = run_cli(["export", model, "--out", tmp_path / "copy"], tmp_path, timeout=120)  # a copy would pass the damage on
    assert_refused(proc, f"{bad}: corrupt header")
    assert not (tmp_path / "copy").exists()


def test_pickled_weights_that_need_code_are_refused_and_never_run(tmp_path, tiny_model_dir, finetune_config):
    marker = tmp_path / "ran"
    model = tmp_path / "m"
    bad = pickled_weights(tiny_model_dir, model, marker)
    proc = run_cli(["eval", model, "--data", finetune_config["data"]["eval"]], tmp_path, timeout=120)
    assert_refused(proc, f"{bad}: holds pickled objects; refused", "convert this file to safetensors")
    cfg = write_config(tmp_path / "c.yaml", dict(finetune_config, model={"path": str(model), "method": "full"}))
    proc = run_cli(["train", cfg, "--output", tmp_path / "out"], tmp_path, timeout=120)
    assert_refused(proc, f"{bad}: holds pickled objects; refused")
    assert not (tmp_path / "out").exists()
    assert not marker.exists()
