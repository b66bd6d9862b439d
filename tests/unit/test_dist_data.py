"""Rank sharding of the loader, and the choices made without a process group."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import make_store
from trainforge.data.loader import RowCollator, TrainLoader
from trainforge.data.packing import single_rows
from trainforge.dist import choose_mode

N_ROWS = 23  # not a multiple of any global micro-batch below: the epoch ends in a short one


@pytest.fixture
def rows_and_collate(tmp_path):
    seqs = [(list(range(1, 3 + i % 5)), [True] * (2 + i % 5)) for i in range(N_ROWS)]
    store = make_store(tmp_path / "store", seqs)
    return single_rows(store, np.arange(N_ROWS)), RowCollator(store, 0, False, max_length=16)


def draws(rows, collate, batch_size: int, world: int, n: int) -> list[list]:
    """``n`` micro-batches of every rank: [rank][i] -> Batch."""
    loaders = [TrainLoader(rows, collate, batch_size, seed=7, group_by_length=False, rank=r, world_size=world) for r in range(world)]
    its = [iter(ld) for ld in loaders]
    return [[next(it) for _ in range(n)] for it in its], loaders


@pytest.mark.parametrize("world,batch_size", [(2, 2), (3, 2), (4, 3)])
def test_every_row_of_an_epoch_once_across_ranks_in_the_single_process_order(rows_and_collate, world, batch_size):
    rows, collate = rows_and_collate
    per_epoch = -(-N_ROWS // (batch_size * world))
    shards, loaders = draws(rows, collate, batch_size, world, per_epoch)
    single, _ = draws(rows, collate, batch_size * world, 1, per_epoch)
    merged = [i for m in range(per_epoch) for r in range(world) for i in shards[r][m].indices]
    assert sorted(merged) == list(range(N_ROWS))  # nothing dropped, nothing twice
    assert merged == [i for b in single[0] for i in b.indices]  # the same global order as one process
    assert {ld.state_dict()["offset"] for ld in loaders} == {N_ROWS}  # the position is global and shared
    assert loaders[0].batches_per_epoch == per_epoch


def test_a_rank_without_rows_in_the_epoch_tail_gets_a_batch_without_targets(rows_and_collate):
    rows, collate = rows_and_collate
    shards, _ = draws(rows, collate, 2, 4, 3)  # 8 + 8 + 7 rows: the last micro-batch leaves no rank empty
    assert all(b.n_targets > 0 for r in shards for b in r)
    shards, _ = draws(rows, collate, 7, 4, 1)  # 23 rows over 4 ranks x 7: 5 or 6 each
    assert sum(len(b.indices) for r in shards for b in r[:1]) == N_ROWS
    shards, _ = draws(rows, collate, 1, 4, 6)  # micro-batch 6 holds 23 - 20 = 3 rows: one rank gets none
    (tail,) = [r[5] for r in shards if not r[5].indices]
    assert tail.indices == [] and tail.n_targets == 0 and tail.n_tokens == 0 and (tail.labels == -100).all()
    assert tail.input_ids.shape[0] == 1  # it still runs a forward pass: the collectives stay in step


def test_auto_picks_ddp_when_the_state_fits_and_fsdp_when_not():
    gib = 2**30
    assert choose_mode("auto", 1 * gib, 16 * gib, 1)[0] == "ddp"
    assert choose_mode("auto", 14 * gib, 16 * gib, 1)[0] == "fsdp"  # above 80% of the device
    assert choose_mode("auto", 3.5 * gib, 16 * gib, 4)[0] == "fsdp"  # 4 CPU ranks share the host's memory
    assert choose_mode("ddp", 100 * gib, gib, 1)[0] == "ddp"  # asked for: as configured


def test_fsdp_on_a_torch_without_the_sum_reduction_setters_is_refused_with_the_fix(monkeypatch):
    """torch 2.6 and 2.7 have FSDP2 but not set_gradient_divide_factor / set_force_sum_reduction_for_comms:
    the run stops before sharding, naming the setting, the torch and what to do."""
    from torch.distributed.fsdp import FSDPModule

    from trainforge.dist import DistError, shard_fsdp2

    monkeypatch.delattr(FSDPModule, "set_force_sum_reduction_for_comms")
    with pytest.raises(DistError, match=r"train.distributed: fsdp .* \(2.8\+\): upgrade torch, or use train.distributed: ddp"):
        shard_fsdp2(torch.nn.Linear(2, 2), torch.device("cpu"))
