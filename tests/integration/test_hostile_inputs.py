"""Broken and hostile files through the real CLI: a documented exit code, one paragraph naming the
file, no traceback, nothing of the user's lost.

Each case is one class of input a careless or hostile user hands over: data nested past the
parser's recursion, a model directory whose JSON does not parse, a chat template that reaches for
Python internals, a folder of the user's own files as ``--output``. (Configs: test_hostile_config.py;
code in model directories: test_remote_code.py; damaged checkpoints: test_resume_faults.py.)
"""

from __future__ import annotations

import json
import shutil

import pytest
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


# ---------------------------------------------------------------- configs: bombs, absurd values, wrong files

BOMB = "".join(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]\n" for i in range(1, 10))


@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("alias-bomb", ["aliases", "line 2"]),
        ("huge-int", ["train.max_steps"]),
        ("infinite-lr", ["optim.lr"]),
        ("nan-weight-decay", ["optim.weight_decay"]),
        ("nested", ["nested more than 64 levels"]),
        ("binary", ["not a UTF-8 text file"]),
    ],
)
def test_hostile_config_files_exit_2_quickly_naming_the_key_or_file(tmp_path, finetune_config, case, named):
    config = write_config(tmp_path / "c.yaml", finetune_config)
    text = config.read_text()
    if case == "alias-bomb":
        text = "a0: &a0 [x]\n" + BOMB.replace("a1: &a1", "a1: &a1", 1) + text + "log:\n  sample_prompt: *a9\n"
        text = text.replace("log:\n  every_steps", "log_unused:\n  every_steps", 1)
    elif case == "huge-int":
        text = text.replace("max_steps: 8", "max_steps: 1000000000000000000000000000")
    elif case == "infinite-lr":
        text = text.replace("lr: 0.001", "lr: .inf")
    elif case == "nan-weight-decay":
        text += "  weight_decay: .nan\n" if text.rstrip().endswith("warmup_steps: 2") else ""
        text = text.replace("warmup_steps: 2", "warmup_steps: 2\n  weight_decay: .nan", 1)
    elif case == "nested":
        text = text.replace("max_steps: 8", "max_steps: " + "[" * 50_000 + "]" * 50_000)
    config.write_text(text) if case != "binary" else config.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00" * 100)
    proc = run_cli(["config", config], tmp_path, timeout=60)
    assert_refused(proc, *named)
    assert len(proc.stderr) < 5_000, show(proc)  # no unbounded value in the message


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("train.max_steps=" + "1" * 120_000, ["train.max_steps"]),
        ("log.sample_prompt=[&a [1], *a]", ["aliases"]),
        ("train.seed=-1", ["train.seed"]),
        ("train.micro_batch_size=" + "9" * 30, ["train.micro_batch_size"]),
    ],
    ids=["120k-digit-int", "alias", "negative-seed", "absurd-batch"],
)
def test_hostile_overrides_exit_2_naming_the_key(tmp_path, finetune_config, override, named):
    config = write_config(tmp_path / "c.yaml", finetune_config)
    proc = run_cli(["config", config, "--set", override], tmp_path, timeout=60)
    assert_refused(proc, *named)
    assert len(proc.stderr) < 5_000, show(proc)


@pytest.mark.parametrize("command", ["train", "plan", "prepare", "config"])
def test_a_config_that_is_a_directory_is_named_as_one(tmp_path, command):
    proc = run_cli([command, tmp_path], tmp_path, timeout=60)
    assert_refused(proc, str(tmp_path), "is a directory")
