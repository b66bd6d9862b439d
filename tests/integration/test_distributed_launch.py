"""Ending a data-parallel job: no hang after the last step, the workers' exit codes through
``--nproc``, errors printed once, and two torchrun launchers forming one 2-node job."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from integration_helpers import cli_command, root_conftest, run_cli, show
from safetensors.torch import load_file
from test_distributed import dist_config, final_weights, one_process_run, records

from trainforge.rundir.checkpoint import scan_checkpoints

write_config = root_conftest().write_config
END_BOUND_S = 60  # from summary.json (or a stop signal) to exit takes seconds; a hang at exit runs into this
START_BOUND_S = 300  # two processes importing torch and building a tiny model: tens of seconds on a loaded machine


def quick_config(tmp: Path, tiny_tokenizer_dir, toy_data_dir, **train) -> Path:
    cfg = dist_config(tiny_tokenizer_dir, toy_data_dir, 2)
    cfg["train"].update({"max_steps": 2, **train})
    cfg["checkpoint"] = {"every_steps": None}
    cfg["data"]["eval"] = None
    return write_config(tmp / "quick.yaml", cfg)


def test_consecutive_two_process_runs_all_exit(tmp_path, tiny_tokenizer_dir, toy_data_dir):
    """The end of a run once hung in 4 of 20 tries (gloo's threads and the GIL at teardown): every one of several
    runs must exit 0 within a bound counted from its summary.json (the run's last file), so that a slow start on a
    loaded machine is not taken for a hang. Three runs here; the suite's other 2-process runs are bounded too."""
    config = quick_config(tmp_path, tiny_tokenizer_dir, toy_data_dir)
    for i in range(3):
        run = tmp_path / f"run{i}"
        argv, env = cli_command(["train", config, "--output", run], nproc=2)
        with open(tmp_path / f"out{i}", "w+") as out, open(tmp_path / f"err{i}", "w+") as err:
            proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=out, stderr=err, text=True)
            started, ended = time.monotonic(), None
            while proc.poll() is None:
                if ended is None and (run / "summary.json").is_file():
                    ended = time.monotonic()
                late = (ended is not None and time.monotonic() - ended > END_BOUND_S) or time.monotonic() - started > 600
                if late:
                    proc.kill()
                    proc.wait()
                    pytest.fail(f"run {i} did not exit within {END_BOUND_S}s of its summary.json (or 600 s in all)")
                time.sleep(0.2)
            out.seek(0), err.seek(0)
            said = subprocess.CompletedProcess(argv, proc.returncode, out.read(), err.read())
        assert said.returncode == 0, show(said)
        assert (run / "summary.json").is_file()


def test_nproc_exits_with_the_workers_code_and_prints_a_shared_error_once(tmp_path, tiny_tokenizer_dir, toy_data_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\nnot json\n')
    config = quick_config(tmp_path, tiny_tokenizer_dir, toy_data_dir)
    proc = run_cli(["train", config, "--output", tmp_path / "run", "--nproc", 2, "--set", f"data.train={bad}"], tmp_path)
    assert proc.returncode == 2, show(proc)
    assert proc.stderr.count("bad.jsonl:2") == 1, show(proc)  # rank 0 prints it; rank 1 exits quietly
    # torchrun's report is one line naming the rank, not its ChildFailedError traceback below the error
    assert "Traceback" not in proc.stderr and "failed first, exit code 2" in proc.stderr, show(proc)

    # a loss that blows up: every rank stops alike on the non-finite guard, exit code 3, said once
    proc = run_cli(
        ["train", config, "--output", tmp_path / "nan", "--nproc", 2, "--set", "optim.lr=1.0e30",
         "--set", "train.max_steps=8", "--set", "train.max_skipped_steps=1", "--set", "optim.max_grad_norm=null"],
        tmp_path,
    )
    assert proc.returncode == 3, show(proc)
    assert proc.stderr.count("error:") == 1, show(proc)


def test_sigterm_to_nproc_saves_and_exits_75(tmp_path, tiny_tokenizer_dir, toy_data_dir):
    config = quick_config(tmp_path, tiny_tokenizer_dir, toy_data_dir, max_steps=100000)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainforge", "train", str(config), "--output", str(run), "--nproc", "2"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + START_BOUND_S
    while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text().strip():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=END_BOUND_S)
    assert proc.returncode == 75, f"{proc.returncode}\n{out}\n{err}"
    assert err.count("stopped:") == 1 and err.count("SIGTERM: finishing the current step") == 1, err  # rank 0's, once
    assert "Traceback" not in err and "SignalException" not in err, err  # torchrun's own, after the workers' line
    assert scan_checkpoints(run / "checkpoints")[0], "no checkpoint saved on SIGTERM"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_launchers(config: Path, run: Path, cwd: Path, faults: dict | None = None) -> list[subprocess.Popen]:
    """Two torchrun launchers, one process each, meeting at a c10d rendezvous: a 2-node job on one machine."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    runner = Path(__file__).with_name("fault_runner.py")
    procs = []
    for node in range(2):
        entry = ["-m", "trainforge"] if faults is None else [str(runner), json.dumps(faults)]
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", f"job{port}",
            *entry, "train", str(config), "--output", str(run),
        ]
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float = 180) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each launcher."""
    outs = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, *o) for p, o in zip(procs, outs)]


