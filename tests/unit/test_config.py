"""Config loading, overrides and error messages (in-process; the CLI exit code is tested in integration)."""

from __future__ import annotations

import pytest
import yaml

from trainforge.config import ConfigError, RunConfig, load_config, parse_override, resolve_max_steps


def test_default_config_is_valid_and_resolves_every_key():
    cfg = load_config(None)
    dumped = yaml.safe_load(cfg.to_yaml())
    assert set(dumped) == {"model", "data", "train", "optim", "checkpoint", "log"}
    assert dumped["model"]["init"]["architecture"] == "llama"
    assert RunConfig.model_validate(dumped) == cfg  # the written config.yaml reloads to the same run


@pytest.mark.parametrize(
    "item, parts, value",
    [
        ("train.max_steps=100", ["train", "max_steps"], 100),
        ("optim.lr=1e-4", ["optim", "lr"], 1e-4),
        ("optim.lr=3.0e-4", ["optim", "lr"], 3e-4),
        ("data.packing=true", ["data", "packing"], True),
        ("data.eval=null", ["data", "eval"], None),
        ("log.sample_prompt=hello world", ["log", "sample_prompt"], "hello world"),
        ("model.lora.target_modules=[q_proj, v_proj]", ["model", "lora", "target_modules"], ["q_proj", "v_proj"]),
    ],
)
def test_parse_override_coerces_types(item, parts, value):
    assert parse_override(item) == (parts, value)


def test_overrides_apply_to_nested_keys():
    cfg = load_config(None, ["train.max_steps=7", "optim.lr=1e-4", "model.init.hidden_size=64"])
    assert cfg.train.max_steps == 7 and cfg.optim.lr == 1e-4 and cfg.model.init["hidden_size"] == 64


def test_malformed_override():
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(None, ["train.max_steps"])


def error_of(overrides=(), path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return str(info.value)


@pytest.mark.parametrize(
    "override, key, fragment",
    [
        ("train.max_stepz=3", "train.max_stepz", "did you mean 'max_steps'"),
        ("train.micro_batch_size=eight", "train.micro_batch_size", "'eight'"),
        ("optim.lr=-1", "optim.lr", "greater than 0"),
        ("data.max_length=0", "data.max_length", "greater than 0"),
        ("data.train=./nope.jsonl", "data.train", "no file matches"),
        ("model.method=qlora", "model.method", "needs a pretrained model.path"),
        ("model.init.hidden_sizee=3", "model.init.hidden_sizee", "did you mean hidden_size"),
        ("model.init.architecture=lama", "model.init.architecture", "did you mean llama"),
        ("train.precision=fp8", "train.precision", "'fp32'"),
        ("data.eval=1.5", "data.eval", "between 0 and 1"),
    ],
)
def test_bad_values_name_the_key(override, key, fragment):
    msg = error_of([override])
    assert f"  {key}: " in msg and fragment in msg and "(from --set)" in msg


def test_errors_in_yaml_name_file_and_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "model:\n  init: {architecture: llama, hidden_size: 32}\n"
        "data:\n  train: builtin:python-stdlib\n"
        "train:\n  max_steps: 10\n  max_stepz: 3\n"
        "optim:\n  lr: -0.1\n"
    )
    msg = error_of(path=path)
    assert f"train.max_stepz: unknown key" in msg and f"{path}, line 7" in msg
    assert "optim.lr" in msg and f"{path}, line 9" in msg


def test_model_path_must_exist_and_exclude_init(tmp_path):
    assert "model.path" in error_of(["model.path=./does-not-exist"])
    assert "exactly one of model.path" in error_of([f"model.path={tmp_path}"])


def test_lora_needs_a_pretrained_model():
    assert "model.method: lora needs a pretrained model.path" in error_of(["model.method=lora"])


def test_not_yaml_mapping(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("- just\n- a list\n")
    assert "top level must be a mapping" in error_of(path=path)


def test_steps_from_epochs():
    cfg = load_config(None, ["train.max_steps=null", "train.epochs=2", "train.grad_accum=4"])
    assert resolve_max_steps(cfg.train, batches_per_epoch=10) == 5
    assert "not both" in error_of(["train.epochs=2"])


def test_docs_config_reference_is_current():
    """docs/config.md is generated; regenerate with `trainforge config --reference > docs/config.md`."""
    from pathlib import Path

    from trainforge.tools.config_reference import config_reference

    docs = Path(__file__).resolve().parents[2] / "docs" / "config.md"
    assert docs.read_text() == config_reference()


def test_quickstart_example_is_the_builtin_default():
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
    assert load_config(example) == load_config(None)


@pytest.mark.parametrize("name", ["lora-sft.yaml", "full-sft.yaml"])
def test_examples_validate(name, tmp_path, monkeypatch):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    final = tmp_path / "runs" / "demo" / "final"  # the model `make demo` leaves there
    final.mkdir(parents=True)
    for file in ("config.json", "model.safetensors", "tokenizer.json"):
        (final / file).write_text("{}")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(root / "examples" / name)
    assert cfg.model.path == Path("runs/demo/final")


def test_a_model_path_that_is_not_a_model_directory_says_what_it_lacks(tmp_path, tiny_model_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    message = error_of([f"model.path={empty}", "model.init=null"])
    assert "model.path" in message and "config.json, weights (model.safetensors or pytorch_model.bin), tokenizer files" in message
    weights_only = tmp_path / "no-tokenizer"
    weights_only.mkdir()
    for name in ("config.json", "model.safetensors"):
        (weights_only / name).write_bytes((tiny_model_dir / name).read_bytes())
    message = error_of([f"model.path={weights_only}", "model.init=null"])
    assert "lacks tokenizer files" in message and "model.tokenizer" in message
    load_config(None, [f"model.path={weights_only}", "model.init=null", f"model.tokenizer={tiny_model_dir}"])


def test_qlora_without_bitsandbytes_names_the_extra(monkeypatch, tiny_model_dir):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    message = error_of([f"model.path={tiny_model_dir}", "model.init=null", "model.method=qlora"])
    assert "model.method: qlora needs bitsandbytes" in message and "pip install 'trainforge[qlora]'" in message


def test_global_batch_size_derives_grad_accum_per_process_count():
    from trainforge.config import resolve_grad_accum

    cfg = load_config(None, ["train.global_batch_size=32", "train.micro_batch_size=4"])
    assert resolve_grad_accum(cfg.train, 1) == 8 and resolve_grad_accum(cfg.train, 2) == 4 and resolve_grad_accum(cfg.train, 8) == 1
    with pytest.raises(ConfigError, match=r"not a multiple of micro_batch_size x processes = 4 x 3 = 12"):
        resolve_grad_accum(cfg.train, 3)
    both = load_config(None, ["train.global_batch_size=32", "train.micro_batch_size=4", "train.grad_accum=2"])
    with pytest.raises(ConfigError, match=r"train.grad_accum=2 contradicts train.global_batch_size=32"):
        resolve_grad_accum(both.train, 1)
    agreeing = load_config(None, ["train.global_batch_size=32", "train.micro_batch_size=4", "train.grad_accum=8"])
    assert resolve_grad_accum(agreeing.train, 1) == 8  # a run directory's config.yaml holds both, agreeing
    assert resolve_grad_accum(load_config(None, ["train.grad_accum=3"]).train, 4) == 3  # without it: as given
