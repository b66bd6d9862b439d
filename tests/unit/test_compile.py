"""torch.compile: the auto rule, and a failing compile falls back to eager with a warning."""

from __future__ import annotations

import torch
from rich.console import Console

from trainforge.config import RunConfig
from trainforge.engine.trainer import train
from trainforge.metrics.console import ConsoleReporter
from trainforge.model.compile import compile_pays_off

CPU = torch.device("cpu")


def test_auto_rule_weighs_saved_time_against_compile_time():
    assert not compile_pays_off(0.2, 600, CPU)  # the demo: ~28 s saved < ~90 s compiling
    assert compile_pays_off(0.2, 10_000, CPU)
    assert not compile_pays_off(5.0, 10, CPU)


def test_failed_compile_trains_eager_with_a_warning(finetune_config, tmp_path, monkeypatch):
    def broken(self, *args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch.nn.Module, "compile", broken)
    finetune_config["train"]["compile"] = True
    console = Console(record=True, width=200)
    result = train(RunConfig.model_validate(finetune_config), tmp_path / "run", ConsoleReporter(console))
    assert "compile failed (RuntimeError: no C++ compiler); training eager" in console.export_text()
    assert result.summary["compiled"] is False and result.summary["steps"] == 8


def test_auto_does_not_compile_a_short_run(finetune_config, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: calls.append(self))
    result = train(RunConfig.model_validate(finetune_config), tmp_path / "run", ConsoleReporter(Console(quiet=True)))
    assert calls == [] and result.summary["compiled"] is False
