"""Two processes under torchrun (gloo, CPU): the same training as one process with the same global
batch, exact resume after a rank is killed, FSDP2 with sharded checkpoints, and no hang when a
rank fails."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch
from integration_helpers import root_conftest, run_cli, show
from safetensors.torch import load_file

from trainforge.rundir.checkpoint import scan_checkpoints
from trainforge.config.run import RunConfig
from trainforge.engine.resume import ResumeError

write_config = root_conftest().write_config
from trainforge.metrics.tracker import MEASURED_FIELDS

TIMING = MEASURED_FIELDS  # wall-clock and machine fields: the only ones allowed to differ
FAILURE_BOUND_S = 60  # a failing rank must end the whole job well within this


def dist_config(tokenizer_dir: Path, data_dir: Path, micro_batch_size: int) -> dict:
    """Global batch 8 rows: 2 processes x micro-batch 2 x accumulation 2, or 1 x 4 x 2."""
    return {
        "model": {
            "init": dict(root_conftest().TINY_LLAMA_INIT),
            "tokenizer": str(tokenizer_dir),
        },
        "data": {"train": str(data_dir / "pc_train.jsonl"), "eval": str(data_dir / "pc_eval.jsonl"), "max_length": 64},
        "train": {"max_steps": 6, "micro_batch_size": micro_batch_size, "grad_accum": 2, "precision": "fp32", "device": "cpu"},
        "optim": {"lr": 1.0e-3, "warmup_steps": 2},
        "checkpoint": {"every_steps": 3, "keep_last": 2},
        "log": {"every_steps": 1, "example_indices": True, "report": False},
    }


def one_process_run(tmp_path_factory, tokenizer_dir: Path, data_dir: Path) -> Path:
    """``dist_config`` in one process with twice the micro-batch (the same global batch of 8 rows),
    trained in this process once per session: the reference of this module and of test_distributed_launch."""
    from rich.console import Console

    from trainforge.engine.trainer import train
    from trainforge.metrics.console import ConsoleReporter

    run = tmp_path_factory.getbasetemp() / "one-process-reference"
    if not (run / "summary.json").is_file():
        train(RunConfig.model_validate(dist_config(tokenizer_dir, data_dir, 4)), run, ConsoleReporter(Console(quiet=True)))
    return run


def records(run: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in (run / "metrics.jsonl").read_text().splitlines()]


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "final" / "model.safetensors")


def assert_close_records(got: list[dict], expected: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for g, e in zip(got, expected):
        assert g.keys() == e.keys(), (g, e)
        for k in e:
            if isinstance(e[k], float):
                assert g[k] == pytest.approx(e[k], abs=1e-5, rel=1e-5), (k, g, e)
            else:
                assert g[k] == e[k], (k, g, e)


def assert_close_weights(got: dict, expected: dict, atol: float = 1e-5) -> None:
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=atol, msg=k)


@pytest.fixture(scope="module")
def two_proc(tmp_path_factory, tiny_tokenizer_dir, toy_data_dir) -> tuple[Path, Path]:
    """(config, run directory) of an uninterrupted 2-process DDP run, started with --nproc."""
    tmp = tmp_path_factory.mktemp("ddp")
    config = write_config(tmp / "ddp.yaml", dist_config(tiny_tokenizer_dir, toy_data_dir, 2))
    proc = run_cli(["train", config, "--output", tmp / "run", "--nproc", 2], tmp)
    assert proc.returncode == 0, show(proc)
    return config, tmp / "run"


def test_two_processes_train_like_one_with_the_same_global_batch(two_proc, tmp_path_factory, tiny_tokenizer_dir, toy_data_dir):
    _, run2 = two_proc
    run1 = one_process_run(tmp_path_factory, tiny_tokenizer_dir, toy_data_dir)

    # same losses, grad norms, eval losses, token counts and examples (in the same order) at every step
    assert_close_records(records(run2), records(run1))
    assert [r["step"] for r in records(run2) if "loss" in r] == list(range(1, 7))  # rank 0 alone wrote them
    assert_close_weights(final_weights(run2), final_weights(run1))
    summary = json.loads((run2 / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["distributed"] == "ddp"
    assert summary["tokens"] == json.loads((run1 / "summary.json").read_text())["tokens"]


def test_killed_rank_resumes_exactly_and_needs_the_same_world_size(two_proc, tmp_path, monkeypatch):
    config, reference = two_proc
    run = tmp_path / "run"

    # rank 1 dies (SIGKILL) inside step 5: torchrun stops rank 0 too; step-3 is the newest checkpoint
    t0 = time.monotonic()
    proc = run_cli(["train", config, "--output", run], tmp_path, faults={"rank": 1, "signal_in_step": [5, "SIGKILL"]}, nproc=2)
    assert proc.returncode != 0, show(proc)
    assert time.monotonic() - t0 < FAILURE_BOUND_S, show(proc)
    assert [c.step for c in scan_checkpoints(run / "checkpoints")[0]] == [3]
    # rank 0 only saw its peer go: events.jsonl (and doctor) say so, not gloo's "connection closed" as its own error
    errors = [e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines()) if e["event"] == "error"]
    assert errors[-1]["type"] == "PeerFailure" and "another process of the job" in errors[-1]["message"], errors

    # another world size: refused with a message, before the model loads (an 8B model's minutes)
    import trainforge.engine.setup as setup_module

    monkeypatch.setattr(setup_module, "build_run_model", lambda *a, **k: pytest.fail("the model loaded before the refusal"))
    with pytest.raises(ResumeError, match=r"written by 2 process.*set train\.global_batch_size: 8 \(the checkpoint's global batch\)"):
        from rich.console import Console

        from trainforge.engine.trainer import train
        from trainforge.metrics.console import ConsoleReporter

        import yaml

        train(RunConfig.model_validate(yaml.safe_load(Path(config).read_text())), run, ConsoleReporter(Console(quiet=True)))

    proc = run_cli(["train", config, "--output", run], tmp_path, nproc=2)
    assert proc.returncode == 0, show(proc)
    assert "resuming from" in proc.stdout and "step-00000003" in proc.stdout, show(proc)
    expected = torch.load(reference / "checkpoints" / "step-00000006" / "state.pt")
    got = torch.load(run / "checkpoints" / "step-00000006" / "state.pt")
    for name, value in expected["model"].items():
        assert torch.equal(got["model"][name], value), f"weight {name} differs"
    for pid, pstate in expected["optimizer"]["state"].items():
        for key, value in pstate.items():
            assert torch.equal(got["optimizer"]["state"][pid][key], value), f"optimizer state {pid}.{key} differs"
    assert got["loader"] == expected["loader"] and len(got["rng_ranks"]) == 2
    assert records(run) == records(reference)


def test_preempted_on_two_processes_a_run_continues_on_one_with_the_same_global_batch(
    two_proc, tmp_path, tiny_tokenizer_dir, toy_data_dir
):
    """A job preempted on 8 GPUs comes back on 4: with train.global_batch_size the accumulation follows the
    processes (2 x 2 x 2 rows a step, then 2 x 4 x 1), each step trains the same rows, and the run ends as the
    uninterrupted two-process run does. Before, any other process count was refused."""
    _, reference = two_proc
    cfg = dist_config(tiny_tokenizer_dir, toy_data_dir, 2)
    del cfg["train"]["grad_accum"]
    cfg["train"]["global_batch_size"] = 8
    # the batches eval_max_batches: auto chose for 2 processes (at these tiny sizes it rounds to one batch per process)
    cfg["train"]["eval_max_batches"] = 2
    config = write_config(tmp_path / "elastic.yaml", cfg)
    run = tmp_path / "run"
    proc = run_cli(["train", config, "--output", run], tmp_path, faults={"rank": 1, "signal_in_step": [5, "SIGKILL"]}, nproc=2)
    assert proc.returncode != 0, show(proc)
    assert [c.step for c in scan_checkpoints(run / "checkpoints")[0]] == [3]

    proc = run_cli(["train", config, "--output", run], tmp_path)  # one process
    assert proc.returncode == 0, show(proc)
    assert "written by 2 process(es), continued on 1: micro-batch 2 x accumulation 4 x 1" in proc.stdout, show(proc)
    assert_close_records(records(run), records(reference))
    assert_close_weights(final_weights(run), final_weights(reference))
    saved = torch.load(run / "checkpoints" / "step-00000006" / "state.pt")
    assert saved["grad_accum"] == 4 and "rng_ranks" not in saved
    # the whole run's MFU: steps 1-3 on two processes had twice the peak of steps 4-6 (it took the last stretch's)
    summary = json.loads((run / "summary.json").read_text())
    first = torch.load(run / "checkpoints" / "step-00000003" / "state.pt")["counters"]
    last = saved["counters"]
    two = first["peak_flop_s"] / first["loop_time_s"]
    one = (last["peak_flop_s"] - first["peak_flop_s"]) / (last["loop_time_s"] - first["loop_time_s"])
    assert two == pytest.approx(2 * one, rel=1e-6), (two, one)
    assert summary["mfu"] == pytest.approx(summary["tokens"] * summary["flops_per_token"] / last["peak_flop_s"])
    resumed = [e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines()) if e["event"] == "resume"]
    assert resumed[-1]["processes"] == 1 and resumed[-1]["checkpoint_processes"] == 2, resumed
    # 8 rows on 3 processes of micro-batch 2: 6 rows a pass do not divide them
    from trainforge.engine.resume import resumed_grad_accum

    with pytest.raises(ResumeError, match="on 3 processes: 6 rows per pass do not divide it"):
        resumed_grad_accum(saved, 3)


def fake_back_off(step_dir: Path, micro_batch_size: int, grad_accum: int) -> None:
    """Make a checkpoint's state say the run backed off to ``micro_batch_size`` x ``grad_accum`` after running out of
    memory (as on a GPU; a CPU run never does), its checksum rewritten to match."""
    from trainforge.rundir.checkpoint import file_checksum

    state = torch.load(step_dir / "state.pt", weights_only=False)
    state.update(micro_batch_size=micro_batch_size, grad_accum=grad_accum)
    torch.save(state, step_dir / "state.pt")
    meta = json.loads((step_dir / "meta.json").read_text())
    record = meta["files"]["state.pt"]
    record.update({k: file_checksum(step_dir / "state.pt") for k in record if k != "bytes"}, bytes=(step_dir / "state.pt").stat().st_size)
    (step_dir / "meta.json").write_text(json.dumps(meta))


def test_a_run_backed_off_after_out_of_memory_continues_on_more_processes_at_its_smaller_micro_batch(
    two_proc, tmp_path, tiny_tokenizer_dir, toy_data_dir
):
    """Micro-batch 8 x 1 on one GPU backed off to 2 x 4; on 2 processes 8 x 2 rows a pass do not divide the global
    batch of 8, 2 x 2 do: the run continues there at its backed-off micro-batch and trains the 2-process run's steps.
    Before, setup refused the configured micro-batch (a ConfigError to change train.micro_batch_size, which the
    checkpoint binds); and auto, which keeps the checkpoint's micro-batch, got the same advice."""
    _, reference = two_proc
    cfg = dist_config(tiny_tokenizer_dir, toy_data_dir, 8)
    del cfg["train"]["grad_accum"]
    cfg["train"].update(global_batch_size=8, eval_max_batches=2)
    config = write_config(tmp_path / "elastic.yaml", cfg)
    run = tmp_path / "run"
    proc = run_cli(["train", config, "--output", run], tmp_path, faults={"signal_in_step": [5, "SIGKILL"]})
    assert proc.returncode != 0, show(proc)
    fake_back_off(run / "checkpoints" / "step-00000003", 2, 4)

    proc = run_cli(["train", config, "--output", run, "--nproc", 2], tmp_path)
    assert proc.returncode == 0, show(proc)
    assert "written by 1 process(es), continued on 2: micro-batch 2 x accumulation 2 x 2" in proc.stdout, show(proc)
    trained = lambda r: [x for x in records(r) if "loss" in x]  # noqa: E731 (eval batches follow the configured micro-batch)
    assert_close_records(trained(run), trained(reference))
    assert_close_weights(final_weights(run), final_weights(reference))
    # its checkpoints resume on these processes too, and say why the micro-batch is smaller than configured
    proc = run_cli(["train", config, "--output", run, "--nproc", 2, "--set", "train.max_steps=7"], tmp_path)
    assert proc.returncode == 0, show(proc)
    assert "micro-batch 2 x accumulation 2, as chosen after running out of memory" in proc.stdout, show(proc)

    # micro_batch_size auto kept the checkpoint's 8: on 2 processes it cannot divide the 8 rows, and the refusal says so
    auto = write_config(tmp_path / "auto.yaml", {**cfg, "train": {**cfg["train"], "micro_batch_size": "auto"}})
    proc = run_cli(["train", auto, "--output", tmp_path / "auto", "--set", "train.max_steps=3"], tmp_path)
    assert proc.returncode == 0 and "micro_batch_size auto -> 8" in proc.stdout, show(proc)
    proc = run_cli(["train", auto, "--output", tmp_path / "auto", "--nproc", 2], tmp_path)
    assert proc.returncode == 2, show(proc)
    assert "cannot resume a global batch of 8 rows (micro-batch 8 x accumulation 1 x 1 process(es)) on 2 processes" in proc.stderr, show(proc)


