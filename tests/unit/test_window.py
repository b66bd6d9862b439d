"""The log window across a resume: saved mid-way and loaded into a fresh window, it logs what an
uninterrupted window logs (loss, steps, tokens, rows, data wait, and the span its rates divide by)."""

from __future__ import annotations

import types

import pytest
import torch

import trainforge.metrics.window as window_module
from trainforge.metrics.window import LogWindow

CPU = torch.device("cpu")
# per step: (loss, skipped, tokens, example indices, data wait in seconds)
STEPS = [(2.0, False, 100, [0, 1], 0.25), (float("nan"), True, 90, [2, 3], 0.5), (1.5, False, 120, [4, 5, 6], 0.125),
         (1.0, False, 80, [7], 0.0625)]


@pytest.fixture
def clock(monkeypatch) -> types.SimpleNamespace:
    """perf_counter of the window module, set by the test."""
    fake = types.SimpleNamespace(now=0.0)
    fake.perf_counter = lambda: fake.now
    monkeypatch.setattr(window_module, "time", fake)
    return fake


def add(w: LogWindow, step: tuple) -> None:
    """As the trainer's loop adds a step: rows are the step's example indices."""
    loss, skipped, tokens, indices, wait = step
    w.add(torch.tensor(loss), torch.tensor(skipped), tokens, indices, len(indices), wait)


def logged(w: LogWindow, now: float) -> dict:
    """What the trainer's log step reads of a window (its rates divide by ``now - started``)."""
    span = now - w.started
    return {"loss": w.mean_loss(), "steps": w.steps, "tokens": w.tokens, "rows": w.rows, "indices": w.indices,
            "data_wait_s": w.data_wait_s, "span": span, "tokens_per_s": w.tokens / span, "samples_per_s": w.rows / span,
            "data_wait_pct": 100.0 * w.data_wait_s / span}


def test_a_window_resumed_mid_way_logs_what_an_uninterrupted_one_logs(clock):
    clock.now = 100.0
    whole = LogWindow.on(CPU)
    whole.started = 100.0  # the loop's start
    for i, step in enumerate(STEPS):
        clock.now = 101.0 + i
        add(whole, step)
    expected = logged(whole, 104.0)
    assert expected["rows"] == 8 and expected["data_wait_s"] == 0.9375 and expected["span"] == 4.0

    clock.now = 100.0
    before = LogWindow.on(CPU)
    before.started = 100.0
    for i, step in enumerate(STEPS[:2]):
        clock.now = 101.0 + i
        add(before, step)
    state = before.state_dict()  # the checkpoint after step 2, at 102.0

    clock.now = 5000.0  # another process: another clock, and setup before the loop starts
    after = LogWindow.on(CPU)
    after.load_state_dict(state)
    after.started = 5010.0  # the resumed loop's start
    for i, step in enumerate(STEPS[2:]):
        clock.now = 5011.0 + i
        add(after, step)
    assert logged(after, 5012.0) == expected

    after.reset()  # the next window counts from the log step only
    clock.now = 5013.0
    add(after, STEPS[0])
    assert logged(after, 5013.0)["span"] == 1.0 and after.rows == 2 and after.data_wait_s == 0.25


def test_a_checkpoint_window_without_rows_wait_or_span_still_loads(clock):
    """Checkpoints written before rows, data wait and the span were kept."""
    clock.now = 10.0
    w = LogWindow.on(CPU)
    w.load_state_dict({"loss_sum": torch.tensor(3.0), "finite_steps": torch.tensor(2.0), "steps": 2, "tokens": 200,
                       "indices": [[0], [1]]})
    w.started = 20.0
    add(w, STEPS[0])
    got = logged(w, 21.0)
    assert (got["loss"], got["steps"], got["tokens"], got["indices"]) == (5.0 / 3, 3, 300, [[0], [1], [0, 1]])
    assert (got["rows"], got["data_wait_s"], got["span"]) == (2, 0.25, 1.0)  # this run's only
