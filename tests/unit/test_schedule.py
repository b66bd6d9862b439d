from __future__ import annotations

import math

import pytest

from trainforge.engine.schedule import lr_factor


def test_warmup_is_linear_then_cosine_reaches_floor():
    f = lr_factor("cosine", warmup_steps=4, max_steps=14, min_ratio=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)


def test_linear_and_constant():
    lin = lr_factor("linear", warmup_steps=0, max_steps=10, min_ratio=0.0)
    assert [lin(s) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]
    const = lr_factor("constant", warmup_steps=2, max_steps=10, min_ratio=0.0)
    assert [const(s) for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
