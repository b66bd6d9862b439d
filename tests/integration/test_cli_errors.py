"""Bad input through the real CLI: exit code 2, a message naming the full key, and no work done.

Config errors must be caught before anything is written: the ``--output`` directory must not
exist afterwards. Data errors name ``file:line``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
from integration_helpers import root_conftest, run_cli, show

write_config = root_conftest().write_config


def _set(path: str, value: Any) -> Callable[[dict], None]:
    """A mutation of the config dict: set ``a.b.c`` to ``value``."""

    def mutate(cfg: dict) -> None:
        *parents, last = path.split(".")
        node = cfg
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value

    return mutate


def _from_scratch_with_init_typo(cfg: dict) -> None:
    cfg["model"] = {"init": {"architecture": "llama", "hidden_sizee": 32, "num_hidden_layers": 1}}


def _qlora_from_scratch(cfg: dict) -> None:
    cfg["model"] = {"init": {"architecture": "llama", "hidden_size": 32, "num_hidden_layers": 1}, "method": "qlora"}


def _line_of(text: str, needle: str) -> int:
    """1-based line of the first line of ``text`` that starts (after indentation) with ``needle``."""
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(needle):
            return n
    raise AssertionError(f"{needle!r} not in\n{text}")


# (id, mutation of finetune_config, --set overrides, substrings stderr must hold, YAML key whose line is named)
CASES = [
    ("unknown-key", _set("train.max_stepz", 5), [], ["train.max_stepz", "unknown key"], "max_stepz:"),
    ("wrong-type", _set("train.micro_batch_size", "eight"), [], ["train.micro_batch_size", "eight"], "micro_batch_size:"),
    ("negative-lr", None, ["optim.lr=-1"], ["optim.lr", "--set"], None),
    ("zero-max-length", _set("data.max_length", 0), [], ["data.max_length"], "max_length:"),
    ("missing-path", _set("model.path", "./nope"), [], ["model.path", "nope"], "path:"),
    ("qlora-from-scratch", _qlora_from_scratch, [], ["model.method: qlora needs a pretrained model.path"], None),
    ("init-typo", _from_scratch_with_init_typo, [], ["model.init.hidden_sizee", "hidden_size"], None),
]


@pytest.mark.parametrize(("mutate", "overrides", "expected", "line_key"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_config_exits_2_before_any_work(tmp_path, finetune_config, mutate, overrides, expected, line_key):
    cfg = copy.deepcopy(finetune_config)
    if mutate is not None:
        mutate(cfg)
    config = write_config(tmp_path / "bad.yaml", cfg)
    out = tmp_path / "out"
    args = ["train", config, *[a for o in overrides for a in ("--set", o)], "--output", out]

    proc = run_cli(args, tmp_path, timeout=120)

    assert proc.returncode == 2, show(proc)
    assert "Traceback" not in proc.stderr, show(proc)
    for s in expected:
        assert s in proc.stderr, f"{s!r} not in the message\n{show(proc)}"
    if line_key is not None:
        line = _line_of(config.read_text(), line_key)
        assert f"line {line}" in proc.stderr, f"line {line} not named\n{show(proc)}"
    assert not out.exists(), f"a bad config created the run directory {out}: {list(out.iterdir())}"


def test_unknown_key_names_yaml_file_and_line(tmp_path, finetune_config):
    """The exact layout of the brief: train.max_stepz on line 7 of a hand-written file."""
    config = tmp_path / "typo.yaml"
    config.write_text(
        "model:\n"
        f"  path: {finetune_config['model']['path']}\n"
        "data:\n"
        f"  train: {finetune_config['data']['train']}\n"
        "  max_length: 64\n"
        "train:\n"
        "  max_stepz: 5\n"
        "  device: cpu\n"
    )
    out = tmp_path / "out"
    proc = run_cli(["train", config, "--output", out], tmp_path, timeout=120)
    assert proc.returncode == 2, show(proc)
    assert "train.max_stepz" in proc.stderr and "line 7" in proc.stderr, show(proc)
    assert "typo.yaml" in proc.stderr, show(proc)
    assert "max_steps" in proc.stderr, show(proc)  # the suggestion
    assert not out.exists()


def test_malformed_jsonl_line_names_file_and_line(tmp_path, finetune_config, toy_data_dir):
    lines = (toy_data_dir / "pc_train.jsonl").read_text().splitlines()[:6]
    lines[2] = '{"prompt": "continue: alpha", "completion": '  # line 3: cut off mid-object
    bad = tmp_path / "pc_bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    cfg = copy.deepcopy(finetune_config)
    cfg["data"]["train"] = str(bad)
    config = write_config(tmp_path / "bad-data.yaml", cfg)
    out = tmp_path / "out"

    proc = run_cli(["train", config, "--output", out], tmp_path, timeout=120)

    assert proc.returncode == 2, show(proc)
    assert "Traceback" not in proc.stderr, show(proc)
    message = " ".join(proc.stderr.split())
    # the column on the line itself, where the row is cut off (it said "column 1", counting the line's newline)
    assert "pc_bad.jsonl:3: malformed JSON at column 45 (the line ends there: is the row cut off?)" in message, show(proc)
    assert not out.exists()  # data is read before the run directory is created


@pytest.mark.parametrize("command", ["train", "plan"])
def test_a_bad_memory_cap_in_the_environment_exits_2_naming_it(tmp_path, finetune_config, monkeypatch, command):
    """It was a ValueError traceback (exit 1) from train."""
    config = write_config(tmp_path / "run.yaml", finetune_config)
    out = tmp_path / "out"
    monkeypatch.setenv("TRAINFORGE_MEMORY_GIB", "abc")
    proc = run_cli([command, config, *(["--output", out] if command == "train" else [])], tmp_path, timeout=120)
    assert proc.returncode == 2, show(proc)
    message = " ".join(proc.stderr.split())
    assert "$TRAINFORGE_MEMORY_GIB='abc': expected a positive number of GiB, e.g. 12" in message, show(proc)
    assert "Traceback" not in proc.stderr and not out.exists(), show(proc)


def test_error_message_shows_values_verbatim(tmp_path, finetune_config):
    cfg = copy.deepcopy(finetune_config)
    cfg["model"]["path"] = "./models[/v2]"
    config = write_config(tmp_path / "bad.yaml", cfg)
    out = tmp_path / "out"
    proc = run_cli(["train", config, "--output", out], tmp_path, timeout=120)
    assert proc.returncode == 2, show(proc)
    assert "models[/v2]" in proc.stderr, show(proc)
    assert not out.exists()


# ---------------------------------------------------------------- input files that are not what they claim


def _train_on(tmp_path, finetune_config, train: str, eval_: str | None, steps: int | None = None):
    cfg = copy.deepcopy(finetune_config)
    cfg["data"]["train"] = train
    cfg["data"]["eval"] = eval_
    if steps is not None:
        cfg["train"]["max_steps"] = steps
    config = write_config(tmp_path / "data.yaml", cfg)
    out = tmp_path / "out"
    return run_cli(["train", config, "--output", out], tmp_path, timeout=180), out


def test_corrupt_parquet_exits_2_naming_the_file(tmp_path, finetune_config):
    bad = tmp_path / "broken.parquet"
    bad.write_bytes(b"PAR1" + b"\x13\x37" * 200)  # the magic at the start, garbage after it
    proc, out = _train_on(tmp_path, finetune_config, str(bad), None)
    assert proc.returncode == 2, show(proc)
    assert "Traceback" not in proc.stderr, show(proc)
    assert "broken.parquet is not a readable Parquet file" in proc.stderr, show(proc)
    assert not out.exists()


@pytest.mark.parametrize("on_bad_row", ["error", "skip"])
def test_binary_file_exits_2_saying_it_is_not_text(tmp_path, finetune_config, on_bad_row):
    import random

    blob = tmp_path / "blob.jsonl"
    blob.write_bytes(random.Random(0).randbytes(3000))
    cfg = copy.deepcopy(finetune_config)
    cfg["data"].update(train=str(blob), eval=None, on_bad_row=on_bad_row)
    config = write_config(tmp_path / "bin.yaml", cfg)
    out = tmp_path / "out"
    proc = run_cli(["train", config, "--output", out], tmp_path, timeout=120)
    assert proc.returncode == 2, show(proc)
    assert "Traceback" not in proc.stderr, show(proc)
    assert "blob.jsonl is not a text file (byte" in proc.stderr, show(proc)
    assert "no rows found" not in proc.stderr, show(proc)
    assert not out.exists()


def test_jsonl_with_a_utf8_bom_trains(tmp_path, finetune_config, toy_data_dir):
    for name in ("pc_train.jsonl", "pc_eval.jsonl"):
        (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + (toy_data_dir / name).read_bytes())
    proc, out = _train_on(tmp_path, finetune_config, str(tmp_path / "pc_train.jsonl"), str(tmp_path / "pc_eval.jsonl"), 2)
    assert proc.returncode == 0, show(proc)
    assert (out / "summary.json").exists()


def test_trains_from_a_dataset_saved_with_save_to_disk(tmp_path, finetune_config):
    datasets = pytest.importorskip("datasets")
    toy_documents = root_conftest().toy_documents
    datasets.Dataset.from_dict({"text": toy_documents(120, seed=1)}).save_to_disk(tmp_path / "train_ds")
    split = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": toy_documents(20, seed=2)})})
    split.save_to_disk(tmp_path / "eval_dd")
    proc, out = _train_on(tmp_path, finetune_config, str(tmp_path / "train_ds"), str(tmp_path / "eval_dd"), 2)
    assert proc.returncode == 0, show(proc)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["eval_loss"] is not None, summary


def test_a_model_directory_without_model_files_exits_2_saying_what_it_lacks(tmp_path, finetune_config):
    empty = tmp_path / "downloaded-model"  # e.g. a snapshot that was never fetched
    empty.mkdir()
    cfg = copy.deepcopy(finetune_config)
    cfg["model"]["path"] = str(empty)
    config = write_config(tmp_path / "bad-model.yaml", cfg)
    proc = run_cli(["train", config, "--output", tmp_path / "out"], tmp_path, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, show(proc)
    message = " ".join(proc.stderr.split())
    assert f"{empty} is not a Hugging Face model directory" in message and "lacks config.json" in message, show(proc)


def test_kto_on_rows_labelled_1_or_0_is_refused_before_anything_is_tokenized(tmp_path, finetune_config):
    """{prompt, completion, label: 1} rows are prompt/completion data, not KTO's: the run used to tokenize the whole
    dataset (and train a tokenizer on it) before saying so. The first row's format now decides before any of that."""
    rows = [{"prompt": f"q{i}?", "completion": f" a{i}", "label": i % 2} for i in range(40)]
    data = tmp_path / "kto.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = copy.deepcopy(finetune_config)
    cfg["data"].update({"train": str(data), "eval": None, "cache_dir": str(tmp_path / "cache")})
    cfg["train"]["objective"] = "kto"
    config = write_config(tmp_path / "kto.yaml", cfg)
    out = tmp_path / "out"

    proc = run_cli(["train", config, "--output", out], tmp_path, timeout=120)

    assert proc.returncode == 2, show(proc)
    assert "train.objective=kto needs unpaired rows" in proc.stderr and "not 1/0" in proc.stderr, show(proc)
    assert "Traceback" not in proc.stderr, show(proc)
    assert not (tmp_path / "cache" / "data").exists(), show(proc)  # nothing tokenized
    assert not out.exists()
