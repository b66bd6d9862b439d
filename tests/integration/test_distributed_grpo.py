"""GRPO under two processes (torchrun, gloo, CPU): each process samples the completions of its own prompts, and the
run equals one process with the same global batch: the same metrics (rewards, lengths, KL, losses) and the same
final weights, within float tolerance. (FSDP is refused for grpo at validation: tests/unit/test_grpo_config.py.)"""

from __future__ import annotations

import yaml
from integration_helpers import run_cli, show
from test_cli_grpo import grpo_config

from test_distributed import assert_close_records, assert_close_weights, final_weights, records


def test_grpo_on_two_processes_equals_one_process_with_the_same_global_batch(tmp_path):
    """Two prompts of 4 completions a step: one process samples both in one micro-batch of 8, two processes one
    prompt each in a micro-batch of 4. With num_iterations 2 and beta > 0 the recorded log-probabilities of the
    rollout and the reference come in too, and step 3 samples from weights that steps 1-2 moved."""
    def config(micro: int) -> dict:
        cfg = grpo_config()
        cfg["train"].update(max_steps=3, micro_batch_size=micro, grad_accum=1, precision="fp32", device="cpu")
        # rewards that differ within a group (the untrained model's answers are all wrong): advantages of their size,
        # not rounding noise, which Adam would blow up to a full step on either side
        # scale_rewards batch: the std of the whole step's rewards, gathered from both processes
        cfg["rl"].update(temperature=1.5, rewards=[{"name": "final_number"}, {"name": "length", "target": 2}],
                         scale_rewards="batch")
        cfg["optim"] = {"lr": 1e-3, "warmup_steps": 0}
        cfg["log"]["every_steps"] = 1
        return cfg

    (tmp_path / "one.yaml").write_text(yaml.safe_dump(config(8)))
    (tmp_path / "two.yaml").write_text(yaml.safe_dump(config(4)))
    one = run_cli(["train", "one.yaml", "--output", tmp_path / "one"], tmp_path)
    assert one.returncode == 0, show(one)
    two = run_cli(["train", "two.yaml", "--output", tmp_path / "two"], tmp_path, nproc=2)
    assert two.returncode == 0, show(two)
    got, expected = (without_seconds(records(tmp_path / run)) for run in ("two", "one"))
    assert_close_records(got, expected)
    assert all(r["grad_norm"] > 1e-3 for r in expected), expected  # every step learned from real advantages
    assert_close_weights(final_weights(tmp_path / "two"), final_weights(tmp_path / "one"))


def without_seconds(rs: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "gen_s"} for r in rs]  # generation seconds: a timing
