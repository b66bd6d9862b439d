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
    assert float(sums[0].sum()) == pytest.approx(plain.item(), rel=1e-5)


# ---------------------------------------------------------------- a cache entry per source


@pytest.fixture
def tok(tiny_tokenizer_dir):
    from trainforge.model.tokenizer import load_tokenizer

    return load_tokenizer(tiny_tokenizer_dir)


def _prepare(tmp_path, tok, sources, **data):
    from trainforge.data.prepare import prepare_data

    said: list[str] = []
    cfg = DataSettings(train=sources, cache_dir=tmp_path / "cache", num_workers=1, **data)
    return prepare_data(cfg, tok, seed=0, log=said.append), said


def test_adding_a_source_tokenizes_only_it_and_a_share_tokenizes_nothing(tmp_path, tok):
    paths = [str(write_jsonl(tmp_path / f"{n}.jsonl", [{"text": f"{n} document {i} " * (1 + i % 4)} for i in range(30)]))
             for n in ("a", "b", "c")]
    two, said = _prepare(tmp_path, tok, [{"path": paths[0], "share": 0.5}, {"path": paths[1], "share": 0.5}], eval=0.1)
    assert sum("tokenizing source" in s for s in said) == 2 and two.train.n_sources == 2 and two.eval.n_sources == 2
    alone, said = _prepare(tmp_path, tok, paths[1], eval=0.1)  # the source alone: the entry the mixture made for it
    assert said[0].startswith("data: cache hit") and alone.cache_hit
    first_b = two.train.source_of(1)
    assert np.array_equal(np.asarray(two.train.ids[two.train.offsets[first_b.start] : two.train.offsets[first_b.stop]]),
                          np.asarray(alone.train.ids))

    three, said = _prepare(tmp_path, tok, [{"path": p, "share": s} for p, s in zip(paths, (0.5, 0.3, 0.2))], eval=0.1)
    assert [s.split(" into ")[0] for s in said if "tokenizing" in s] == [f"data: tokenizing source 2 ({paths[2]})"]
    assert three.train.n_sources == 3 and len(three.train) == len(two.train) + len(three.train.source_of(2))

    reshared, said = _prepare(tmp_path, tok, [{"path": p, "share": s} for p, s in zip(paths, (0.2, 0.3, 0.5))], eval=0.1)
    assert said[0].startswith("data: cache hit") and reshared.cache_path == three.cache_path  # shares key nothing
    dropped, said = _prepare(tmp_path, tok, [paths[0], paths[2]], eval=0.1)  # a source removed: joined, not tokenized
    assert not any("tokenizing" in s for s in said) and any("joining 2 sources" in s for s in said)
    assert dropped.cache_path != three.cache_path
    assert dropped.stats["train_sequences"] == len(two.train.source_of(0)) + len(three.train.source_of(2))
