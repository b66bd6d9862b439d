"""`trainforge plan` through the real CLI: the JSON it prints, the profiles, errors, --measure, and the
auto settings of a real training run fitted to a capped memory."""

from __future__ import annotations

import json
import platform
import os

from integration_helpers import root_conftest, run_cli

from conftest import TINY_LLAMA_INIT

conf = root_conftest()


def tiny_config(tmp_path, **train) -> object:
    # long documents: split into full rows of one document each, the worst case the plan predicts
    docs = conf.toy_documents(6000)
    data = conf.write_jsonl(tmp_path / "docs.jsonl", [{"text": " ".join(docs[i : i + 60])} for i in range(0, len(docs), 60)])
    cfg = {
        "model": {"init": dict(TINY_LLAMA_INIT), "tokenizer_vocab_size": 300},
        "data": {"train": str(data), "eval": None, "max_length": 64},
        "train": {"max_steps": 6, "compile": False, "device": "cpu", "precision": "fp32", **train},
        "log": {"every_steps": 2, "report": False},
    }
    return conf.write_config(tmp_path / "tiny.yaml", cfg)


def test_plan_json_for_a_gpu_profile(tmp_path):
    cfg = tiny_config(tmp_path)
    r = run_cli(["plan", cfg, "--hardware", "H100", "--json", "--set", "train.precision=auto"], tmp_path)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["hardware"]["name"] == "h100" and "datasheet" in plan["hardware"]["source"]
    mem = plan["memory"]
    assert set(mem["parts"]) >= {"weights", "grads", "optimizer", "activations", "temporaries"}
    assert mem["peak_tensor_bytes"] == sum(mem["parts"].values()) and mem["fits"]
    assert mem["peak_process_bytes"] > mem["peak_tensor_bytes"]  # the CUDA context and allocator
    assert plan["time"]["tokens_per_s"] > 0 and plan["time"]["run_s"] == plan["time"]["steps"] * plan["time"]["step_s"]
    chosen = {d["setting"]: d["choice"] for d in plan["decisions"]}
    assert chosen["precision"] == "bf16" and chosen["micro_batch_size"] == "8"
    assert any("not prepared" in f["message"] for f in plan["findings"])


def test_plan_names_profiles_and_refuses_unknown_ones(tmp_path):
    r = run_cli(["plan", "--hardware", "list"], tmp_path)
    assert r.returncode == 0 and "rtx4070" in r.stdout and "a100-80gb" in r.stdout
    r = run_cli(["plan", tiny_config(tmp_path), "--hardware", "h1000"], tmp_path)
    assert r.returncode == 2 and "unknown profile" in r.stderr and "h100" in r.stderr


def test_plan_findings_with_fixes(tmp_path):
    cfg = tiny_config(tmp_path, max_steps=5000, micro_batch_size=1, grad_accum=4)
    r = run_cli(["plan", cfg, "--hardware", "t4", "--json", "--set", "log.every_steps=1", "--set", "train.precision=bf16",
                 "--set", "data.max_length=512"], tmp_path)
    plan = json.loads(r.stdout)
    messages = " | ".join(f["message"] + " -> " + f["fix"] for f in plan["findings"])
    assert "no bf16" in messages and "positions" in messages and "log.every_steps" in messages
    assert "micro-batch 1" in messages
    assert r.returncode == 5  # errors were found: plan's own documented code (errors.EXIT_PLAN_ERROR)


def capped(tmp_path, cfg, room_gib: float) -> str:
    """A memory cap that leaves ``room_gib`` for tensors beyond this machine's fixed cost (as plan sees it)."""
    r = run_cli(["plan", cfg, "--json", "--set", "train.micro_batch_size=1"], tmp_path)
    fixed = json.loads(r.stdout)["hardware"]["fixed_bytes"] / 2**30
    return f"{fixed + 0.15 + room_gib:.3f}"  # + the adapters' share and room for rows


