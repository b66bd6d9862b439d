"""benchmarks/bench_long_context.py's search for the longest length that fits: where it probes and what it finds."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_long_context.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_long_context", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_long_context"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("bench_long_context", None)


def fits_below(limit: int, probed: list[int]):
    def fits(n: int) -> bool:
        probed.append(n)
        return n <= limit
    return fits


def test_doubling_then_bisection_ends_within_the_tolerance(bench):
    probed: list[int] = []
    found = bench.search(fits_below(10_000, probed), start=1024, granule=256, tolerance=0.05, max_length=1 << 20)
    assert found["longest"] <= 10_000 < found["first_over"]
    assert found["first_over"] - found["longest"] <= max(256, 0.05 * found["longest"])
    assert probed[:5] == [1024, 2048, 4096, 8192, 16384] and all(n % 256 == 0 for n in probed)


def test_a_prediction_that_holds_is_bracketed_and_bisected_near_it(bench):
    probed: list[int] = []
    found = bench.search(fits_below(10_100, probed), start=1024, granule=256, tolerance=0.05, max_length=1 << 20,
                         seed=10_000)
    assert probed == [9472, 10240, 9728, 9984] and found == {"longest": 9984, "first_over": 10240}


def test_a_prediction_too_high_steps_down_and_an_undecided_probe_ends_the_search(bench):
    probed: list[int] = []
    found = bench.search(fits_below(5_000, probed), start=1024, granule=256, tolerance=0.05, max_length=1 << 20,
                         seed=10_000)
    assert probed[0] == 9472 and probed[1] < 9472 and found["longest"] <= 5_000 < found["first_over"]
    assert bench.search(lambda n: None, start=1024, granule=256, tolerance=0.05, max_length=1 << 20) == \
        {"longest": 0, "undecided_at": 1024}


def test_the_search_stops_at_the_longest_length_allowed(bench):
    probed: list[int] = []
    found = bench.search(fits_below(1 << 30, probed), start=1024, granule=256, tolerance=0.05, max_length=4096)
    assert probed == [1024, 2048, 4096] and found == {"longest": 4096, "first_over": None}


def test_a_step_past_the_longest_allowed_probes_that_length(bench):
    probed: list[int] = []
    found = bench.search(fits_below(1 << 30, probed), start=1024, granule=256, tolerance=0.05, max_length=5000)
    assert probed == [1024, 2048, 4096, 4864] and found == {"longest": 4864, "first_over": None}
    probed.clear()  # a prediction's bracket alike: from 8,960 a step of 10%, then doubling, passes 10,000
    found = bench.search(fits_below(1 << 30, probed), start=1024, granule=256, tolerance=0.05, max_length=10_000, seed=9_500)
    assert probed == [8960, 9728, 9984] and found["longest"] == 9984


def test_a_prediction_at_the_longest_allowed_probes_it_first(bench):
    probed: list[int] = []
    found = bench.search(fits_below(1 << 30, probed), start=1024, granule=256, tolerance=0.05, max_length=4096, seed=4096)
    assert probed == [4096] and found == {"longest": 4096, "first_over": None}
