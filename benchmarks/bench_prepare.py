"""Tokenizing a corpus: `trainforge prepare` against Hugging Face `datasets` on the same fast tokenizer.

    python benchmarks/bench_prepare.py --gb 0.05 0.2 [--workers 2] [--out r.json]

For each size, writes a JSONL text corpus (bench_prepare_scale.write_corpus: ~2 KB rows of standard-library
source), trains one byte-level BPE on it, then from cold caches runs, each in its own process:

- trainforge: the real CLI, ``trainforge prepare`` (no eval held out, max_length 1024, ``--workers`` processes);
- datasets: ``load_dataset("json", ...)["train"].map(tokenize, batched=True, num_proc=WORKERS)`` with the same
  tokenizer loaded by ``AutoTokenizer`` (a fast tokenizer), written to its Arrow cache as ``datasets`` does.

Reported per tool: seconds, tokens, tokens/s, and the peak memory of the whole process tree (the process and its
workers, sampled every 0.2 s) as the sum of their RSS and as the sum of their PSS (pages the forked workers share
with the parent counted once); then the ratio of tokens/s. Memory constant in corpus size shows as the same peak at
both sizes. ``tokenizer_ceiling``: the same tokenizer's batch calls alone on the same rows in as many processes
(nothing read, parsed or stored in the timing), and each tool's tokens/s as a share of it: what is left to win.

``--resume-shards N`` (0: off) then measures a killed prepare on the largest size, the corpus cut into N JSONL
shards of a directory: an uninterrupted ``prepare`` (T seconds, its cache entry kept); the same command into a
fresh cache, SIGKILLed at ``--kill-at`` (0.6) of T; the same command again (T2 seconds). Reported: the shards
the rerun reused, the work redone as ``(kill_at x T + T2 - T) / T`` (start-up included: what the user waits
for twice), and whether the resumed entry's files equal the uninterrupted entry's byte for byte.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prepare_scale import tokenizer_for, tree_rss, write_corpus  # noqa: E402

HF_SCRIPT = """
import json, sys
from datasets import load_dataset
from transformers import AutoTokenizer
corpus, tok_dir, cache, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
tok = AutoTokenizer.from_pretrained(tok_dir)
assert tok.is_fast
ds = load_dataset("json", data_files=corpus, cache_dir=cache)["train"]
out = ds.map(lambda b: tok(b["text"]), batched=True, num_proc=workers, remove_columns=["text"])
print(json.dumps({"tokens": sum(len(ids) for ids in out.with_format(None)["input_ids"])}))
"""


CEILING_SCRIPT = """
import json, os, sys, time
from multiprocessing import get_context
from transformers import AutoTokenizer
corpus, tok_dir, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.environ["TOKENIZERS_PARALLELISM"] = "false"
backend = AutoTokenizer.from_pretrained(tok_dir).backend_tokenizer
def share(k):  # every workers-th row from the k-th; only the encode calls are timed
    tokens, seconds, batch = 0, 0.0, []
    def encode():
        nonlocal tokens, seconds
        t = time.perf_counter()
        tokens += sum(len(e.ids) for e in backend.encode_batch_fast(batch))
        seconds += time.perf_counter() - t
        batch.clear()
    with open(corpus) as f:
        for i, line in enumerate(f):
            if i % workers == k:
                batch.append(json.loads(line)["text"])
                if len(batch) == 1000:
                    encode()
    encode()
    return tokens, seconds
with get_context("fork").Pool(workers) as pool:
    parts = pool.map(share, range(workers))