def test_fsdp2_trains_like_ddp_and_resumes_from_sharded_checkpoints(two_proc, tmp_path):
    config, reference = two_proc
    run = tmp_path / "fsdp"
    fsdp = ["train", config, "--output", run, "--set", "train.distributed=fsdp"]
    proc = run_cli(fsdp, tmp_path, faults={"rank": 1, "signal_in_step": [5, "SIGKILL"]}, nproc=2)
    assert proc.returncode != 0, show(proc)
    (step3,) = scan_checkpoints(run / "checkpoints")[0]
    assert (step3.path / "sharded" / ".metadata").is_file() and step3.meta["distributed"] == "fsdp"
    # sharded state is bound to its processes, whatever the global batch: refused before anything loads
    proc = run_cli(["train", config, "--output", run], tmp_path)  # one process
    assert proc.returncode == 2 and "FSDP's sharded state resumes on the processes that wrote it" in proc.stderr, show(proc)

    proc = run_cli(fsdp, tmp_path, nproc=2)
    assert proc.returncode == 0, show(proc)
    assert "fsdp over 2 processes" in proc.stdout and "resuming from" in proc.stdout, show(proc)
    assert_close_records(records(run), records(reference))
    assert_close_weights(final_weights(run), final_weights(reference))  # final/ is a plain HF directory