def test_plan_measure_with_auto_micro_batch_under_a_memory_cap(tmp_path, monkeypatch):
    """micro_batch_size: auto picks the largest batch predicted to fit a capped machine, and the real
    steps at that size stay inside it; predicted tensors are within 15% of the measured ones."""
    # plan reads its fixed cost from its own resident memory, which a process forked from the tests' warm one does not
    # hold as a user's fresh process does (forked, the steps peaked 0.08 GB past the cap; fresh, under it): so this
    # test runs the CLI as users do
    monkeypatch.setenv("TRAINFORGE_TESTS_COLD", "1")
    # near the cap the default heap's figure passes 60% of memory, so the compact heap is priced and taken
    # (hardware/heap.py), and it leaves room for ~80 rows; plan --measure runs them at every setting plan decided
    cfg = tiny_config(tmp_path, micro_batch_size="auto", activation_checkpointing=False)
    text = cfg.read_text().replace("max_length: 64", "max_length: 512")  # rows that cost memory
    cfg.write_text(text.replace("max_position_embeddings: 128", "max_position_embeddings: 512"))
    # room for ~30 rows of 512 positions (the real steps cost in proportion to it; the checks hold alike at 90)
    os.environ["TRAINFORGE_MEMORY_GIB"] = capped(tmp_path, cfg, 0.05)
    try:
        r = run_cli(["plan", cfg, "--measure", "--measure-steps", "1", "--json"], tmp_path, timeout=400)
    finally:
        del os.environ["TRAINFORGE_MEMORY_GIB"]
    plan = json.loads(r.stdout)
    assert r.returncode == 0, (r.stderr, plan["findings"])
    chosen = {d["setting"]: d for d in plan["decisions"]}
    mbs = int(chosen["micro_batch_size"]["choice"])
    assert 1 < mbs < 256 and "largest that fits" in chosen["micro_batch_size"]["why"]
    measured, capacity = plan["measured"], plan["memory"]["capacity_bytes"]
    memory = plan["memory"]  # the budget plan filled: 90% of the cap less its fixed cost, at its heap's overhead
    budget = (0.9 * capacity - memory["fixed_bytes"]) / (1 + memory["allocator_overhead"])
    assert measured["live_tensor_peak_bytes"] <= 1.15 * budget
    if platform.libc_ver()[0] == "glibc":  # past 60% of the cap with the default heap: the compact one, priced
        assert {d["setting"]: d["choice"] for d in plan["decisions"]}["compact_heap"] == "true"
    # the process's resident memory beyond its tensors varies by tens of MB from one process to the next (the
    # fixed cost is read in another one), and the batch is the largest predicted to fit, so the peak lands at the
    # cap within that noise: seen 3 MB under and 17 MB over on ~0.97 GB, at this commit and before it
    room = capacity - plan["hardware"]["fixed_bytes"]
    assert measured["process_peak_bytes"] <= capacity + 0.15 * room
    assert abs(plan["memory"]["peak_tensor_bytes"] / measured["live_tensor_peak_bytes"] - 1) < 0.15
    # and against the allocator's own count of the same step (not the tracer's): storages alive + c10 allocations
    assert "allocator" in measured["allocated_step_measure"]
    assert abs(plan["memory"]["peak_tensor_bytes"] / measured["allocated_step_peak_bytes"] - 1) < 0.15


def test_train_resolves_auto_settings_and_says_why(tmp_path):
    cfg = tiny_config(tmp_path, micro_batch_size="auto", max_steps=2)
    cap = capped(tmp_path, cfg, 0.1)
    os.environ["TRAINFORGE_MEMORY_GIB"] = cap
    try:
        r = run_cli(["train", cfg, "--output", tmp_path / "run"], tmp_path)
    finally:
        del os.environ["TRAINFORGE_MEMORY_GIB"]
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert "largest that fits" in summary["micro_batch_size_reason"]
    assert summary["activation_checkpointing"] is False and summary["activation_checkpointing_reason"].startswith("off")
    assert summary["predicted_peak_memory_bytes"] <= 0.9 * float(cap) * 2**30
    assert "micro_batch_size auto ->" in r.stdout


