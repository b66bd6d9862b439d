"""How big a corpus `trainforge prepare` handles: throughput and peak memory on a multi-GB JSONL.

    python benchmarks/bench_prepare_scale.py --gb 2 [--workers 2] [--format text|prompt_completion] [--out r.json]

Writes a JSONL of ``--gb`` gigabytes (standard-library source cut into ~2 KB rows, each copy
marked so rows stay distinct, the row size of web-text corpora such as C4), trains nothing, and
runs the real CLI, `trainforge prepare`, from a cold cache with defaults (eval 0.05 held out,
max_length 1024) and a fixed tokenizer. While it runs, the resident memory of the whole process
tree (the CLI and its tokenizer workers) is sampled every 0.2 s; the peak of that sum and of the
main process alone are reported with rows/s and MB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROW_CHARS = 2000


def write_corpus(path: Path, gigabytes: float, fmt: str) -> int:
    """Rows cut from the standard library's sources until the file reaches the size; returns the row count."""
    from trainforge.data.sources import iter_stdlib_sources

    pieces = []
    for row in iter_stdlib_sources():
        text = row.data["text"]
        pieces += [text[i : i + ROW_CHARS] for i in range(0, len(text), ROW_CHARS)]
    target, rows, copy = int(gigabytes * 1e9), 0, 0
    with open(path, "w") as f:
        while f.tell() < target:
            for piece in pieces:
                if fmt == "text":
                    obj = {"text": f"# copy {copy}\n{piece}"}
                else:
                    cut = len(piece) // 3
                    obj = {"prompt": f"# copy {copy}\n{piece[:cut]}", "completion": piece[cut:]}
                f.write(json.dumps(obj) + "\n")
                rows += 1
                if rows % 4096 == 0 and f.tell() >= target:
                    break
            copy += 1
    return rows


def tokenizer_for(corpus: Path, out: Path) -> Path:
    """A byte-level BPE (8k) trained on the first rows, saved: prepare then loads it instead of training."""
    from trainforge.model.tokenizer import train_bpe_tokenizer

    def sample():
        with open(corpus) as f:
            for _, line in zip(range(20_000), f):
                yield from (v for v in json.loads(line).values())

    train_bpe_tokenizer(sample(), 8192).save_pretrained(out)
    return out


def tree_rss(proc: psutil.Process) -> tuple[int, int]:
    """(RSS of the process, RSS of it and all its descendants), bytes."""
    try:
        main = proc.memory_info().rss
        total = main + sum(c.memory_info().rss for c in proc.children(recursive=True))
    except psutil.Error:
        return 0, 0
    return main, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--format", choices=("text", "prompt_completion"), default="text")
    ap.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one, removed)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    work = args.dir or Path(tempfile.mkdtemp(prefix="tf-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus.jsonl"
    t = time.perf_counter()
    rows = write_corpus(corpus, args.gb, args.format)
    size = corpus.stat().st_size
    print(f"corpus: {rows:,} rows, {size / 1e9:.2f} GB ({time.perf_counter() - t:.0f}s to write)", flush=True)
    tok_dir = tokenizer_for(corpus, work / "tokenizer")
    cmd = [
        sys.executable, "-m", "trainforge", "prepare",
        "--set", f"data.train={corpus}", "--set", f"model.tokenizer={tok_dir}", "--set", "data.max_documents=null",
        "--set", "data.max_length=1024", "--set", f"data.cache_dir={work / 'cache'}", "--set", f"data.num_workers={args.workers}",
    ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ps = psutil.Process(proc.pid)
    peak_main = peak_tree = 0
    while proc.poll() is None:
        main_rss, total = tree_rss(ps)
        peak_main, peak_tree = max(peak_main, main_rss), max(peak_tree, total)
        time.sleep(0.2)
    seconds = time.perf_counter() - start
    output = proc.stdout.read()
    print(output)
    if proc.returncode:
        sys.exit(f"prepare failed with exit code {proc.returncode}")
    stats = json.loads(next((work / "cache" / "data").glob("*/stats.json")).read_text())
    result = {
        "gb": round(size / 1e9, 3),
        "rows": rows,
        "workers": args.workers,
        "format": args.format,
        "seconds": round(seconds, 1),
        "rows_per_s": round(rows / seconds),
        "mb_per_s": round(size / 1e6 / seconds, 2),
        "tokens": stats["train_tokens"],
        "peak_rss_main_gib": round(peak_main / 2**30, 3),
        "peak_rss_tree_gib": round(peak_tree / 2**30, 3),
        "eval_holdout": stats.get("eval_holdout"),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    if args.dir is None:
        import shutil

        shutil.rmtree(work)


if __name__ == "__main__":
    main()
