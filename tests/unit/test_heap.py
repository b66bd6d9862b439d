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


@needs_glibc
def test_auto_takes_the_compact_heap_where_the_default_heaps_peak_passes_its_share_of_memory():
    share = heap.COMPACT_SHARE
    on, why = heap.compact_heap("auto", "cpu", False, False, environ={}, predicted_share=share + 0.01)
    assert on and why.startswith("on") and f"{share + 0.01:.0%} of memory" in why
    assert heap.compact_heap("auto", "cpu", False, False, environ={}, predicted_share=share - 0.01)[0] is False
    assert heap.compact_heap(False, "cpu", False, False, environ={}, predicted_share=0.95)[0] is False  # as configured
    assert heap.compact_heap("auto", "cuda", False, False, environ={}, predicted_share=0.95)[0] is False


@needs_glibc
def test_plan_and_the_run_take_the_compact_heap_past_the_share_and_price_it(finetune_config, tiny_model_dir, monkeypatch):
    """A CPU step without levers whose default-heap peak is past COMPACT_SHARE of memory is priced with the compact
    heap (the run takes it: settle_heap decides from the same prediction); below the share, the default heap."""
    from trainforge.config.run import RunConfig
    from trainforge.engine.levers import settle_heap
    from trainforge.engine.predict.fit import predict_memory
    from trainforge.hardware.device import Precision

    for name in heap.USER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(heap, "apply_compact_heap", lambda on: None)  # this test process keeps its own heap
    cfg = RunConfig.model_validate({**finetune_config, "model": {"path": str(tiny_model_dir), "method": "lora"}})
    from trainforge.model.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    fp32 = Precision("fp32", None, False)

    def cpu(memory_gib: float) -> HardwareProfile:
        return HardwareProfile(name="this", title="a CPU", memory_gib=memory_gib, peak_tflops={"fp32": 0.1}, bandwidth_gbs=10,
                               bf16=False, kind="cpu", fixed_gib=0.5, compact_fixed_gib=0.4, allocator_overhead=0.15)

    roomy = predict_memory(cfg, tok, fp32, cpu(64), 2, False)
    assert not roomy.compact_heap and roomy.heap_share == pytest.approx(roomy.process / (64 * GIB))
    tight_gib = roomy.process / GIB / (heap.COMPACT_SHARE + 0.05)  # the default heap's peak at 75% of this memory
    tight = predict_memory(cfg, tok, fp32, cpu(tight_gib), 2, False)
    assert tight.compact_heap and tight.heap_share == pytest.approx(roomy.process / (tight_gib * GIB), rel=1e-3)
    assert tight.process < roomy.process and tight.scale == 1 + CPU_COMPACT_HEAP_OVERHEAD
    said = []
    assert settle_heap(cfg, torch.device("cpu"), said.append, tight)["compact_heap"] is True \
        and f"{heap.COMPACT_SHARE + 0.05:.0%} of memory" in said[0]
    assert settle_heap(cfg, torch.device("cpu"), said.append, roomy)["compact_heap"] is False
    off = RunConfig.model_validate({**finetune_config, "model": {"path": str(tiny_model_dir), "method": "lora"},
                                    "train": {**finetune_config.get("train", {}), "compact_heap": False}})
    assert not predict_memory(off, tok, fp32, cpu(tight_gib), 2, False).compact_heap


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


@needs_glibc
def test_with_every_setting_fixed_the_run_traces_its_step_and_decides_as_plan(finetune_config, tiny_model_dir, monkeypatch):
    """No lever left to auto and the micro-batch and checkpointing fixed: the fit traces nothing, so the run's set-up
    traces its step itself (levers.heap_memory) and takes the compact heap past the share, as plan's row says from
    its own prediction at the same settings; with room to spare, neither takes it."""
    from trainforge.config.run import RunConfig
    from trainforge.dist import DistContext
    from trainforge.engine.levers import heap_memory
    from trainforge.hardware.device import Precision
    from trainforge.model.tokenizer import load_tokenizer
    from trainforge.tools.plan import make_plan

    for name in heap.USER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    train = {**finetune_config.get("train", {}), "micro_batch_size": 2, "activation_checkpointing": False, "tiled_mlp": False,
             "activation_offload": False, "device": "cpu", "precision": "fp32"}
    cfg = RunConfig.model_validate({**finetune_config, "model": {"path": str(tiny_model_dir), "method": "lora"}, "train": train})
    tok, fp32 = load_tokenizer(tiny_model_dir), Precision("fp32", None, False)
    # this machine's memory: the rough estimate is far below it, so nothing is traced (the fit's quick path)
    assert heap_memory(cfg, tok, fp32, torch.device("cpu"), DistContext(), None, None) is None
    from trainforge.engine.predict.fit import predict_memory
    from trainforge.hardware.device import this_profile

    default = predict_memory(cfg, tok, fp32, this_profile(torch.device("cpu"), timing=False), 2, False).process
    tight_gib = default / GIB / (heap.COMPACT_SHARE + 0.05)  # the default heap's peak at 75% of this cap
    monkeypatch.setenv("TRAINFORGE_MEMORY_GIB", f"{tight_gib:.3f}")
    tight = heap_memory(cfg, tok, fp32, torch.device("cpu"), DistContext(), None, None)
    assert tight.compact_heap and tight.trace is None and tight.heap_share > heap.COMPACT_SHARE
    row = {d["setting"]: d for d in make_plan(cfg, hardware="this", time_ops=False)["decisions"]}["compact_heap"]
    assert row["choice"] == "true" and f"of memory, past {heap.COMPACT_SHARE:.0%}" in row["why"]
    monkeypatch.delenv("TRAINFORGE_MEMORY_GIB")
    assert {d["setting"]: d for d in make_plan(cfg, hardware="this", time_ops=False)["decisions"]}["compact_heap"]["choice"] == "false"
