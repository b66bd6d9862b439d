"""Presets: named overlays, where they sit between the file, the built-in default and --set."""

from __future__ import annotations

import copy
import io

import pytest
import yaml
from rich.console import Console

from trainforge.config.run import ConfigError, RunConfig, load_config
from trainforge.config.presets import PRESETS, overlay
from trainforge.engine import trainer
from trainforge.metrics.console import ConsoleReporter


def write(tmp_path, cfg: dict):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_cli_preset_lies_over_the_file_and_under_set(finetune_config, tmp_path):
    path = write(tmp_path, finetune_config)  # the file trains 8 steps with log.every_steps 2
    cfg = load_config(path, preset="smoke")
    assert cfg.preset == "smoke" and cfg.train.max_steps == 20 and cfg.log.every_steps == 1
    assert cfg.train.compile is False and cfg.data.max_documents == 200 and cfg.checkpoint.every_steps == 20
    cfg = load_config(path, ["train.max_steps=5"], preset="smoke")
    assert cfg.train.max_steps == 5 and cfg.log.every_steps == 1


def test_a_files_own_preset_lies_under_its_keys(finetune_config, tmp_path):
    path = write(tmp_path, {**finetune_config, "preset": "smoke"})
    cfg = load_config(path)
    assert cfg.preset == "smoke"
    assert cfg.train.max_steps == 8 and cfg.log.every_steps == 2  # the file's keys win
    assert cfg.train.compile is False and cfg.data.max_documents == 200  # the preset fills the rest


def test_any_preset_overrides_the_built_in_default():
    assert load_config(preset="smoke").train.max_steps == 20
    assert load_config().train.max_steps == 600


def test_setting_the_run_length_replaces_the_other_length_key(finetune_config, tmp_path):
    cfg = copy.deepcopy(finetune_config)
    del cfg["train"]["max_steps"]
    cfg["train"]["epochs"] = 3
    loaded = load_config(write(tmp_path, cfg), preset="smoke")
    assert loaded.train.max_steps == 20 and loaded.train.epochs is None
    assert overlay({"train": {"max_steps": 5, "seed": 1}}, {"train": {"epochs": 2}}) == {"train": {"epochs": 2, "seed": 1}}


def test_unknown_presets_are_refused_with_the_names(finetune_config, tmp_path):
    with pytest.raises(ConfigError, match="preset 'fast' is not known; the presets are: smoke, production") as e:
        load_config(write(tmp_path, finetune_config), preset="fast")
    assert e.value.exit_code == 2
    with pytest.raises(ConfigError, match="preset 'fast' is not known"):
        load_config(write(tmp_path, {**finetune_config, "preset": "fast"}))


def test_the_resolved_config_shows_the_preset(finetune_config, tmp_path):
    text = load_config(write(tmp_path, finetune_config), preset="production").to_yaml()
    resolved = yaml.safe_load(text)
    assert resolved["preset"] == "production" and resolved["checkpoint"]["async"] is True
    assert resolved["train"]["eval_every"] == "auto" and resolved["train"]["compile"] == "auto"
    assert set(PRESETS) == {"smoke", "production"}


def test_eval_every_auto_evaluates_ten_times_over_the_run(finetune_config, tmp_path):
    cfg = copy.deepcopy(finetune_config)
    cfg["train"].update(max_steps=20, eval_every="auto", micro_batch_size=2, grad_accum=1)
    buf = io.StringIO()
    trainer.train(RunConfig.model_validate(cfg), tmp_path / "run", ConsoleReporter(Console(file=buf, width=300)))
    assert "eval_every auto -> 2 (ten evaluations over 20 steps)" in buf.getvalue()
    rows = [yaml.safe_load(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in rows if "eval_loss" in r) == [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20]