def test_a_failing_rank_ends_the_job_with_its_error(two_proc, tmp_path):
    config, _ = two_proc
    t0 = time.monotonic()
    proc = run_cli(
        ["train", config, "--output", tmp_path / "run"],
        tmp_path,
        faults={"rank": 1, "raise_in_step": [2, "injected failure on rank 1"]},
        nproc=2,
        timeout=FAILURE_BOUND_S,
    )
    assert proc.returncode not in (0, -signal.SIGKILL), show(proc)
    assert time.monotonic() - t0 < FAILURE_BOUND_S
    assert proc.stderr.count("RuntimeError: injected failure on rank 1") == 1, show(proc)


@pytest.mark.parametrize("mode,tiled", [("ddp", False), ("fsdp", False), ("fsdp", True)])
def test_activation_checkpointing_under_ddp_and_fsdp2_trains_like_plain_ddp(two_proc, tmp_path, mode, tiled):
    """Checkpointing is switched on before the wrap: under FSDP2 each recomputed layer is one shard unit. With the
    tiled MLP too (its backward recomputes each tile on the layer's gathered weights and hands them their summed
    gradients, which FSDP2 reduce-scatters): rows of 2 x 64 tokens in tiles of 64."""
    config, reference = two_proc
    run = tmp_path / mode
    args = ["train", config, "--output", run, "--set", f"train.distributed={mode}", "--set", "train.activation_checkpointing=true",
            "--set", f"train.tiled_mlp={str(tiled).lower()}"]
    proc = run_cli(args, tmp_path, nproc=2)
    assert proc.returncode == 0, show(proc)
    assert f"{mode} over 2 processes" in proc.stdout and "activation checkpointing" in proc.stdout, show(proc)
    assert ("decoder MLPs run in tiles of 64 tokens" in proc.stdout) == tiled, show(proc)
    assert_close_records(records(run), records(reference))
    assert_close_weights(final_weights(run), final_weights(reference))


