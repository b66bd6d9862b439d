"""benchmarks/compare_grpo.py's step statistics: the warm-up step is left out of the steady-state rates, the
headline is the median step (one slow step, as a burst of other work on a shared machine makes, moves it
least), and generation tokens/s pairs each step's tokens with its own seconds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def compare_grpo():
    sys.path.insert(0, str(BENCHMARKS))  # compare_grpo imports compare_hf, its sibling
    try:
        import compare_grpo

        yield compare_grpo
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_rates_leave_out_the_warm_up_step_and_take_the_median(compare_grpo):
    # steps of 10 s (warm-up), 1, 1, 4 and 1 s; 64 completions each
    ends = [10.0, 11.0, 12.0, 16.0, 17.0]
    cpu = [20.0, 22.0, 24.0, 26.0, 28.0]
    r = compare_grpo.rates(ends, cpu, gen_s=[5.0, 0.5, 0.25, 2.0, 0.5], gen_tokens=[100, 50, 50, 100, 100], per_step=64)
    assert r["step_s"] == [10.0, 1.0, 1.0, 4.0, 1.0]
    assert r["completions_per_s"] == 64.0  # the median of 1, 1, 4, 1
    assert r["completions_per_s_best"] == 64.0
    assert r["completions_per_s_mean"] == pytest.approx(64 * 4 / 7)
    assert r["completions_per_s_all"] == pytest.approx(64 * 5 / 17)
    assert r["completions_per_cpu_s"] == pytest.approx(64 * 4 / 8)
    assert r["gen_s_per_step"] == 0.5  # median of 0.5, 0.25, 2, 0.5
    assert r["gen_tokens_per_s"] == pytest.approx(150.0)  # median of 100, 200, 50, 200 tokens/s