def test_two_nodes_train_like_one_process_and_resume_after_a_node_dies(tmp_path, tmp_path_factory, tiny_tokenizer_dir, toy_data_dir):
    config = write_config(tmp_path / "nodes.yaml", dist_config(tiny_tokenizer_dir, toy_data_dir, 2))
    done = wait_all(node_launchers(config, tmp_path / "two", tmp_path))
    assert all(rc == 0 for rc, _, _ in done), done

    # one process, twice the micro-batch (the same global batch of 8 rows): the same weights
    one = one_process_run(tmp_path_factory, tiny_tokenizer_dir, toy_data_dir)
    for name, value in final_weights(one).items():
        torch.testing.assert_close(final_weights(tmp_path / "two")[name], value, rtol=0, atol=1e-5, msg=name)

    # node 1's process dies (SIGKILL) in step 5; node 0 must stop within the bound; step 3 was saved
    run = tmp_path / "killed"
    t0 = time.monotonic()
    done = wait_all(node_launchers(config, run, tmp_path, faults={"rank": 1, "signal_in_step": [5, "SIGKILL"]}))
    assert all(rc != 0 for rc, _, _ in done), done
    assert time.monotonic() - t0 < 120
    assert [c.step for c in scan_checkpoints(run / "checkpoints")[0]] == [3]

    done = wait_all(node_launchers(config, run, tmp_path))
    assert all(rc == 0 for rc, _, _ in done), done
    assert "resuming from" in done[0][1] + done[1][1]
    expected = load_file(tmp_path / "two" / "final" / "model.safetensors")
    got = load_file(run / "final" / "model.safetensors")
    for name, value in expected.items():
        assert torch.equal(got[name], value), f"weight {name} differs after the resume"
    assert records(run) == records(tmp_path / "two")


def test_ranks_wait_for_rank_0_tokenizing_longer_than_the_collective_timeout(tmp_path, tiny_tokenizer_dir, toy_data_dir):
    """The others wait while rank 0 tokenizes (main_first): a large corpus takes hours, and the wait once failed
    at train.dist_timeout_s (600 s), ending the job with a gloo traceback before any step."""
    # the timeout binds every later collective too (the fit broadcast, the model's all-gather), where two ranks of a
    # loaded 2-core test machine drifted apart by over 2 s: 6 s leaves them room; checkpointing fixed, so rank 0 does
    # not trace the step while the others wait. Neither is what this test is about
    config = quick_config(tmp_path, tiny_tokenizer_dir, toy_data_dir, dist_timeout_s=6, activation_checkpointing=False)
    pause = tmp_path / "go"
    args = ["train", config, "--output", tmp_path / "run", "--set", f"data.cache_dir={tmp_path / 'cache'}"]
    argv, env = cli_command(args, faults={"rank": 0, "pause_in_build": str(pause)}, nproc=2)
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + START_BOUND_S
    while not Path(f"{pause}.paused").exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    time.sleep(12)  # rank 0 still building: twice the collective timeout
    pause.touch()
    out, err = proc.communicate(timeout=START_BOUND_S)
    assert proc.returncode == 0, f"{proc.returncode}\n{out}\n{err}"
    assert (tmp_path / "run" / "summary.json").is_file()


def test_a_config_error_every_rank_meets_is_one_line_under_nproc(tmp_path, tiny_tokenizer_dir, toy_data_dir):
    """optim.offload: cpu on CPU (as adamw_8bit without bitsandbytes): rank 0 printed the error, then rank 1, stopped by
    torchrun while it waited for rank 0 to speak, printed an OptimizerUnavailable/SystemExit traceback and a false
    "stopped: SIGTERM" line. Now the waiting rank ends quietly with the same code."""
    config = quick_config(tmp_path, tiny_tokenizer_dir, toy_data_dir)
    proc = run_cli(["train", config, "--output", tmp_path / "run", "--nproc", 2, "--set", "optim.offload=cpu"], tmp_path)
    assert proc.returncode == 2, show(proc)
    assert proc.stderr.count("optim.offload: cpu moves the optimizer state off a GPU") == 1, show(proc)
    assert "Traceback" not in proc.stderr and "stopped:" not in proc.stderr and "SystemExit" not in proc.stderr, show(proc)
    # the error, and torchrun's one line naming the rank (not torch's own log lines saying it again)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and "failed first, exit code 2" in lines[1], show(proc)
