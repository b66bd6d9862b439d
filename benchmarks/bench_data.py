"""Data pipeline benchmark: tokenization throughput, packing efficiency, data wait in training.

    python benchmarks/bench_data.py [--copies 4] [--workers 2] [--out results.json]

1. Tokenization: `trainforge prepare`'s pipeline (cold cache) against
   `datasets.load_dataset("json") + Dataset.map(batched=True, num_proc=workers)` with the
   same tokenizer, on the same prompt/completion JSONL (stdlib functions, `--copies` times),
   both producing input ids plus a completion mask. Reported as rows/s and the ratio.
2. Packing: share of row capacity holding real tokens at max_length 1024 on that data,
   best-fit-decreasing vs one example per row (padded per batch of 8, random or length-grouped).
3. Data wait: a short training run on packed rows; time the step waits for data / step time.

Needs the dev extra `datasets` (pip install 'trainforge[bench]').
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def write_corpus(path: Path, copies: int) -> int:
    from trainforge.data.sources import iter_python_functions

    rows = [r.data for r in iter_python_functions()]
    with open(path, "w") as f:
        for c in range(copies):
            for r in rows:  # copies differ by a marker so content hashes stay distinct
                f.write(json.dumps({"prompt": f"# copy {c}\n" + r["prompt"], "completion": r["completion"]}) + "\n")
    return len(rows) * copies


def bench_tokenize(corpus: Path, tokenizer_dir: Path, workers: int, tmp: Path, reps: int = 3) -> dict:
    """Both pipelines from a cold cache, alternating, ``reps`` times; medians (this VM is noisy)."""
    import datasets
    from transformers import AutoTokenizer

    from trainforge.config.data import DataSettings
    from trainforge.data.prepare import prepare_data
    from trainforge.model.tokenizer import load_tokenizer

    datasets.disable_progress_bars()
    tok = load_tokenizer(tokenizer_dir)
    hf_tok = AutoTokenizer.from_pretrained(tokenizer_dir)

    def tokenize(batch):  # what TRL's prompt/completion preprocessing does: ids + completion mask
        p = hf_tok(batch["prompt"])["input_ids"]
        c = hf_tok(batch["completion"], add_special_tokens=False)["input_ids"]
        ids = [a + b + [hf_tok.eos_token_id] for a, b in zip(p, c)]
        mask = [[0] * len(a) + [1] * (len(b) + 1) for a, b in zip(p, c)]
        return {"input_ids": [i[:1025] for i in ids], "completion_mask": [m[:1025] for m in mask]}

    tf_times, hf_times, rows = [], [], 0
    for rep in range(reps):
        cfg = DataSettings(train=str(corpus), eval=None, format="prompt_completion", max_length=1024,
                           cache_dir=tmp / f"tf-cache-{rep}", num_workers=workers)
        t = time.perf_counter()
        rows = prepare_data(cfg, tok, seed=0, log=lambda *_: None).stats["train_rows"]
        tf_times.append(time.perf_counter() - t)

        t = time.perf_counter()
        ds = datasets.load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(tmp / f"hf-cache-{rep}"))
        ds = ds.map(tokenize, batched=True, num_proc=workers if workers > 1 else None, remove_columns=ds.column_names)
        hf_times.append(time.perf_counter() - t)
        assert len(ds) == rows
    tf_s, hf_s = float(np.median(tf_times)), float(np.median(hf_times))
    return {"rows": rows, "workers": workers, "trainforge_s": tf_s, "datasets_map_s": hf_s, "trainforge_rows_per_s": rows / tf_s,
            "datasets_rows_per_s": rows / hf_s, "speed_ratio": hf_s / tf_s, "trainforge_runs": tf_times, "datasets_runs": hf_times}


def bench_packing(corpus: Path, tokenizer_dir: Path, tmp: Path) -> dict:
    from trainforge.config.data import DataSettings
    from trainforge.data.loader import RowCollator, TrainLoader
    from trainforge.data.packing import build_rows
    from trainforge.data.prepare import prepare_data
    from trainforge.model.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    cfg = DataSettings(train=str(corpus), eval=None, max_length=1024, cache_dir=tmp / "tf-cache", num_workers=1)
    store = prepare_data(cfg, tok, seed=0, log=lambda *_: None).train
    index = np.arange(len(store))
    out = {}
    for name, packing, grouped in (("packed_bfd", True, False), ("unpacked_random", False, False), ("unpacked_grouped", False, True)):
        t = time.perf_counter()
        rows = build_rows(store, index, packing, 1024)
        build_s = time.perf_counter() - t
        loader = TrainLoader(rows, RowCollator(store, tok.pad_token_id, packing, 1024), 8, seed=0, group_by_length=grouped)
        out[name] = {"rows": len(rows), "efficiency": loader.padding_efficiency(), "build_s": build_s}
    return out


def bench_data_wait(tmp: Path) -> dict:
    from rich.console import Console

    from trainforge.config.run import RunConfig, load_config
    from trainforge.engine.trainer import train
    from trainforge.metrics.console import ConsoleReporter

    cfg = load_config(None, ["data.train=builtin:python-functions", "data.max_documents=1500", "data.too_long=truncate",
                             "train.max_steps=40", "train.eval_every=null", "data.eval=null", "log.sample_prompt=null",
                             f"data.cache_dir={tmp / 'tf-cache'}"])
    result = train(RunConfig.model_validate(cfg.model_dump()), tmp / "run", ConsoleReporter(Console(quiet=True)))
    s = result.summary
    return {"steps": s["steps"], "data_wait_s": s["data_wait_s"], "train_time_s": s["train_time_s"],
            "data_wait_share": s["data_wait_s"] / s["train_time_s"], "tokens_per_s": s["tokens_per_s"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tf-bench-"))
    try:
        from trainforge.model.tokenizer import train_bpe_tokenizer

        corpus = tmp / "functions.jsonl"
        n = write_corpus(corpus, args.copies)
        texts = (json.loads(line)["prompt"] + json.loads(line)["completion"] for line in open(corpus))
        train_bpe_tokenizer(texts, 8192).save_pretrained(tmp / "tok")
        print(f"corpus: {n:,} prompt/completion rows, {corpus.stat().st_size / 1e6:.1f} MB; workers {args.workers}")
        results = {}
        for workers in sorted({1, args.workers}):
            t = results[f"tokenize_{workers}proc"] = bench_tokenize(corpus, tmp / "tok", workers, tmp / f"w{workers}")
            print(f"tokenize, {workers} process(es): trainforge {t['trainforge_s']:.2f}s ({t['trainforge_rows_per_s']:,.0f} rows/s) | "
                  f"datasets.map {t['datasets_map_s']:.2f}s ({t['datasets_rows_per_s']:,.0f} rows/s) | "
                  f"trainforge is {t['speed_ratio']:.2f}x (medians of 3)")
        results["packing"] = bench_packing(corpus, tmp / "tok", tmp)
        for name, p in results["packing"].items():
            print(f"packing {name:>17}: {p['rows']:,} rows, {p['efficiency']:.1%} of capacity is real tokens ({p['build_s']:.2f}s)")
        results["data_wait"] = bench_data_wait(tmp)
        d = results["data_wait"]
        print(f"data wait: {d['data_wait_share']:.2%} of step time ({d['data_wait_s']:.3f}s of {d['train_time_s']:.1f}s, {d['steps']} steps)")
        if args.out:
            args.out.write_text(json.dumps(results, indent=2))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
