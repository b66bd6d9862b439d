"""`trainforge prepare` builds the token cache; the next `train` on the same inputs reuses it and says so."""

from __future__ import annotations

import json
import signal
import time

from integration_helpers import root_conftest, run_cli, show, start_cli

write_config = root_conftest().write_config


def test_prepare_then_train_reuses_the_cache(tmp_path, finetune_config):
    finetune_config["data"]["cache_dir"] = str(tmp_path / "cache")
    finetune_config["train"]["max_steps"] = 2
    config = write_config(tmp_path / "run.yaml", finetune_config)
    prep = run_cli(["prepare", config], tmp_path, timeout=120)
    assert prep.returncode == 0, show(prep)
    assert "tokenizing into" in prep.stdout and "packed rows" in prep.stdout, show(prep)
    assert len(list((tmp_path / "cache" / "data").iterdir())) == 1
    proc = run_cli(["train", config, "--output", tmp_path / "run"], tmp_path, timeout=180)
    assert proc.returncode == 0, show(proc)
    assert "cache hit" in proc.stdout, show(proc)
    data = json.loads((tmp_path / "run" / "summary.json").read_text())["data"]
    assert data["cache_hit"] is True and data["format"] == "prompt_completion"
    assert 0.5 < data["row_efficiency"] <= 1.0 and data["rows"] > 0
    for key in ("truncated", "dropped_too_long", "dropped_masked", "bad_rows"):
        assert key in data


def test_prepare_skip_bad_rows_reports_them(tmp_path, finetune_config, toy_data_dir):
    lines = (toy_data_dir / "pc_train.jsonl").read_text().splitlines()
    lines.insert(2, "{broken")
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    finetune_config["data"].update(train=str(tmp_path / "bad.jsonl"), on_bad_row="skip")
    config = write_config(tmp_path / "run.yaml", finetune_config)
    proc = run_cli(["prepare", config], tmp_path, timeout=120)
    assert proc.returncode == 0, show(proc)
    assert "1 bad rows skipped" in proc.stdout and "bad.jsonl:3" in proc.stdout, show(proc)
    finetune_config["data"]["on_bad_row"] = "error"
    config = write_config(tmp_path / "run.yaml", finetune_config)
    proc = run_cli(["prepare", config], tmp_path, timeout=120)
    assert proc.returncode == 2 and "bad.jsonl:3: malformed JSON" in proc.stderr, show(proc)


def test_a_killed_prepare_goes_on_from_its_finished_shards(tmp_path, finetune_config):
    """SIGKILL once the manifest lists a finished shard; the same command reuses the shards and ends with the bytes of
    an uninterrupted prepare."""
    conftest = root_conftest()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    shards = 8
    for s in range(shards):
        conftest.write_jsonl(corpus / f"part-{s:02d}.jsonl", conftest.toy_prompt_completions(500, seed=s))
    finetune_config["data"].update(train=str(corpus), eval=0.05, num_workers=2, cache_dir=str(tmp_path / "cache"))
    config = write_config(tmp_path / "run.yaml", finetune_config)
    proc = start_cli(["prepare", config], tmp_path)
    deadline = time.monotonic() + 120
    listed = 0
    while listed == 0 and proc.poll() is None and time.monotonic() < deadline:
        for manifest in (tmp_path / "cache" / "data").glob(".*.units/manifest.json"):
            listed = len(json.loads(manifest.read_text())["units"])  # written atomically: never half a file
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    out, err = proc.communicate(timeout=30)
    assert listed >= 1 and proc.returncode == -signal.SIGKILL, f"{proc.returncode}\n{out}\n{err}"
    entries = [p for p in (tmp_path / "cache" / "data").iterdir() if not p.name.startswith(".")]
    assert entries == [], "the entry was published before the kill; the test needs more or larger shards"
    again = run_cli(["prepare", config], tmp_path, timeout=180)
    assert again.returncode == 0, show(again)
    reused = int(again.stdout.split("reusing ")[1].split(" of ")[0])
    assert listed <= reused < shards and f"of {shards} shards" in again.stdout, show(again)
    assert again.stdout.count(" done: ") == shards - reused and "tokens/s, ETA" in again.stdout, show(again)
    # the uninterrupted prepare, in this process (a third CLI start would double the test's time)
    from trainforge.config.run import load_config
    from trainforge.data.plan import prepare_only

    finetune_config["data"]["cache_dir"] = str(tmp_path / "fresh")
    prepare_only(load_config(write_config(tmp_path / "fresh.yaml", finetune_config), []))
    (entry,) = [p for p in (tmp_path / "cache" / "data").iterdir() if not p.name.startswith(".")]
    (fresh_entry,) = (tmp_path / "fresh" / "data").iterdir()
    assert entry.name == fresh_entry.name
    files = sorted(p.relative_to(entry) for p in entry.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(fresh_entry) for p in fresh_entry.rglob("*") if p.is_file())
    assert all((entry / f).read_bytes() == (fresh_entry / f).read_bytes() for f in files)
    assert not list((tmp_path / "cache" / "data").glob(".*.units"))  # published: the shards are removed
