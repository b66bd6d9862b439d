"""Hostile and broken inputs through the real CLI: a model that can never fit is refused before it is
built (exit 4, in seconds, no traceback), `plan` says so with its own code (5), and a full disk while
the run writes its directory ends with exit 2 naming the path; a token cache that cannot be written, a FIFO
as a data file and an --output at a dangling symbolic link are exit 2 naming what they are."""

from __future__ import annotations

import json
import os
import time

import pytest
from integration_helpers import root_conftest, run_cli

from conftest import TINY_LLAMA_INIT

conf = root_conftest()

# ~137e9 parameters: terabytes of weights, gradients and AdamW state in fp32; on the meta device it costs nothing
HUGE_INIT = {
    "architecture": "llama",
    "hidden_size": 32768,
    "intermediate_size": 131072,
    "num_hidden_layers": 8,
    "num_attention_heads": 64,
    "max_position_embeddings": 128,
}


def config(tmp_path, init: dict, every_steps: int = 1, **train) -> object:
    docs = conf.toy_documents(200)
    data = conf.write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in docs])
    cfg = {
        "model": {"init": dict(init), "tokenizer_vocab_size": 300},
        "data": {"train": str(data), "eval": None, "max_length": 64},
        "train": {"max_steps": 2, "micro_batch_size": 2, "compile": False, "device": "cpu", "precision": "fp32", **train},
        "checkpoint": {"every_steps": every_steps},
        "log": {"every_steps": 1, "report": False},
    }
    return conf.write_config(tmp_path / "run.yaml", cfg)


def test_a_model_that_can_never_fit_is_refused_before_it_is_built(tmp_path):
    cfg = config(tmp_path, HUGE_INIT)
    started = time.monotonic()
    r = run_cli(["train", cfg, "--output", tmp_path / "run"], tmp_path, timeout=120)
    took = time.monotonic() - started
    assert r.returncode == 4, r.stderr
    assert "Traceback" not in r.stderr
    err = " ".join(r.stderr.split())
    assert "this run cannot fit: estimated memory" in err and "refused before loading the model" in err
    assert "GiB of system memory available to this process" in err
    assert "make model.init smaller" in err and "trainforge plan CONFIG" in err
    assert "model:" not in r.stdout  # build_run_model never ran: nothing of the model was allocated
    assert took < 60, took  # terabytes would take far longer to allocate, or be killed
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

    # plan says the same with its own code, 5 (errors.EXIT_PLAN_ERROR)
    r = run_cli(["plan", cfg, "--json"], tmp_path, timeout=300)
    assert r.returncode == 5, r.stderr
    plan = json.loads(r.stdout)
    assert not plan["memory"]["fits"]
    assert any(f["level"] == "error" and "exceeds" in f["message"] for f in plan["findings"])


def test_a_full_disk_at_the_first_checkpoint_exits_2_naming_the_path(tmp_path):
    """The disk fills up while step 2's checkpoint is written: the failed save is reported, then recording
    it in events.jsonl fails too: exit 2, one paragraph naming the file and what to do, no traceback."""
    cfg = config(tmp_path, TINY_LLAMA_INIT, every_steps=2, max_steps=4)
    run = tmp_path / "run"
    r = run_cli(["train", cfg, "--output", run], tmp_path, faults={"disk_full_from_save": [2, str(run)]})
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    err = " ".join(r.stderr.split())
    assert "saving checkpoint step-00000002 failed" in " ".join(r.stdout.split())  # said before recording it failed
    assert f"cannot write {run / 'events.jsonl'}: No space left on device" in err
    assert "is full" in err and "Free space on that disk" in err and "holds no complete checkpoint" in err


@pytest.mark.parametrize("cache", ["a-file", "under-a-file", "read-only"])
def test_a_token_cache_that_cannot_be_written_exits_2_naming_it(tmp_path, monkeypatch, cache):
    blocker = tmp_path / "cache-file"
    blocker.write_text("a user's file\n")
    root = {"a-file": blocker, "under-a-file": blocker / "sub", "read-only": tmp_path / "ro"}[cache]
    if cache == "read-only":
        root.mkdir()
        root.chmod(0o555)
        if os.access(root, os.W_OK):  # root writes anywhere: the directory is writable to it after all
            pytest.skip("this user writes into read-only directories")
    monkeypatch.setenv("TRAINFORGE_CACHE", str(root))
    cfg = config(tmp_path, TINY_LLAMA_INIT)
    r = run_cli(["train", cfg, "--output", tmp_path / "run"], tmp_path, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    err = " ".join(r.stderr.split())
    assert f"TRAINFORGE_CACHE={root} is not a writable directory" in err, err
    assert "set TRAINFORGE_CACHE to a directory you can write" in err
    assert blocker.read_text() == "a user's file\n"  # nothing of the user's lost
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where", ["data.train", "data.eval", "a-member"])
def test_a_fifo_as_a_data_file_is_refused_not_waited_on(tmp_path, where):
    """Opening a FIFO waits for a writer forever (and one SIGTERM did not end that wait): it is refused before
    anything opens it, as a FIFO config is. The timeout turns a regression into a failure, not a hang."""
    cfg = config(tmp_path, TINY_LLAMA_INIT)
    fifo = tmp_path / "data" / "fifo.jsonl"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    if where == "a-member":
        conf.write_jsonl(tmp_path / "data" / "rows.jsonl", [{"text": d} for d in conf.toy_documents(50)])
        setting, named = f"data.train={fifo.parent}", str(fifo)
    else:
        setting, named = f"{where}={fifo}", f"{where}: {str(fifo)!r}"
    r = run_cli(["train", cfg, "--set", setting, "--output", tmp_path / "run"], tmp_path, timeout=90)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    err = " ".join(r.stderr.split())
    assert f"{named} is not a regular file (a device, pipe or socket); give a data file" in err, err
    assert not (tmp_path / "run").exists()


def test_an_output_at_a_dangling_symlink_is_named_as_one(tmp_path, tiny_model_dir):
    cfg = config(tmp_path, TINY_LLAMA_INIT)
    link = tmp_path / "out-link"
    link.symlink_to(tmp_path / "gone" / "run")
    r = run_cli(["train", cfg, "--output", link], tmp_path, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    err = " ".join(r.stderr.split())
    assert f"--output {link} is a symbolic link to a missing path ({tmp_path / 'gone' / 'run'})" in err, err
    assert "File exists" not in err
    r = run_cli(["export", tiny_model_dir, "--out", link], tmp_path, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert f"--out {link} is a symbolic link to a missing path" in " ".join(r.stderr.split())
    assert link.is_symlink() and not (tmp_path / "gone").exists()  # the link left as it was
