"""End to end: ``trainforge train`` with ``train.objective: grpo`` on the built-in arithmetic prompts. The run writes
reward, each reward's mean, completion length, KL, clip fraction and generation seconds to metrics.jsonl, and
summary.json names the objective; prompt rows missing the field a reward reads end the run with exit 2."""

from __future__ import annotations

import json

import torch
import yaml
from integration_helpers import run_cli, show

KEYS = {"reward", "reward_final_number", "completion_length", "truncated", "kl", "clip_ratio", "gen_s"}


def grpo_config(train: str = "builtin:arithmetic") -> dict:
    return {
        "model": {"init": {"architecture": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                           "num_attention_heads": 2, "max_position_embeddings": 32}, "tokenizer": "char"},
        "data": {"train": train, "eval": None, "max_length": 8, "max_documents": 64},
        "train": {"objective": "grpo", "max_steps": 4, "micro_batch_size": 8, "grad_accum": 2, "eval_every": None},
        "rl": {"num_generations": 4, "max_completion_length": 4, "beta": 0.05, "num_iterations": 2, "loss": "dapo",
               "epsilon_high": 0.28, "rewards": [{"name": "final_number"}]},
        "log": {"every_steps": 2, "tensorboard": False, "report": False},
        "checkpoint": {"every_minutes": None},
    }


def test_grpo_run_logs_rewards_length_kl_and_writes_its_summary(tmp_path):
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(grpo_config()))
    proc = run_cli(["train", "grpo.yaml", "--output", tmp_path / "run"], tmp_path)
    assert proc.returncode == 0, show(proc)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [2, 4]
    for r in train:
        assert KEYS <= set(r), sorted(r)
        assert 0.0 <= r["reward"] <= 1.0 and 1.0 <= r["completion_length"] <= 4.0
        assert r["kl"] >= 0.0 and 0.0 <= r["clip_ratio"] <= 1.0 and r["gen_s"] > 0.0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["objective"] == "grpo" and summary["steps"] == 4
    assert "reward" in proc.stdout and "gen " in proc.stdout  # the console line carries them too
    # doctor reads the run: its written config.yaml (every rl default spelt out) validates
    proc = run_cli(["doctor", tmp_path / "run"], tmp_path)
    assert proc.returncode == 0 and "config.yaml: valid" in proc.stdout, show(proc)


def test_prompt_rows_without_the_field_a_reward_reads_are_exit_2_naming_the_row(tmp_path):
    # (a completion too: model.tokenizer char builds its vocabulary from prompt/completion rows)
    rows = [{"prompt": "1+1=", "completion": "2", "answer": "2"}, {"prompt": "2+2=", "completion": "4"}]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(grpo_config(str(tmp_path / "prompts.jsonl"))))
    proc = run_cli(["train", "grpo.yaml", "--output", tmp_path / "run"], tmp_path)
    assert proc.returncode == 2, show(proc)
    assert "prompts.jsonl:2" in proc.stderr + proc.stdout and "answer" in proc.stderr + proc.stdout, show(proc)


def test_a_grpo_run_stopped_by_sigterm_resumes_to_the_same_weights(tmp_path):
    """SIGTERM in step 3 finishes that step and saves it; the same command goes on from there. With num_iterations 2
    the completions sampled for step 3 are trained on again in step 4, so the checkpoint must carry them, and step 5
    samples from the restored prompt position (whose keys decide the draws): the resumed run ends with the
    uninterrupted run's weights and metrics."""
    from safetensors.torch import load_file

    from trainforge.metrics.tracker import MEASURED_FIELDS

    cfg = grpo_config()
    cfg["train"]["max_steps"], cfg["log"]["every_steps"] = 6, 1
    cfg["checkpoint"] = {"every_minutes": None, "every_steps": 100}
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(cfg))
    cli = lambda run, faults=None: run_cli(["train", "grpo.yaml", "--output", tmp_path / run], tmp_path, faults=faults)
    proc = cli("reference")
    assert proc.returncode == 0, show(proc)
    proc = cli("run", {"signal_in_step": [3, "SIGTERM"]})
    assert proc.returncode == 75 and "checkpoint step-00000003 saved" in proc.stderr, show(proc)
    proc = cli("run")
    assert proc.returncode == 0 and "step-00000003" in proc.stdout, show(proc)

    expected, got = (load_file(tmp_path / r / "final" / "model.safetensors") for r in ("reference", "run"))
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), f"weight {name} differs"
    timing = set(MEASURED_FIELDS) | {"gen_s"}
    records = lambda r: [{k: v for k, v in json.loads(line).items() if k not in timing}
                         for line in (tmp_path / r / "metrics.jsonl").read_text().splitlines()]
    assert records("run") == records("reference")