print(json.dumps({"tokens": sum(t for t, _ in parts), "seconds": max(s for _, s in parts)}))
"""


def tokenizer_ceiling(corpus: Path, tok_dir: Path, workers: int) -> dict:
    """The tokenizer's own speed on ``corpus`` in ``workers`` processes: the time of its batch calls alone (no
    start-up, reading, parsing or storing), offsets skipped: no tool that calls it can tokenize faster."""
    out = subprocess.run([sys.executable, "-c", CEILING_SCRIPT, str(corpus), str(tok_dir), str(workers)],
                         capture_output=True, text=True, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    return {"tokens": r["tokens"], "encode_s": round(r["seconds"], 1), "tokens_per_s": round(r["tokens"] / r["seconds"])}


def tree_pss(proc: psutil.Process) -> int:
    """Proportional set size of the process and its descendants, bytes: pages shared between them (the forked
    workers' copy of what the parent imported) counted once, where a sum of RSS counts them in every process.
    Read from ``/proc/PID/smaps_rollup`` (the kernel's sum: a few milliseconds; parsing ``smaps`` of a process that
    imported torch takes far longer and, sampled often, takes CPU from the run measured); 0 where it is missing."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            with open(f"/proc/{p.pid}/smaps_rollup") as f:
                total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:")), 0)
        except (OSError, psutil.Error):
            pass
    return total


def timed(cmd: list[str]) -> tuple[float, int, int, str]:
    """(seconds, peak RSS and peak PSS of the process tree in bytes, output) of a command run to its end."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ps, peak, peak_pss, samples = psutil.Process(proc.pid), 0, 0, 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(ps)[1])
        if samples % 5 == 0:  # PSS once a second: each read walks every mapping of every process in the kernel
            peak_pss = max(peak_pss, tree_pss(ps))
        samples += 1
        time.sleep(0.2)
    seconds = time.perf_counter() - start
    output = proc.stdout.read()
    if proc.returncode:
        sys.exit(f"{cmd[:4]} failed with exit code {proc.returncode}:\n{output[-3000:]}")
    return seconds, peak, peak_pss, output


def one_size(work: Path, gb: float, workers: int, resume_shards: int = 0, kill_at: float = 0.6) -> dict:
    corpus = work / "corpus.jsonl"
    rows = write_corpus(corpus, gb, "text")
    tok_dir = tokenizer_for(corpus, work / "tokenizer")
    tf_s, tf_rss, tf_pss, _ = timed(prepare_cmd(corpus, tok_dir, work / "cache", workers))
    stats = json.loads(next((work / "cache" / "data").glob("*/stats.json")).read_text())
    tf_tokens = stats["train_tokens"] + stats["train_sequences"]  # stored tokens (inputs + each sequence's last)
    hf_s, hf_rss, hf_pss, out = timed([sys.executable, "-c", HF_SCRIPT, str(corpus), str(tok_dir), str(work / "hf"), str(workers)])
    hf_tokens = json.loads(out.strip().splitlines()[-1])["tokens"]
    ceiling = tokenizer_ceiling(corpus, tok_dir, workers)
    shutil.rmtree(work / "hf", ignore_errors=True)  # datasets' Arrow copy: disk, before the resume's two caches
    resumed = resume_after_kill(work, corpus, tok_dir, workers, resume_shards, kill_at) if resume_shards else None
    return {
        "gb": round(corpus.stat().st_size / 1e9, 3), "rows": rows, "workers": workers, "resume": resumed,
        "trainforge": {"seconds": round(tf_s, 1), "tokens": tf_tokens, "tokens_per_s": round(tf_tokens / tf_s),
                       "peak_rss_gib": round(tf_rss / 2**30, 3), "peak_pss_gib": round(tf_pss / 2**30, 3),
                       "share_of_ceiling": round(tf_tokens / tf_s / ceiling["tokens_per_s"], 3)},
        "datasets": {"seconds": round(hf_s, 1), "tokens": hf_tokens, "tokens_per_s": round(hf_tokens / hf_s),
                     "peak_rss_gib": round(hf_rss / 2**30, 3), "peak_pss_gib": round(hf_pss / 2**30, 3),
                     "share_of_ceiling": round(hf_tokens / hf_s / ceiling["tokens_per_s"], 3)},
        "tokenizer_ceiling": ceiling,
        "ratio_tokens_per_s": round((tf_tokens / tf_s) / (hf_tokens / hf_s), 2),
    }


def prepare_cmd(train: Path, tok_dir: Path, cache: Path, workers: int) -> list[str]:
    """The real CLI's ``prepare`` of ``train`` into ``cache`` (no eval held out, max_length 1024)."""
    return [
        sys.executable, "-m", "trainforge", "prepare",
        "--set", f"data.train={train}", "--set", f"model.tokenizer={tok_dir}", "--set", "data.max_documents=null",
        "--set", "data.eval=null", "--set", "data.max_length=1024", "--set", f"data.cache_dir={cache}",
        "--set", f"data.num_workers={workers}",
    ]  # fmt: skip


def split_corpus(corpus: Path, out: Path, shards: int) -> Path:
    """``corpus`` cut into ``shards`` files of consecutive rows under ``out`` (the order of a directory listing)."""
    out.mkdir(parents=True)
    with open(corpus) as f:
        lines = f.readlines()
    per = -(-len(lines) // shards)
    for i in range(shards):
        (out / f"part-{i:03d}.jsonl").write_text("".join(lines[i * per : (i + 1) * per]))
    return out


def entry_files(cache: Path) -> dict[str, bytes]:
    """The published cache entry's files (relative path -> bytes); exactly one entry is expected."""
    (entry,) = [p for p in (cache / "data").iterdir() if not p.name.startswith(".")]
    return {str(p.relative_to(entry)): p.read_bytes() for p in sorted(entry.rglob("*")) if p.is_file()}


def resume_after_kill(work: Path, corpus: Path, tok_dir: Path, workers: int, shards: int, kill_at: float) -> dict:
    """An uninterrupted prepare of the sharded corpus, then one SIGKILLed at ``kill_at`` of its time and resumed."""
    train = split_corpus(corpus, work / "shards", shards)
    full_s, _, _, _ = timed(prepare_cmd(train, tok_dir, work / "cache-full", workers))
    proc = subprocess.Popen(prepare_cmd(train, tok_dir, work / "cache-killed", workers),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(kill_at * full_s)
    killed_before_end = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    again_s, _, _, out = timed(prepare_cmd(train, tok_dir, work / "cache-killed", workers))
    reused = int(out.split("reusing ")[1].split(" of ")[0]) if "reusing " in out else 0
    return {
        "shards": shards, "kill_at": kill_at, "killed_before_end": killed_before_end,
        "uninterrupted_s": round(full_s, 1), "resumed_s": round(again_s, 1), "shards_reused": reused,
        "redone_fraction": round((kill_at * full_s + again_s - full_s) / full_s, 3),
        "byte_identical": entry_files(work / "cache-full") == entry_files(work / "cache-killed"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, nargs="+", default=[0.05, 0.2])
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--resume-shards", type=int, default=0, help="measure a SIGKILLed prepare resumed, on the largest "
                    "size cut into this many shards (0: off)")
    ap.add_argument("--kill-at", type=float, default=0.6, help="the SIGKILL, as a fraction of the uninterrupted time")
    args = ap.parse_args()
    results = []
    for gb in args.gb:
        work = Path(tempfile.mkdtemp(prefix="tf-bench-prepare-"))
        try:
            shards = args.resume_shards if gb == max(args.gb) else 0
            results.append(one_size(work, gb, args.workers, shards, args.kill_at))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(json.dumps(results[-1], indent=2), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
