"""log.profile_steps gives a time split and a trace; TensorBoard gets the same scalars as metrics.jsonl."""

from __future__ import annotations

import json

import pytest
import torch

from rich.console import Console

from trainforge.config.run import RunConfig
from trainforge.engine.trainer import train
from trainforge.metrics.console import ConsoleReporter
from trainforge.metrics.profile import busy_seconds, describe_split, op_kind, time_split
from trainforge.metrics.report import write_report
from trainforge.metrics.tracker import read_metrics


def test_profiled_step_splits_time_and_writes_a_trace(finetune_config, tmp_path):
    finetune_config["log"]["profile_steps"] = [3]
    train(RunConfig.model_validate(finetune_config), tmp_path / "run", ConsoleReporter(Console(quiet=True)))
    profiles = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "profile" in r]
    assert [p["step"] for p in profiles] == [3]
    assert set(profiles[0]["profile"]) == {"data_s", "forward_s", "backward_s", "optimizer_s"}
    assert all(v > 0 for v in profiles[0]["profile"].values())
    trace = json.loads((tmp_path / "run" / "profile" / "step-00000003.json").read_text())
    assert trace["traceEvents"]
    ops = profiles[0]["profile_ops"]  # on a CPU: the host's ops by self time, no device busy share
    assert ops["device_busy"] is None and ops["op_seconds"] > 0
    assert ops["by_kind_s"]["matmul"] > 0 and ops["by_kind_s"]["optimizer"] > 0
    assert ops["top"] and abs(sum(ops["by_kind_s"].values()) - ops["op_seconds"]) < 1e-9
    page = write_report([tmp_path / "run"]).read_text()  # the report shows the profiled step
    assert "<h2>Profiled steps</h2>" in page and "(CPU: host ops)" in page and "matmul" in page.split("Profiled steps")[1]


@pytest.mark.parametrize("name, kind", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas", "matmul"),
    ("nvjet_tst_192x192_64x3_2x1_v_bz_coopB_TNT", "matmul"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn", "matmul"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>>", "attention"),
    ("triton_tem_fused_flex_attention_0", "attention"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>", "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("Memcpy HtoD (Pinned -> Device)", "copy"),
    ("triton_poi_fused_add_mul_silu_0", "other"),
    ("_rms_norm_forward_kernel", "other"),
    ("aten::addmm", "matmul"),
    ("aten::_foreach_mul_", "optimizer"),
])
def test_kernels_and_ops_are_told_apart_by_name(name, kind):
    assert op_kind(name) == kind


def test_busy_time_counts_overlapping_kernels_once():
    assert busy_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0), (3.2, 3.5)]) == pytest.approx(3.0)
    assert busy_seconds([]) == 0.0


def test_time_split_shares_and_busy_fraction():
    split = time_split([("nvjet_a", 0.6), ("flash_fwd_kernel", 0.2), ("nvjet_a", 0.1), ("triton_poi_x", 0.1)], wall_s=1.25, busy_s=1.0)
    assert split["by_kind_s"] == pytest.approx({"matmul": 0.7, "attention": 0.2, "other": 0.1})
    assert split["top"][0] == {"name": "nvjet_a", "seconds": pytest.approx(0.7), "share": pytest.approx(0.7)}
    assert split["device_busy"] == pytest.approx(0.8)
    assert describe_split(split).startswith("device busy 80% of the step; kernel time: matmul 70%, attention 20%, other 10%")


def test_tensorboard_scalars(finetune_config, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(RunConfig.model_validate(finetune_config), tmp_path / "run", ConsoleReporter(Console(quiet=True)))
    events = EventAccumulator(str(tmp_path / "run" / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/tokens_per_s", "train/mfu", "eval/eval_loss"} <= tags
    logged = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert [e.step for e in events.Scalars("train/loss")] == [r["step"] for r in logged]
    assert [round(e.value, 5) for e in events.Scalars("train/loss")] == [round(r["loss"], 5) for r in logged]


def test_device_time_leaves_out_the_annotations_on_the_device_timeline():
    """kineto puts user annotations (the optimizer's step, compile's graph calls) on the CUDA timeline
    beside the kernels they span: they are neither kernels nor busy time."""
    from types import SimpleNamespace

    from trainforge.metrics.profile import device_kernels

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(name="nvjet_a", device_type=cuda, is_user_annotation=False),
              SimpleNamespace(name="Optimizer.step#AdamW.step", device_type=cuda, is_user_annotation=True),
              SimpleNamespace(name="## Call CompiledFxGraph f1 ##", device_type=cuda, is_user_annotation=True),
              SimpleNamespace(name="aten::mm", device_type=cpu, is_user_annotation=False)]
    assert [e.name for e in device_kernels(events)] == ["nvjet_a"]
