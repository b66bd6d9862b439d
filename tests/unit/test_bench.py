"""Bench variants: sweeps are crossed; a micro-batch sweep holds the global batch constant."""

from __future__ import annotations

import pytest

from trainforge.config.run import ConfigError, load_config
from trainforge.tools.bench import parse_sweep, variants


def test_micro_batch_sweep_holds_global_batch():
    base = load_config(None, ["train.micro_batch_size=8", "train.grad_accum=2"])
    got = variants(base, parse_sweep(["train.micro_batch_size=2,4,16"]))
    assert [o for _, o in got] == [
        ["train.micro_batch_size=2", "train.grad_accum=8"],
        ["train.micro_batch_size=4", "train.grad_accum=4"],
        ["train.micro_batch_size=16", "train.grad_accum=1"],
    ]
    with pytest.raises(ConfigError, match="does not divide the global batch 16"):
        variants(base, parse_sweep(["train.micro_batch_size=3"]))


def test_sweeps_are_crossed_and_explicit_accum_is_kept():
    base = load_config(None)
    got = variants(base, parse_sweep(["train.micro_batch_size=2,4", "train.grad_accum=1,3", "optim.lr=1e-3"]))
    assert len(got) == 4
    assert got[3][1] == ["train.micro_batch_size=4", "train.grad_accum=3", "optim.lr=0.001"]
    assert variants(base, [])[0] == ("config", [])


def test_malformed_sweep():
    with pytest.raises(ConfigError, match="KEY=V1,V2"):
        parse_sweep(["train.micro_batch_size"])


def test_a_micro_batch_sweep_under_global_batch_size_and_under_auto():
    """A config holding train.global_batch_size (the README's advice) had every variant fail ('grad_accum contradicts
    global_batch_size'): bench set grad_accum from micro x accum. micro_batch_size: auto raised a TypeError."""
    held = load_config(None, ["train.micro_batch_size=8", "train.global_batch_size=16"])
    got = variants(held, parse_sweep(["train.micro_batch_size=4,8"]))
    assert [o for _, o in got] == [["train.micro_batch_size=4"], ["train.micro_batch_size=8"]]  # accumulation follows
    assert [label for label, _ in got] == ["micro_batch_size=4 (x4 accum)", "micro_batch_size=8 (x2 accum)"]
    for _, overrides in got:
        load_config(None, ["train.global_batch_size=16", *overrides])  # each variant is a valid config
    with pytest.raises(ConfigError, match="micro_batch_size is auto, so there is no global batch to hold: set train.global_batch_size"):
        variants(load_config(None, ["train.micro_batch_size=auto"]), parse_sweep(["train.micro_batch_size=4,8"]))
    auto_held = load_config(None, ["train.micro_batch_size=auto", "train.global_batch_size=16"])
    assert [o for _, o in variants(auto_held, parse_sweep(["train.micro_batch_size=4"]))] == [["train.micro_batch_size=4"]]


def test_an_auto_micro_batch_in_a_sweep_holds_the_batch_only_under_global_batch_size():
    """--sweep train.micro_batch_size=auto,4 raised a TypeError (auto % global batch)."""
    with pytest.raises(ConfigError, match="auto micro-batch holds the global batch only under train.global_batch_size"):
        variants(load_config(None, ["train.micro_batch_size=8"]), parse_sweep(["train.micro_batch_size=auto,4"]))
    held = load_config(None, ["train.micro_batch_size=8", "train.global_batch_size=16"])
    got = variants(held, parse_sweep(["train.micro_batch_size=auto,4"]))
    assert got == [("micro_batch_size=auto (accum follows)", ["train.micro_batch_size=\"auto\""]),
                   ("micro_batch_size=4 (x4 accum)", ["train.micro_batch_size=4"])]
