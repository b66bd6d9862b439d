"""train.cpu_threads: auto takes the most threads clearly faster than one (not stalled on a busy core), follows
the machine at later checks, and leaves the process as it found it. Probes are faked (exact); one
real probe checks the measurement itself."""

from __future__ import annotations

import os

import pytest
import torch

from trainforge.config.train import TrainSettings
from trainforge.hardware import cpu_threads
from trainforge.hardware.cpu_threads import CpuThreads, candidates, probe_seconds, fastest_threads, other_work_cores


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


def one_core_busy() -> float:
    return 1.0  # what /proc/stat shows beside one spinning process


def test_auto_steps_down_to_the_cores_that_are_free():
    assert fastest_threads(2, busy(stalled_above=1), one_core_busy)[0] == 1
    assert fastest_threads(4, busy(stalled_above=3), one_core_busy)[0] == 3
    assert fastest_threads(16, busy(stalled_above=9), one_core_busy)[0] == 8  # 16 and 12 stall; 8 is the next candidate
    # two threads no faster than one (both on the one free core, beside a spinning process): one thread
    assert fastest_threads(2, lambda n: 1.5e-3 if n == 1 else 1.6e-3, one_core_busy)[0] == 1
    assert fastest_threads(2, lambda n: 1.5e-3 if n == 1 else 0.75e-3, one_core_busy)[0] == 2  # idle: about 2x
    # where /proc/stat cannot say, the interleaved timings alone decide
    assert fastest_threads(2, busy(stalled_above=1), lambda: None)[0] == 1


def noisy_then_idle(first: dict[int, float]):
    """A fake probe on an idle 2-core machine whose first timings are thrown (other processes just ended)."""
    calls = []

    def probe(n: int) -> float:
        calls.append(n)
        return first[n] if len(calls) <= len(first) else 1.5e-3 / n
    probe.calls = calls
    return probe


def test_a_noisy_first_timing_on_an_idle_machine_keeps_every_core():
    # what a 120M Llama's run met: 2 threads took 1.47 ms against 1.10 ms on one, and it ran on one core
    probe = noisy_then_idle({1: 1.10e-3, 2: 1.47e-3})
    assert fastest_threads(2, probe, lambda: 0.02)[0] == 2  # /proc/stat: nothing else runs
    assert probe.calls == [1, 2]  # the idle cores settle it without more timings
    probe = noisy_then_idle({1: 1.10e-3, 2: 1.47e-3})
    assert fastest_threads(2, probe, lambda: None)[0] == 2  # unknown load: the median of interleaved timings
    assert probe.calls == [1, 2, 1, 2, 1, 2]
    # a busy core and timings that show it: one thread, whatever the first pair said
    stalled = noisy_then_idle({1: 1.5e-3, 2: 0.7e-3})
    assert fastest_threads(2, lambda n: stalled(n) if n == 1 else 0.016, one_core_busy)[0] == 1
    # busy by /proc/stat but the interleaved timings say 2 threads are fast: all cores
    assert fastest_threads(2, noisy_then_idle({1: 1.10e-3, 2: 1.47e-3}), one_core_busy)[0] == 2


def test_a_run_starts_on_every_core_of_an_idle_machine_despite_a_noisy_probe(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = CpuThreads.for_device("auto", torch.device("cpu"))
    torch.set_num_threads(2)  # the process starts with one thread per core
    threads.available, threads.probe, threads.others = 2, noisy_then_idle({1: 1.10e-3, 2: 1.47e-3}), lambda: 0.0
    assert threads.start() is None and torch.get_num_threads() == 2 and "no core busy" in threads.why


def test_other_work_counts_what_other_processes_take_from_the_cores(monkeypatch):
    ticks = iter([1000, 1100])  # CPU seconds x 100 at the two reads: 1 s of others' work over a 1 s window
    monkeypatch.setattr(cpu_threads, "_busy_seconds", lambda cpus: next(ticks) / 100)
    clock = iter([0.0, 1.0])
    monkeypatch.setattr(cpu_threads.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(cpu_threads.time, "sleep", lambda s: None)
    own = iter([5.0, 5.2])  # this process's own 0.2 s is not other work
    monkeypatch.setattr(cpu_threads.time, "process_time", lambda: next(own))
    assert other_work_cores() == pytest.approx(0.8)


def test_the_real_load_reading_is_a_share_of_the_cores():
    seen = other_work_cores(window_s=0.02)  # the real /proc/stat, this process's cores
    assert seen is None or 0 <= seen <= len(os.sched_getaffinity(0))


def test_ticks_credited_in_a_burst_read_as_all_cores_at_most(monkeypatch):
    """A 2-core CI machine under load once read 3.9 cores of other work over 20 ms (ticks, steal among them,
    credited late): a reading is clamped to the cores there are."""
    ticks = iter([1000, 1008])  # 8 ticks of 10 ms in a 20 ms window: four cores' worth
    monkeypatch.setattr(cpu_threads, "_busy_seconds", lambda cpus: next(ticks) / 100)
    clock = iter([0.0, 0.02])
    monkeypatch.setattr(cpu_threads.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(cpu_threads.time, "sleep", lambda s: None)
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert other_work_cores(window_s=0.02) == 2.0


def test_a_run_follows_the_machine_and_says_so(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    machine = {"free": 1}
    threads = CpuThreads.for_device("auto", torch.device("cpu"))
    threads.available, threads.probe = 2, lambda n: 0.016 if n > machine["free"] else 3e-4 / n
    threads.others = lambda: 2.0 - machine["free"]
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
