"""The run-directory lease and per-process temporaries, on their own (fast; several real processes)."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainforge.rundir.atomic import remove_stale_temps, staging_dir
from trainforge.data.cache import publish_entry
from trainforge.rundir.lock import (
    LEASE_FILE,
    TIMEOUT_ENV,
    LeaseLost,
    RunDirBusy,
    RunLease,
    check_writer,
    env_seconds,
    hold_run_dir,
    read_lease,
)


def quiet(lines: list[str] | None = None):
    return (lines.append if lines is not None else (lambda m: None))


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def write_lease(run: Path, **fields) -> None:
    lease = RunLease(run, 60, info=quiet(), warn=quiet())
    record = {**lease.record.__dict__, **fields}
    run.mkdir(parents=True, exist_ok=True)
    (run / LEASE_FILE).write_text(json.dumps(record))


def test_lease_records_the_holder_and_is_released(tmp_path):
    with hold_run_dir(tmp_path / "run") as lease:
        info = read_lease(tmp_path / "run" / LEASE_FILE)
        assert info.token == lease.token and info.state == "running" and info.timeout_s == 180
        assert info.pid == lease.record.pid and info.host and info.command and info.started_at > 0
    assert not (tmp_path / "run").exists()  # made for the lease and left empty: removed, no temporaries left
    (tmp_path / "kept").mkdir()
    with hold_run_dir(tmp_path / "kept"):
        pass
    assert list((tmp_path / "kept").iterdir()) == []  # a directory that was there stays


def test_a_live_holder_is_named_and_refused(tmp_path):
    with hold_run_dir(tmp_path):
        with pytest.raises(RunDirBusy, match=r"is in use by another trainforge run: pid \d+ on host .*, since .*command"):
            with hold_run_dir(tmp_path):
                pass
    with hold_run_dir(tmp_path):  # free again
        pass


def test_a_dead_holder_on_this_host_is_taken_over_at_once(tmp_path):
    write_lease(tmp_path, pid=dead_pid(), pid_start=None)
    warnings: list[str] = []
    lease = RunLease(tmp_path, 60, info=quiet(), warn=warnings.append)
    lease.acquire(0)
    lease.release()
    assert "took over the lease" in warnings[0] and "no longer runs on this host" in warnings[0]


def test_another_hosts_lease_is_live_until_it_runs_out(tmp_path):
    write_lease(tmp_path, host="other-node", renewed_at=time.time(), timeout_s=3600)
    with pytest.raises(RunDirBusy, match="on host other-node.*expires 3600s after its last renewal"):
        RunLease(tmp_path, 60, info=quiet(), warn=quiet()).acquire(0)
    write_lease(tmp_path, host="other-node", renewed_at=time.time() - 10, timeout_s=5)
    warnings: list[str] = []
    lease = RunLease(tmp_path, 60, info=quiet(), warn=warnings.append)
    lease.acquire(0)
    assert read_lease(tmp_path / LEASE_FILE).token == lease.token
    lease.release()
    assert "presumed dead" in warnings[0] and "other-node" in warnings[0]


def test_a_stopping_holder_is_waited_for(tmp_path):
    write_lease(tmp_path, host="other-node", state="stopping", renewed_at=time.time(), timeout_s=3600)
    with pytest.raises(RunDirBusy, match="still held after waiting"):
        RunLease(tmp_path, 60, info=quiet(), warn=quiet()).acquire(0.3)
    released = threading.Timer(0.5, lambda: (tmp_path / LEASE_FILE).unlink())
    released.start()
    notes: list[str] = []
    lease = RunLease(tmp_path, 60, info=notes.append, warn=quiet())
    lease.acquire(60)
    lease.release()
    assert "stopping after a signal" in notes[0] and "waiting up to 60s" in notes[0]


def test_the_stop_flag_reaches_the_lease_file(tmp_path):
    stop = threading.Event()
    lease = RunLease(tmp_path, 60, stopping=stop.is_set, info=quiet(), warn=quiet())
    lease.acquire(0)
    stop.set()
    deadline = time.monotonic() + 30
    while read_lease(tmp_path / LEASE_FILE).state != "stopping":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    lease.release()


def test_a_lost_lease_stops_the_writer(tmp_path):
    warnings: list[str] = []
    with hold_run_dir(tmp_path, reporter=SimpleNamespace(info=quiet(), warn=warnings.append)) as lease:
        lease.renew_s = 0.1
        write_lease(tmp_path, host="other-node", token="someone-else")  # taken over while this one was frozen
        deadline = time.monotonic() + 30
        while not lease.lost:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(LeaseLost, match="another process took over"):
            check_writer(tmp_path / "checkpoints")
        check_writer(tmp_path.parent / "elsewhere")  # other directories are not concerned
    assert "was taken over" in warnings[0] and "other-node" in warnings[0]
    assert read_lease(tmp_path / LEASE_FILE).token == "someone-else"  # not deleted by the loser


def _race(run: str, start, keep, results) -> None:
    lease = RunLease(Path(run), 60, info=quiet(), warn=quiet())
    start.wait()
    try:
        lease.acquire(0)
        results.put("won")
        keep.wait(60)  # stay alive (and holding) until every racer has decided
        lease.release()
    except RunDirBusy:
        results.put("refused")


@pytest.mark.parametrize("stale", [False, True], ids=["free", "stale"])
def test_of_several_processes_racing_for_one_lease_exactly_one_wins(tmp_path, stale):
    if stale:
        write_lease(tmp_path, host="other-node", renewed_at=time.time() - 100, timeout_s=5)
    mp = multiprocessing.get_context("fork")
    start, keep, results = mp.Barrier(4), mp.Event(), mp.Queue()
    procs = [mp.Process(target=_race, args=(str(tmp_path), start, keep, results)) for _ in range(4)]
    for p in procs:
        p.start()
    outcomes = sorted(results.get(timeout=60) for _ in procs)
    keep.set()
    for p in procs:
        p.join(60)
    assert outcomes == ["refused", "refused", "refused", "won"]


def test_lease_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv(TIMEOUT_ENV, "2.5")
    assert env_seconds(TIMEOUT_ENV, 180) == 2.5
    monkeypatch.setenv(TIMEOUT_ENV, "soon")
    with pytest.raises(RunDirBusy, match=f"{TIMEOUT_ENV}='soon': give a positive number of seconds"):
        env_seconds(TIMEOUT_ENV, 180)


# ---------------------------------------------------------------- per-process temporaries


def test_temporaries_are_per_process_and_dead_ones_are_removed(tmp_path):
    target = tmp_path / "entry"
    assert staging_dir(target) != staging_dir(target)
    mine = staging_dir(target)
    mine.mkdir()
    host, _, rand = mine.name.rsplit("-", 2)
    dead = tmp_path / f"{host}-{dead_pid()}-{rand}"
    dead.mkdir()
    foreign = tmp_path / ".entry.tmp-othernode-123-abcdef"
    foreign.mkdir()
    assert remove_stale_temps(tmp_path, stale_after_s=3600) == [dead.name]
    assert remove_stale_temps(tmp_path, stale_after_s=0) == [foreign.name]  # another host's: by age only
    assert mine.exists()


def test_a_cache_entry_built_twice_keeps_the_first_one(tmp_path):
    root = tmp_path / "data" / "key"

    def build(tag: str):
        def write(tmp: Path) -> None:
            if tag == "second":  # the first finishes while the second is building
                assert publish_entry(root, build("first"))
            (tmp / "stats.json").write_text(tag)

        return write

    assert publish_entry(root, build("second")) is False
    assert (root / "stats.json").read_text() == "first"
    assert sorted(p.name for p in root.parent.iterdir()) == ["key"]
