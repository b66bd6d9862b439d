"""Hostile and broken config input through the real CLI: exit code 2 within seconds, one message naming the
file or key, no traceback, no run directory.

Each case stands for its class: an alias bomb (any alias expansion past the cap), an integer past Python's
digit limit (in a file or ``--set``), nesting past the recursion limit, bytes that are not UTF-8, a config that
is a directory (every command taking CONFIG), floats that are not finite and integers no run reaches.
Every subprocess runs under a 30 s timeout, so a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from integration_helpers import run_cli, show

HANG_TIMEOUT_S = 30

BASE = {
    "model": {
        "init": {"architecture": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                 "num_attention_heads": 2},
        "tokenizer_vocab_size": 300,
    },
    "data": {"train": "builtin:python-stdlib", "max_documents": 10},
    "train": {"max_steps": 2, "device": "cpu"},
}


def _alias_bomb() -> str:
    """The issue's file: ten anchors, each a list of ten references to the one before (10^10 values)."""
    lines = ['a0: &a0 ["x","x","x","x","x","x","x","x","x","x"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 10)]
    return "\n".join(lines) + "\n"


def _write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def _base_yaml() -> str:
    return yaml.safe_dump(BASE, sort_keys=False)


def _fails_cleanly(proc, *expected: str) -> None:
    assert proc.returncode == 2, show(proc)
    assert "Traceback" not in proc.stderr, show(proc)
    for s in expected:
        assert s in proc.stderr, f"{s!r} not in the message\n{show(proc)}"
    assert len(proc.stderr) < 3000, f"an unbounded message: {len(proc.stderr)} characters"


def test_an_alias_bomb_used_as_a_value_stops_at_once(tmp_path):
    config = _write(tmp_path, "bomb.yaml", _alias_bomb() + _base_yaml() + "log:\n  sample_prompt: *a9\n")
    out = tmp_path / "out"
    proc = run_cli(["train", config, "--output", out], tmp_path, timeout=HANG_TIMEOUT_S)
    _fails_cleanly(proc, "bomb.yaml, line", "aliases", "more than 100000 values")
    assert not out.exists()


@pytest.mark.parametrize(
    "name, text, expected",
    [
        ("bigint.yaml", _base_yaml().replace("max_steps: 2", "max_steps: " + "1" * 120_000),
         ["bigint.yaml, line", "train.max_steps", "120000"]),
        ("deep.yaml", _base_yaml() + "log:\n  sample_prompt: " + "[" * 5000 + "]" * 5000 + "\n",
         ["deep.yaml", "nested too deeply"]),
        ("self.yaml", _base_yaml() + "log:\n  sample_prompt: &r [*r]\n", ["self.yaml, line", "log.sample_prompt", "itself"]),
        ("inf.yaml", _base_yaml() + "optim:\n  lr: .inf\n", ["inf.yaml, line", "optim.lr", "finite"]),
        ("huge-steps.yaml", _base_yaml().replace("max_steps: 2", "max_steps: " + "1" + "0" * 27),
         ["huge-steps.yaml, line", "train.max_steps", "less than or equal to 1000000000"]),
        ("binary.yaml", b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)), ["binary.yaml", "not UTF-8 text"]),
        ("broken.yaml", "model:\n  init: [a\n", ["broken.yaml", "not valid YAML", "line 2"]),
    ],
    ids=["int-120000-digits", "nested-5000-deep", "self-referring-alias", "lr-inf", "max-steps-1e27", "binary", "not-yaml"],
)
def test_a_hostile_config_file_exits_2_naming_it(tmp_path, name, text, expected):
    config = _write(tmp_path, name, text)
    out = tmp_path / "out"
    proc = run_cli(["train", config, "--output", out], tmp_path, timeout=HANG_TIMEOUT_S)
    _fails_cleanly(proc, *expected)
    assert not out.exists()


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.max_steps=" + "1" * 120_000, ["--set train.max_steps", "120000"]),
        ("log.sample_prompt=" + "[" * 3000, ["--set log.sample_prompt", "nested too deeply"]),
        ("train.max_steps=[1,", ["train.max_steps", "(from --set)"]),
        ("optim.lr=.inf", ["optim.lr", "finite", "(from --set)"]),
        ("data.train=" + "q" * 100_000, ["data.train", "(from --set)"]),
    ],
    ids=["int-120000-digits", "nested-3000-deep", "not-yaml", "lr-inf", "value-100000-chars"],
)
def test_a_hostile_set_value_exits_2_naming_the_key(tmp_path, override, expected):
    config = _write(tmp_path, "ok.yaml", _base_yaml())
    proc = run_cli(["config", config, "--set", override], tmp_path, timeout=HANG_TIMEOUT_S)
    _fails_cleanly(proc, *expected)


@pytest.mark.parametrize("command", ["train", "plan", "prepare", "bench", "config"])
def test_a_directory_as_config_is_named_a_directory(tmp_path, command):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(_base_yaml())
    proc = run_cli([command, run_dir], tmp_path, timeout=HANG_TIMEOUT_S)
    _fails_cleanly(proc, f"{run_dir} is a directory", "give a YAML config file", str(run_dir / "config.yaml"))
    assert "not found" not in proc.stderr, show(proc)


def test_a_missing_config_is_not_found(tmp_path):
    proc = run_cli(["plan", tmp_path / "nope.yaml"], tmp_path, timeout=HANG_TIMEOUT_S)
    _fails_cleanly(proc, "config file not found", "nope.yaml")
