"""Checkpoints are complete or invisible; keep-last prunes only after a newer one is complete."""

from __future__ import annotations

import pytest
import torch

from trainforge.rundir.checkpoint import LATEST, atomic_write_dir, complete_checkpoints, save_checkpoint


def test_save_moves_latest_and_keeps_last_k(tmp_path):
    for step in (10, 20, 30, 40):
        save_checkpoint(tmp_path, step, {"w": torch.tensor([float(step)])}, {"version": "t"}, keep_last=2)
    names = [p.name for p in complete_checkpoints(tmp_path)]
    assert names == ["step-00000030", "step-00000040"]
    assert (tmp_path / LATEST).read_text().strip() == "step-00000040"
    assert torch.load(tmp_path / "step-00000040" / "state.pt")["w"].item() == 40.0


def test_failed_write_leaves_nothing_visible(tmp_path):
    save_checkpoint(tmp_path, 1, {"w": 1}, {}, keep_last=1)

    def explode(tmp):
        (tmp / "state.pt").write_bytes(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError):
        atomic_write_dir(tmp_path / "step-00000002", explode)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-00000001"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step-00000001"]


def test_partial_directories_are_ignored(tmp_path):
    save_checkpoint(tmp_path, 5, {"w": 1}, {}, keep_last=3)
    (tmp_path / "step-00000009").mkdir()  # e.g. copied by hand, no completion marker
    (tmp_path / ".step-00000010.tmp-node1-123-abcdef").mkdir()
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-00000005"]


def test_trainer_writes_checkpoints(finetune_config, tmp_path):
    from rich.console import Console

    from trainforge.config.run import RunConfig
    from trainforge.engine.trainer import train
    from trainforge.metrics.console import ConsoleReporter

    finetune_config["checkpoint"] = {"every_steps": 3, "keep_last": 2}
    train(RunConfig.model_validate(finetune_config), tmp_path / "run", ConsoleReporter(Console(quiet=True)))
    names = [p.name for p in complete_checkpoints(tmp_path / "run" / "checkpoints")]
    assert names == ["step-00000006", "step-00000008"]  # every 3 steps and at the end (8), last 2 kept
    state = torch.load(tmp_path / "run" / "checkpoints" / "step-00000008" / "state.pt", weights_only=False)
    assert {"model", "optimizer", "scheduler", "loader"} <= set(state)


def test_every_minutes_saves_once_the_interval_has_passed(tmp_path):
    from rich.console import Console

    from trainforge.config.run import CheckpointSettings
    from trainforge.engine.saver import Checkpointer
    from trainforge.metrics.console import ConsoleReporter

    now = [0.0]
    saver = Checkpointer(
        tmp_path, CheckpointSettings(every_minutes=1.0), {}, ConsoleReporter(Console(quiet=True)), clock=lambda: now[0]
    )
    assert not saver.due(1, last=False)
    now[0] = 61.0
    saver.maybe_save(2, False, lambda: {"w": torch.zeros(1)})
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-00000002"]
    assert not saver.due(3, last=False)  # the interval counts from the last save
    now[0] = 122.0
    assert saver.due(4, last=False) and saver.due(3, last=True)
    off = Checkpointer(tmp_path, CheckpointSettings(every_minutes=None), {}, ConsoleReporter(Console(quiet=True)))
    assert not off.due(5, last=True)  # no interval set: no checkpoints, not even at the end


def test_truncated_state_file_is_recognized(tmp_path):
    from trainforge.rundir.checkpoint import inspect_checkpoint, scan_checkpoints

    path = save_checkpoint(tmp_path, 3, {"w": torch.zeros(100)}, {}, keep_last=2)
    data = (path / "state.pt").read_bytes()
    (path / "state.pt").write_bytes(data[:-10])
    assert "truncated" in inspect_checkpoint(path)
    assert scan_checkpoints(tmp_path)[0] == [] and scan_checkpoints(tmp_path)[1][0][0] == path


def test_recover_hidden_removes_unfinished_and_restores_a_parked_checkpoint(tmp_path):
    from trainforge.rundir.checkpoint import recover_hidden

    path = save_checkpoint(tmp_path, 4, {"w": 1}, {}, keep_last=2)
    path.rename(tmp_path / ".step-00000004.old-node1-123-abcdef")  # died between the two renames of a replacement
    (tmp_path / ".step-00000006.tmp-node1-123-abcdef").mkdir()  # died while writing
    notes = recover_hidden(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step-00000004"]
    assert notes == ["restored step-00000004", "removed unfinished .step-00000006.tmp-node1-123-abcdef"]


# ---------------------------------------------------------------- checksums


def test_meta_records_the_checksum_of_state_pt_as_written(tmp_path):
    import json
    import zlib

    from trainforge.rundir.checkpoint import inspect_checkpoint, verify_checkpoint

    path = save_checkpoint(tmp_path, 3, {"w": torch.randn(1000), "n": 5}, {}, keep_last=2)
    record = json.loads((path / "meta.json").read_text())["files"]["state.pt"]
    data = (path / "state.pt").read_bytes()
    assert record == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    assert verify_checkpoint(inspect_checkpoint(path)) is None


@pytest.mark.parametrize("offset", [0, 100, -1])
def test_any_flipped_byte_is_recognized(tmp_path, offset):
    from trainforge.rundir.checkpoint import inspect_checkpoint, verify_checkpoint

    path = save_checkpoint(tmp_path, 3, {"w": torch.randn(1000)}, {}, keep_last=2)
    data = bytearray((path / "state.pt").read_bytes())
    data[offset] ^= 0x01  # one bit, the size unchanged
    (path / "state.pt").write_bytes(bytes(data))
    info = inspect_checkpoint(path)  # the sizes still match
    assert "state.pt is damaged: its crc32 is" in verify_checkpoint(info)


def test_meta_without_checksums_is_still_accepted(tmp_path):
    import json

    from trainforge.rundir.checkpoint import has_checksums, inspect_checkpoint, verify_checkpoint

    path = save_checkpoint(tmp_path, 3, {"w": torch.zeros(10)}, {}, keep_last=2)
    meta = json.loads((path / "meta.json").read_text())
    meta["files"] = {name: rec["bytes"] for name, rec in meta["files"].items()}  # the format before checksums
    (path / "meta.json").write_text(json.dumps(meta))
    info = inspect_checkpoint(path)
    assert not has_checksums(info) and verify_checkpoint(info) is None
    (path / "state.pt").write_bytes(b"x")
    assert "truncated" in inspect_checkpoint(path)  # sizes are still checked


def test_final_weights_check_warns_and_reports():
    from trainforge.engine.nonfinite import final_weights_check

    model = torch.nn.Linear(4, 4)
    warnings: list[str] = []
    assert final_weights_check(model, None, warnings.append) == {} and warnings == []
    with torch.no_grad():
        model.weight[0, :3] = float("nan")
        model.bias[1] = float("inf")
    got = final_weights_check(model, None, warnings.append)
    assert got == {"nonfinite_weights": True, "nonfinite_tensors": {"weight": 3, "bias": 1}}
    assert "4 non-finite values in 2 tensors" in warnings[0]
    model.bias.requires_grad_(False)  # frozen (a LoRA base): not trained, not checked
    assert final_weights_check(model, None, warnings.append)["nonfinite_tensors"] == {"weight": 3}