def test_a_signal_stops_plan_measure_and_leaves_nothing_behind(tmp_path):
    """SIGTERM during `plan --measure`: exit 75 at once, the measuring process killed, its run directory removed.
    Before, the measuring process went on alone (its temporary run directory kept) and plan died of the signal."""
    import signal
    import subprocess
    import time

    from integration_helpers import cli_command

    cfg = tiny_config(tmp_path)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    argv, env = cli_command(["plan", cfg, "--measure", "--measure-steps", "100000"])
    proc = subprocess.Popen(argv, cwd=tmp_path, env={**env, "TMPDIR": str(tmp)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    while not list(tmp.glob("trainforge-plan-*/run/metrics.jsonl")) and time.monotonic() < deadline:
        time.sleep(0.2)  # the measuring run has started
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 75 and "plan --measure stopped by SIGTERM: nothing measured" in err, (out, err)
    assert not list(tmp.glob("trainforge-plan-*")), (out, err)
    left = subprocess.run(["pgrep", "-g", str(proc.pid), "-f", "spawn_main"], capture_output=True, text=True).stdout
    assert not left, f"the measuring process runs on: {left}"


def test_a_run_that_fits_no_way_is_not_told_to_set_what_it_already_has(tmp_path):
    """An 8B full fine-tune on an 8 GB card at micro-batch 1 with checkpointing on: the fix said 'set
    train.micro_batch_size: auto (and keep train.activation_checkpointing: auto)', which changes nothing."""
    model = tmp_path / "l8b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 8192, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    docs = conf.write_jsonl(tmp_path / "d.jsonl", [{"text": "a b c"}] * 4)
    cfg = conf.write_config(tmp_path / "c.yaml", {
        "model": {"path": str(model), "method": "full", "tokenizer": None},
        "data": {"train": str(docs), "max_length": 2048},
        "train": {"max_steps": 100, "micro_batch_size": 1, "grad_accum": 8, "activation_checkpointing": True}})
    r = run_cli(["plan", cfg, "--hardware", "rtx4060", "--json"], tmp_path)
    fixes = [f["fix"] for f in json.loads(r.stdout)["findings"] if "exceeds" in f["message"]]
    assert r.returncode == 5 and fixes and "set train.micro_batch_size: auto" not in fixes[0], r.stdout[-2000:]


def test_a_warmup_longer_than_the_run_is_warned_by_plan_and_train(tmp_path):
    """optim.warmup_steps 10 over 3 steps: the learning rate never reached optim.lr, and neither command said so."""
    cfg = tiny_config(tmp_path, max_steps=3)
    warmup = ["--set", "optim.warmup_steps=10", "--set", "optim.lr=0.001"]
    r = run_cli(["plan", cfg, "--json", *warmup], tmp_path)
    finding = [f for f in json.loads(r.stdout)["findings"] if "warmup_steps" in f["message"]]
    assert [f["level"] for f in finding] == ["warn"], r.stdout
    assert "never reaches optim.lr 0.001 (its last step trains at 0.0003)" in finding[0]["message"]
    assert "set optim.warmup_steps to 3 or fewer" in finding[0]["fix"]

    r = run_cli(["train", cfg, "--output", tmp_path / "run", *warmup], tmp_path)
    assert r.returncode == 0, r.stderr
    said = " ".join((r.stdout + r.stderr).split())
    assert "optim.warmup_steps 10 is longer than the run's 3 steps" in said and "set optim.warmup_steps to 3 or fewer" in said

    r = run_cli(["plan", cfg, "--json", "--set", "optim.warmup_steps=3"], tmp_path)  # the last step reaches it
    assert not [f for f in json.loads(r.stdout)["findings"] if "warmup_steps" in f["message"]]
