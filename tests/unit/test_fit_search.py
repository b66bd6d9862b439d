"""The auto micro-batch's search: the largest allowed size predicted to fit, found in a few traces even where
the line through 1 and 2 rows is optimistic by many rows."""

from __future__ import annotations

import pytest

from trainforge.engine.predict.fit import MemoryPrediction, _largest_that_fits

GIB = 2**30


def curve(kink: int, slope_before: float, slope_after: float):
    """Process GiB at ``rows``: a gentle slope up to ``kink`` rows, a steeper one past it (the peak moving
    from the optimizer's moments to the activations)."""
    def gib(rows: int) -> float:
        return 3.5 + slope_before * min(rows, kink) + slope_after * max(0, rows - kink)
    return gib


def searched(gib, allowed: list[int], capacity_gib: float = 8.0, margin: float = 0.9):
    calls: list[int] = []

    def predict(rows: int) -> MemoryPrediction:
        calls.append(rows)
        return MemoryPrediction({"activations": int(gib(rows) * GIB)}, int(gib(rows) * GIB), int(gib(rows) * GIB),
                                int(capacity_gib * GIB), rows, True)

    one, two = predict(1), predict(2)
    m, per_row = _largest_that_fits(predict, one, two, margin * capacity_gib * GIB, margin, allowed)
    truth = max((r for r in allowed if gib(r) <= margin * capacity_gib), default=allowed[0])
    return m, truth, calls


@pytest.mark.parametrize("kink, before, after", [(2, 0.2, 0.445), (1, 0.2, 0.2), (4, 0.01, 0.9), (3, 0.3, 0.31)])
def test_the_pick_is_the_largest_that_fits_in_a_few_traces(kink, before, after):
    gib = curve(kink, before, after)
    m, truth, calls = searched(gib, list(range(1, 257)))
    assert m.micro_batch_size == truth and m.process <= 0.9 * 8 * GIB
    assert len(calls) <= 8 and len(set(calls)) == len(calls)  # nothing traced twice


def test_the_old_step_down_case_takes_three_checks_not_ten():
    """TinyLlama LoRA on an RTX 4060: 1 and 2 rows said 0.199 GiB a row (18 rows); the real slope from there is
    0.445, so stepping down a row at a time traced 10 sizes."""
    gib = curve(2, 0.199, 0.445)
    m, truth, calls = searched(gib, list(range(1, 257)))
    assert truth == 9 and m.micro_batch_size == 9
    assert calls[2:] == [18, 9, 10]


def test_only_allowed_sizes_are_checked_and_none_fitting_gives_the_smallest():
    gib = curve(2, 0.5, 0.5)
    divisors = [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]
    m, truth, calls = searched(gib, divisors)
    assert m.micro_batch_size == truth == 6 and set(calls) <= set(divisors)
    m, _, calls = searched(curve(1, 9.0, 1.0), [4, 8, 12])  # grpo: whole groups of 4; even 4 rows do not fit
    assert m.micro_batch_size == 4 and not m.fits(0.9)