def test_global_batch_size_sets_the_accumulation_for_the_process_count(two_proc, tmp_path):
    """The reference is 2 processes x micro-batch 2 x accumulation 2; global_batch_size 8 must derive the 2."""
    config, reference = two_proc
    run = tmp_path / "global"
    args = ["train", config, "--output", run, "--set", "train.global_batch_size=8"]  # the config's grad_accum 2 agrees
    proc = run_cli(args, tmp_path, nproc=2)
    assert proc.returncode == 0, show(proc)
    assert "micro-batch 2 x accumulation 2 x 2 processes" in proc.stdout, show(proc)
    assert_close_records(records(run), records(reference))
    bad = run_cli(["train", config, "--output", tmp_path / "bad", "--set", "train.global_batch_size=5"], tmp_path)
    assert bad.returncode == 2 and "not a multiple of micro_batch_size x processes = 2 x 1 = 2" in " ".join(bad.stderr.split()), show(bad)


@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_preference_on_two_processes_trains_like_one_with_the_same_global_batch(tmp_path, tiny_tokenizer_dir, toy_data_dir, objective):
    """A preference objective divides by the pairs of all processes, and its rewards (and KTO's reference point)
    are all-reduced: 2 processes x micro-batch 2 x accumulation 2 give the records and weights of 1 x 4 x 2."""
    from rich.console import Console

    from trainforge.engine.trainer import train
    from trainforge.metrics.console import ConsoleReporter

    def config(micro_batch_size: int) -> dict:
        cfg = dist_config(tiny_tokenizer_dir, toy_data_dir, micro_batch_size)
        files = ("kto_train.jsonl", "kto_eval.jsonl") if objective == "kto" else ("pref_train.jsonl", "pref_eval.jsonl")
        cfg["data"].update(train=str(toy_data_dir / files[0]), eval=str(toy_data_dir / files[1]))
        cfg["train"].update(objective=objective, eval_every=3, eval_max_batches=None)  # all eval pairs, whatever the batch
        cfg["log"]["example_indices"] = False
        return cfg

    train(RunConfig.model_validate(config(4)), tmp_path / "one", ConsoleReporter(Console(quiet=True)))
    proc = run_cli(["train", write_config(tmp_path / "ddp.yaml", config(2)), "--output", tmp_path / "two", "--nproc", 2], tmp_path)
    assert proc.returncode == 0, show(proc)
    got, expected = records(tmp_path / "two"), records(tmp_path / "one")
    assert "reward_accuracy" in expected[1] and "eval_reward_accuracy" in expected[-1]
    assert_close_records(got, expected)
    assert_close_weights(final_weights(tmp_path / "two"), final_weights(tmp_path / "one"))
