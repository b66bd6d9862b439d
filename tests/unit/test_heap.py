"""train.compact_heap: when a CPU run's heap gives freed blocks back, that it does, and how plan prices it."""

from __future__ import annotations

import platform

import pytest
import torch

from trainforge.hardware import heap
from trainforge.hardware.device import CPU_ADAPTER_EXTRA_GIB, CPU_COMPACT_ADAPTER_EXTRA_GIB, CPU_COMPACT_HEAP_OVERHEAD, CPU_COMPACT_RUN_EXTRA_GIB, CPU_RUN_EXTRA_GIB, process_rss_bytes
from trainforge.hardware.profiles import GIB, HardwareProfile

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
needs_glibc = pytest.mark.skipif(not GLIBC, reason="the compact heap is glibc's mallopt")


@needs_glibc
@pytest.mark.parametrize("setting, ckpt, tiled, on", [
    ("auto", False, False, False), ("auto", True, False, True), ("auto", False, True, True),
    (True, False, False, True), (False, True, True, False),
])
def test_auto_takes_the_compact_heap_only_with_a_memory_lever(setting, ckpt, tiled, on):
    got, why = heap.compact_heap(setting, "cpu", ckpt, tiled, environ={})
    assert got is on
    if setting == "auto":
        assert why.startswith("on" if on else "off") and ("10-25%" in why)
    else:
        assert why == "as configured"


def test_a_gpu_run_and_the_users_own_threshold_decide_alone():
    assert heap.compact_heap(True, "cuda", True, True, environ={})[0] is False
    got, why = heap.compact_heap("auto", "cpu", False, False, environ={"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert got is True and "65,536" in why and "left as set" in why
    assert heap.compact_heap(True, "cpu", True, True, environ={"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=33554432"})[0] is False


def test_the_users_threshold_is_read_from_either_variable():
    assert heap.users_threshold({}) is None
    assert heap.users_threshold({"MALLOC_MMAP_THRESHOLD_": "0x10000"}) == 65536
    assert heap.users_threshold({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=131072"}) == 131072
    assert heap.users_threshold({"MALLOC_MMAP_THRESHOLD_": "lots"}) is None


RELEASE = """
import json, sys, torch
from trainforge.hardware import heap
from trainforge.hardware.device import process_rss_bytes

raised = torch.ones(30 << 18)  # freeing a mapped 30 MiB block makes glibc serve smaller ones from its heap
del raised
heap.apply_compact_heap(sys.argv[1] == "compact")
before, big, small = process_rss_bytes(), [], []
for _ in range(40):  # 2 MiB blocks, pages touched, each followed by a smaller one kept alive
    big.append(torch.ones(2 << 18))
    small.append(torch.ones(64 << 10))  # 256 KiB: from the heap either way, so a freed block is a hole in it
held = process_rss_bytes() - before
del big
print(json.dumps([held, held - (process_rss_bytes() - before)]))
"""


@needs_glibc
def test_the_compact_heap_gives_freed_blocks_back():
    """Blocks of a few MiB freed between smaller ones kept alive (what a step's many sizes do to a heap): glibc's
    default heap keeps them, the compact heap gives them back. Each in a fresh interpreter, whose memory nothing
    else moves (glibc reuses a free block of the heap before it maps a new one, compact or not)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in heap.USER_VARIABLES}

    def held_released(mode: str) -> tuple[int, int]:
        out = subprocess.run([sys.executable, "-c", RELEASE, mode], capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        return tuple(json.loads(out.stdout.strip().splitlines()[-1]))

    freed = 40 * (2 << 20)  # the 2 MiB blocks
    held, released = held_released("default")
    assert held > freed and released < 0.2 * freed  # the default heap keeps what it was given back
    held, released = held_released("compact")
    assert held > freed and released > 0.9 * freed


def test_plan_prices_the_compact_heap_on_a_cpu(finetune_config, tiny_model_dir):
    from trainforge.config.run import RunConfig
    from trainforge.engine.predict.fit import allocator_overhead, fixed_bytes, heap_is_compact

    cpu = HardwareProfile(name="this", title="a CPU", memory_gib=16, peak_tflops={"fp32": 0.1}, bandwidth_gbs=10, bf16=False, kind="cpu",
                          fixed_gib=0.5, compact_fixed_gib=0.4, allocator_overhead=0.15)
    gpu = HardwareProfile(name="gpu", title="a GPU", memory_gib=80, peak_tflops={"bf16": 900}, bandwidth_gbs=3000, bf16=True, kind="gpu")
    cfg = RunConfig.model_validate({**finetune_config, "model": {"path": str(tiny_model_dir), "method": "lora"}})
    assert heap_is_compact(cfg, cpu, True) is GLIBC and heap_is_compact(cfg, cpu, False) is False
    assert heap_is_compact(cfg, gpu, True) is False
    assert allocator_overhead(cpu, compact=True) == CPU_COMPACT_HEAP_OVERHEAD and allocator_overhead(cpu) == 0.15
    default, compact = fixed_bytes(cfg, cpu), fixed_bytes(cfg, cpu, compact=True)
    assert default - compact == pytest.approx((0.5 - 0.4 + CPU_ADAPTER_EXTRA_GIB - CPU_COMPACT_ADAPTER_EXTRA_GIB) * GIB)
    from trainforge.hardware.device import this_profile

    here = this_profile(torch.device("cpu"), timing=False)  # this machine: the run's extra, smaller with the compact heap
    assert here.fixed_gib - here.compact_fixed_gib == pytest.approx(CPU_RUN_EXTRA_GIB - CPU_COMPACT_RUN_EXTRA_GIB, abs=0.02)
    assert fixed_bytes(cfg, gpu, compact=True) == fixed_bytes(cfg, gpu)


@needs_glibc
def test_plan_times_ops_with_the_heap_the_run_will_have_and_gives_the_process_its_own_back(monkeypatch):
    for name in heap.USER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    calls = []
    monkeypatch.setattr(heap, "_mallopt", lambda: lambda param, value: calls.append((param, value)) or 1)
    assert heap._applied[0] is False
    with heap.heap_as(True):
        assert heap._applied[0] is True
    assert heap._applied[0] is False
    with heap.heap_as(False):  # nothing trainforge set: nothing to give back
        pass
    assert calls == [(heap.M_MMAP_THRESHOLD, heap.COMPACT_MMAP_THRESHOLD), (heap.M_MMAP_THRESHOLD, heap.GLIBC_MAX_MMAP_THRESHOLD)]


def test_the_trace_counts_the_blocks_a_cpu_heap_maps_on_their_own():
    from trainforge.engine.predict.trace import StepTracer

    tracer = StepTracer()
    with tracer:
        big = torch.ones(9 << 20)  # 36 MiB: glibc maps it whatever its threshold
        small = torch.ones(1 << 20)  # 4 MiB: from the heap once glibc's threshold has risen
        both = big.sum() + small.sum()
    tracer.close()
    assert tracer.peak_mapped == 36 << 20 and tracer.peak >= (40 << 20) and both.item() > 0
