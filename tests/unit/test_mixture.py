"""Mixtures: token shares met by seeded sampling, per-source figures, and the refusals of bad mixtures."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from conftest import write_jsonl
from trainforge.config.data import DataSettings, SourceSpec
from trainforge.data.mixture import mixture_figures, mixture_indices, share_indices, source_names
from trainforge.data.store import StoreWriter, TokenStore


def two_source_store(path, lengths_a, lengths_b) -> TokenStore:
    """A store of two sources whose sequences have these lengths (tokens all 1, all learned)."""
    writer = StoreWriter(path, 100)
    for lengths in (lengths_a, lengths_b):
        writer.start_source()
        n = int(sum(lengths))
        writer.append(np.ones(n, np.int64), np.ones(n, np.uint8), np.asarray(lengths))
    writer.close({})
    return TokenStore(path)


@pytest.mark.parametrize("shares", [(0.7, 0.3), (0.2, 0.8), (0.5, 0.5)])
def test_shares_are_met_within_one_percent_whatever_the_row_lengths(tmp_path, shares):
    rng = np.random.default_rng(0)
    # short rows (chat-like) against rows ten times longer (code files): weights would give 1:10 token shares
    store = two_source_store(tmp_path / "s", rng.integers(5, 40, 600), rng.integers(50, 400, 300))
    specs = [SourceSpec(path=str(tmp_path), share=shares[0]), SourceSpec(path=str(tmp_path), share=shares[1])]
    index = mixture_indices(store, specs, seed=3)
    figures = mixture_figures(store, specs, index)
    for f, asked in zip(figures, shares):
        assert abs(f.share - asked) <= 0.01 * asked, (f, asked)
    # the first source is repeated (a share above its own), the second subsampled or repeated as the share asks
    tokens_a = int((store.lengths[:600] - 1).sum())
    assert figures[0].mixture_tokens == pytest.approx(shares[0] * int((store.lengths - 1).sum()), rel=0.01)
    assert figures[0].epochs_per_mixture_epoch == pytest.approx(figures[0].mixture_tokens / tokens_a)
    # seeded: the same seed gives the same epoch, another seed another sample
    assert np.array_equal(index, mixture_indices(store, specs, seed=3))
    assert not np.array_equal(index, mixture_indices(store, specs, seed=4))


def test_weights_still_multiply_rows(tmp_path):
    store = two_source_store(tmp_path / "s", [10] * 20, [100] * 20)
    specs = [SourceSpec(path=str(tmp_path), weight=2.0), SourceSpec(path=str(tmp_path), weight=0.5)]
    figures = mixture_figures(store, specs, mixture_indices(store, specs, seed=0))
    assert [f.mixture_documents for f in figures] == [40, 10]
    assert [f.weight for f in figures] == [2.0, 0.5] and figures[0].share_asked is None


def test_pairs_are_sampled_whole(tmp_path):
    store = two_source_store(tmp_path / "s", [6, 8] * 50, [30, 40] * 50)  # pairs: sequences 2k, 2k + 1
    index = share_indices(store, [0.5, 0.5], seed=1, paired=True)
    assert (index % 2 == 0).all()


def test_source_names_are_short_and_unique(tmp_path):
    a = write_jsonl(tmp_path / "chat.jsonl", [{"text": "x"}])
    specs = [SourceSpec(path=str(a)), SourceSpec(path=str(a)), SourceSpec(path=str(tmp_path), name="code"),
             SourceSpec(path="builtin:python-stdlib")]
    assert source_names(specs) == ["chat", "chat-2", "code", "python-stdlib"]


def _settings(tmp_path, *sources):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": "y"}])
    return DataSettings(train=[{"path": str(p), **s} for p, s in zip((a, b), sources)])


def test_share_and_weight_in_one_mixture_are_refused_naming_the_source(tmp_path):
    with pytest.raises(ValidationError, match=r"data.train\[1\] \('.*b.jsonl'\) gives both share and weight"):
        _settings(tmp_path, {"share": 0.5}, {"share": 0.5, "weight": 2})
    with pytest.raises(ValidationError, match=r"data.train\[1\] \('.*b.jsonl'\) has no share"):
        _settings(tmp_path, {"share": 1.0}, {"weight": 2})


def test_shares_must_sum_to_one(tmp_path):
    with pytest.raises(ValidationError, match="shares sum to 0.9 .*a.jsonl' 0.6.*b.jsonl' 0.3.*not 1"):
        _settings(tmp_path, {"share": 0.6}, {"share": 0.3})
    assert _settings(tmp_path, {"share": 0.7}, {"share": 0.3}).sources()[1].share == 0.3  # 0.7 + 0.3 in floats


def test_fused_loss_sums_each_source_apart_and_the_gradient_is_unchanged():
    import torch

    from trainforge.engine.loss import linear_cross_entropy

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(40, 8, requires_grad=True)
    labels = torch.randint(0, 50, (40,))
    labels[::5] = -100  # positions without a target
    groups = torch.randint(0, 3, (40,))
    sums = torch.zeros(2, 3)
    total = linear_cross_entropy(hidden, head, labels, None, groups, sums)
    total.backward()
    grad = hidden.grad.clone()
    hidden.grad = None
    plain = linear_cross_entropy(hidden, head, labels)
    plain.backward()
    assert torch.allclose(total, plain) and torch.allclose(grad, hidden.grad)
    for k in range(3):
        mine = torch.where(groups == k, labels, torch.full_like(labels, -100))
        assert sums[0, k] == pytest.approx(linear_cross_entropy(hidden, head, mine).item(), rel=1e-5)
        assert sums[1, k] == int((mine != -100).sum())
    assert float(sums[0].sum()) == pytest.approx(float(plain), rel=1e-5)
