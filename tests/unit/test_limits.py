"""The run's limits and the automatic eval size: exact figures from fixed inputs."""

from __future__ import annotations

import pytest

from trainforge.engine.evaluate import auto_eval_batches, planned_evals
from trainforge.engine.state import Counters
from trainforge.metrics.limits import describe_limits, ledger_from_files, rank_limits


def test_planned_evals_counts_before_between_and_after():
    assert planned_evals(26, None) == 2
    assert planned_evals(600, 200) == 4  # 0, 200, 400, 600
    assert planned_evals(10, 1) == 11


@pytest.mark.parametrize(
    "method, ckpt, expected",
    [("full", False, 1), ("lora", False, 1), ("full", True, 2)],
)
def test_auto_eval_batches_keeps_evaluation_within_its_share_of_the_training_compute(method, ckpt, expected):
    # 26 steps of 8 rows, two evals of 8-row batches: 5% of 208 rows x (3 or 4 forwards) / 2 evals
    assert auto_eval_batches(43, 8, 26 * 8, 2, method, ckpt) == expected


def test_auto_eval_batches_grows_with_the_run_and_stops_at_what_there_is():
    assert auto_eval_batches(1000, 8, 600 * 8, 4) == 22  # 0.05 x 4800 x 3 / 4 = 180 rows
    assert auto_eval_batches(10, 8, 600 * 8, 4) == 10
    assert auto_eval_batches(10, 8, 1, 4) == 1  # never none


def test_limits_rank_what_is_not_training_and_drop_the_small():
    parts = {"startup_s": 6.0, "train_s": 40.0, "eval_s": 30.0, "checkpoint_s": 0.2, "data_wait_s": 2.0, "end_s": 1.0}
    limits = rank_limits(parts, 80.0)
    assert [x["cause"] for x in limits] == ["evaluation", "start-up", "data wait", "the end"]
    assert limits[0]["share"] == 0.375 and limits[0]["seconds"] == 30.0
    text = describe_limits(limits, 80.0, 40.0)
    assert text.startswith("what limited this run (80.0s wall, 50% of it training steps): evaluation 38% (30.0s)")
    assert "nothing above" in describe_limits([], 10.0, 9.0)


def test_ledger_of_a_killed_run_from_its_files():
    train = [
        {"step": 2, "loss": 1.0, "elapsed_s": 2.0, "data_wait_pct": 10.0},
        {"step": 4, "loss": 1.0, "elapsed_s": 4.0, "data_wait_pct": 50.0},
    ]
    events = [
        {"event": "start", "step": 0, "time": 100.0, "startup_s": 5.0},
        {"event": "eval", "step": 0, "time": 101.0, "seconds": 1.0},
        {"event": "checkpoint", "step": 2, "time": 104.0, "pause_s": 0.5},
    ]
    ledger = ledger_from_files(None, train, events, last_seen=110.0)
    assert ledger == pytest.approx(
        {"startup_s": 5.0, "train_s": 2.8, "data_wait_s": 1.2, "eval_s": 1.0, "checkpoint_s": 0.5, "wall_s": 15.0}
    )
    assert ledger_from_files({"time": {"wall_s": 3.0, "startup": {}}}, train, events, None) == {"wall_s": 3.0}


def test_counters_of_a_checkpoint_written_before_eval_time_was_kept_still_load():
    old = Counters(step=5, tokens_seen=10).state_dict()
    del old["eval_s"], old["evals"]
    c = Counters()
    c.load_state_dict(old)
    assert (c.step, c.tokens_seen, c.eval_s, c.evals) == (5, 10, 0.0, 0)
