"""Micro-batch 4 x accumulation 1 == micro-batch 1 x accumulation 4 (fp32, 1e-5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainforge.config.run import ModelSettings
from conftest import make_store
from trainforge.data.loader import RowCollator
from trainforge.data.packing import single_rows
from trainforge.engine.step import forward_backward, loss_sum
from trainforge.hardware.device import PRECISIONS
from trainforge.model.load import build_model
from trainforge.model.tokenizer import load_tokenizer

CPU = torch.device("cpu")
FP32 = PRECISIONS["fp32"]


@pytest.fixture
def model_and_examples(tiny_model_dir, tmp_path):
    tok = load_tokenizer(tiny_model_dir)
    model = build_model(ModelSettings(path=tiny_model_dir), tok, seed=0)
    gen = torch.Generator().manual_seed(0)
    sequences = []
    for length, n_masked in [(5, 2), (17, 10), (9, 0), (30, 25)]:  # different lengths and target counts
        ids = torch.randint(0, len(tok), (length + 1,), generator=gen).tolist()
        sequences.append((ids, [False] * (n_masked + 1) + [True] * (length - n_masked)))
    store = make_store(tmp_path / "store", sequences, len(tok))
    rows = single_rows(store, np.arange(len(store)))
    collate = RowCollator(store, tok.pad_token_id, False, max_length=64)
    return model, rows, collate


def grads_after(model, micro_batches) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    forward_backward(model, micro_batches, FP32, CPU)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_one_batch_of_four_equals_four_batches_of_one(model_and_examples):
    model, rows, collate = model_and_examples
    whole = grads_after(model, [collate(rows, [0, 1, 2, 3])])
    split = grads_after(model, [collate([r], [i]) for i, r in enumerate(rows)])
    assert whole.keys() == split.keys() and whole
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=0, atol=1e-5, msg=name)


def test_two_by_two_equals_four_by_one(model_and_examples):
    model, rows, collate = model_and_examples
    whole = grads_after(model, [collate(rows, [0, 1, 2, 3])])
    pairs = grads_after(model, [collate(rows[:2], [0, 1]), collate(rows[2:], [2, 3])])
    for name in whole:
        torch.testing.assert_close(pairs[name], whole[name], rtol=0, atol=1e-5, msg=name)


def test_mean_of_means_would_differ(model_and_examples):
    """The test above can fail: averaging per-micro-batch means gives a different gradient."""
    model, rows, collate = model_and_examples
    whole = grads_after(model, [collate(rows, [0, 1, 2, 3])])
    model.zero_grad(set_to_none=True)
    for i, r in enumerate(rows):
        b = collate([r], [i])
        (loss_sum(model, b, FP32) / b.n_targets / len(rows)).backward()
    diff = max((p.grad - whole[n]).abs().max().item() for n, p in model.named_parameters() if p.grad is not None)
    assert diff > 1e-4


def test_loss_is_token_weighted_mean(model_and_examples):
    model, rows, collate = model_and_examples
    model.zero_grad(set_to_none=True)
    batches = [collate([r], [i]) for i, r in enumerate(rows)]
    mean = forward_backward(model, batches, FP32, CPU)
    with torch.no_grad():
        sums = [loss_sum(model, b, FP32) for b in batches]
    expected = sum(sums) / sum(b.n_targets for b in batches)
    torch.testing.assert_close(mean, expected, rtol=1e-6, atol=1e-6)
