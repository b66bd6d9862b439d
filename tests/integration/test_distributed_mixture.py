"""A mixture of sources by token shares under two processes: the same training as one process (losses per source
included), and exact resume after a rank is killed (slow: four short runs)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from integration_helpers import root_conftest, run_cli, show

from test_distributed import assert_close_records, assert_close_weights, dist_config, final_weights, records

conftest = root_conftest()


def mixture_config(tmp: Path, tokenizer_dir: Path, data_dir: Path, micro_batch_size: int) -> dict:
    cfg = dist_config(tokenizer_dir, data_dir, micro_batch_size)
    long = conftest.write_jsonl(tmp / "long.jsonl", [{"prompt": r["prompt"], "completion": r["completion"] * 4}
                                                     for r in conftest.toy_prompt_completions(150, seed=11)])
    cfg["data"].update(train=[{"path": str(data_dir / "pc_train.jsonl"), "share": 0.6}, {"path": str(long), "share": 0.4}],
                       eval=0.1, cache_dir=str(tmp / "cache"))
    return cfg


def test_a_mixture_trains_alike_on_two_processes_and_resumes_exactly(tmp_path, tiny_tokenizer_dir, toy_data_dir):
    write = conftest.write_config
    one = run_cli(["train", write(tmp_path / "one.yaml", mixture_config(tmp_path, tiny_tokenizer_dir, toy_data_dir, 4)),
                   "--output", tmp_path / "one"], tmp_path)
    assert one.returncode == 0, show(one)
    two_config = write(tmp_path / "two.yaml", mixture_config(tmp_path, tiny_tokenizer_dir, toy_data_dir, 2))
    two = run_cli(["train", two_config, "--output", tmp_path / "two"], tmp_path, nproc=2)
    assert two.returncode == 0, show(two)
    # the same global batch of the same mixture: the same records, the losses per source included
    got, expected = records(tmp_path / "two"), records(tmp_path / "one")
    assert_close_records(got, expected)
    assert all("loss/pc_train" in r and "loss/long" in r for r in got if "loss" in r)
    assert all("eval_loss/long" in r for r in got if "eval_loss" in r)
    assert_close_weights(final_weights(tmp_path / "two"), final_weights(tmp_path / "one"))
    sources = json.loads((tmp_path / "two" / "summary.json").read_text())["data"]["sources"]
    assert [round(s["share"], 2) for s in sources] == [0.6, 0.4]

    # rank 1 killed inside step 5: resumed from step 3, it ends with the uninterrupted run's weights, bit for bit
    run = tmp_path / "killed"
    proc = run_cli(["train", two_config, "--output", run], tmp_path, faults={"rank": 1, "signal_in_step": [5, "SIGKILL"]}, nproc=2)
    assert proc.returncode != 0, show(proc)
    proc = run_cli(["train", two_config, "--output", run], tmp_path, nproc=2)
    assert proc.returncode == 0 and "step-00000003" in proc.stdout, show(proc)
    for name, value in final_weights(tmp_path / "two").items():
        assert torch.equal(final_weights(run)[name], value), f"weight {name} differs"
    assert_close_records(records(run), records(tmp_path / "two"))
