"""train.cpu_threads: auto takes the most threads clearly faster than one (not stalled on a busy core), follows
the machine at later checks, and leaves the process as it found it. Probes are faked (exact); one
real probe checks the measurement itself."""

from __future__ import annotations

import pytest
import torch

from trainforge.config_train import TrainSettings
from trainforge.cpu_threads import CpuThreads, candidates, probe_seconds, fastest_threads


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def busy(stalled_above: int, t1: float = 3e-4):
    """A fake probe: counts above ``stalled_above`` wait a scheduler slice at the barrier."""
    calls = []

    def probe(n: int) -> float:
        calls.append(n)
        return 0.016 if n > stalled_above else t1 / n
    probe.calls = calls
    return probe


def test_candidates_try_every_count_on_small_machines_and_fractions_on_large_ones():
    assert candidates(1) == [1] and candidates(4) == [4, 3, 2, 1]
    assert candidates(64) == [64, 48, 32, 16, 1]


def test_auto_keeps_every_core_when_none_stalls_and_probes_only_two_counts():
    probe = busy(stalled_above=64)
    assert fastest_threads(4, probe)[0] == 4
    assert probe.calls == [1, 4]


def test_auto_steps_down_to_the_cores_that_are_free():
    assert fastest_threads(2, busy(stalled_above=1))[0] == 1
    assert fastest_threads(4, busy(stalled_above=3))[0] == 3
    assert fastest_threads(16, busy(stalled_above=9))[0] == 8  # 16 and 12 stall; 8 is the next candidate
    # two threads no faster than one (both on the one free core, beside a spinning process): one thread
    assert fastest_threads(2, lambda n: 1.5e-3 if n == 1 else 1.6e-3)[0] == 1
    assert fastest_threads(2, lambda n: 1.5e-3 if n == 1 else 0.75e-3)[0] == 2  # idle: about 2x


def test_a_run_follows_the_machine_and_says_so(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    machine = {"free": 1}
    threads = CpuThreads.for_device("auto", torch.device("cpu"))
    threads.available, threads.probe = 2, lambda n: 0.016 if n > machine["free"] else 3e-4 / n
    note = threads.start()
    assert torch.get_num_threads() == 1 and "1 of 2" in note and "16.00 ms" in note and "train.cpu_threads" in note
    machine["free"] = 2
    assert threads.recheck() is None  # within RECHECK_S of the last check: no probe
    threads.checked_at -= 31
    assert "free again" in threads.recheck() and torch.get_num_threads() == 2
    threads.checked_at -= 31
    assert threads.recheck() is None  # unchanged: nothing to say
    noisy = iter([3e-4, 0.016, 3e-4, 1.5e-4])  # one probe sees a stall, the confirming one does not: no change
    threads.probe = lambda n: next(noisy)
    threads.checked_at -= 31
    assert threads.recheck() is None and torch.get_num_threads() == 2
    torch.set_num_threads(1)
    threads.restore()
    assert torch.get_num_threads() == 2  # the count the process started with


def test_a_fixed_count_an_environment_count_and_a_gpu_are_left_alone(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    fixed = CpuThreads.for_device(1, torch.device("cpu"))
    fixed.probe = lambda n: pytest.fail("a fixed count is not probed")
    assert fixed.start() is None and torch.get_num_threads() == 1 and fixed.recheck(force=True) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    from_env = CpuThreads.for_device("auto", torch.device("cpu"))
    assert not from_env.active and from_env.why == "OMP_NUM_THREADS=2"  # the launcher or the user chose
    assert CpuThreads.for_device(3, torch.device("cpu")).active  # the config wins over the environment
    assert not CpuThreads.for_device("auto", torch.device("cuda")).active


def test_the_setting_is_auto_or_a_positive_count():
    assert TrainSettings().cpu_threads == "auto" and TrainSettings(cpu_threads="4").cpu_threads == 4
    for bad in (0, -1, 2000, "many"):
        with pytest.raises(ValueError):
            TrainSettings(cpu_threads=bad)


def test_the_real_probe_times_a_matmul_on_the_threads_it_is_given():
    seconds = probe_seconds(1, window_s=0.005)
    assert 0 < seconds < 5 and torch.get_num_threads() == 1
