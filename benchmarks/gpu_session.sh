#!/usr/bin/env bash
# The one device call of a session lent a GPU: 15 minutes of device time in all, the machine's start
# included, so everything that needs the GPU is in this script, most telling first, each stage cut to
# what is left of SESSION_S:
#   1. the CUDA-marked unit tests (varlen/flex attention, Liger, the allocator; not the precision matrix's:
#      it runs the same matrix as stage 2, which logs each path as it ends);
#   2. `trainforge selftest` (every path against its fp32 reference, on the GPU: 82 s on an H200);
#   3. `gpu_suite.py --part first` in the time left (HF, trainforge, then HF + Liger and compiled).
# Here, first: `bash benchmarks/gpu_wheels.sh` (the wheels the image lacks, into .whl/). Then the call:
#   run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=590)
# What comes back in $OUT (7 files): versions.txt, gpu-tests.log, selftest.json, selftest.log, suite.log,
# part-first.json and table.md (the README table: `python benchmarks/gpu_suite.py --table DIR` makes it again).
# The models and runs stay in WORK, outside $OUT: only $OUT's files travel back.
# Rehearsed on a CPU in about 2 minutes: `TINY=1 OUT=/tmp/s bash benchmarks/gpu_session.sh` (the suite's --tiny shapes).
set -uo pipefail
cd "$(dirname "$0")/.."
SESSION_S=${SESSION_S:-570}  # seconds this script may take; the call's timeout_s leaves a little more
OUT=${OUT:-/tmp/gpu-session}
WORK=${WORK:-/tmp/gpu-work}
PY=${PY:-python3}
mkdir -p "$OUT" "$WORK"
left() { echo $((SESSION_S - SECONDS)); }

if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/site:$PWD/src
else
  echo "gpu_session: no .whl/ here (run benchmarks/gpu_wheels.sh and carry .whl): the baselines' packages may be missing" >&2
  export PYTHONPATH=$PWD/src
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  $PY - <<'VERSIONS'
import importlib.metadata as md
for name in ("torch", "triton", "transformers", "peft", "trl", "datasets", "liger-kernel", "torchao", "bitsandbytes"):
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name}: not installed")
VERSIONS
} > "$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"

# Each stage is killed 10 s after its time is up (-k): on 2026-11-26 (an H200) `timeout 100` without it sent one
# SIGTERM to the precision-matrix test, the matrix went on (selftest stopped only the path it arrived in; it stops
# everything now) and never ended, and the call ran out with neither selftest nor the suite started
timeout -k 10 100 $PY -m pytest -v -p no:cacheprovider -m gpu tests/unit/test_doc_attention.py tests/unit/test_kernels.py \
  tests/unit/test_allocator.py > "$OUT/gpu-tests.log" 2>&1
echo "gpu tests: exit $? ($(tail -1 "$OUT/gpu-tests.log")) at ${SECONDS}s"

timeout -k 10 170 $PY -m trainforge selftest --out "$OUT/selftest.json" > "$OUT/selftest.log" 2>&1
echo "selftest: exit $? ($(tail -1 "$OUT/selftest.log")) at ${SECONDS}s"

# the suite's budget is when its last variant may start; one started is cut at the same deadline
BUDGET=$(( $(left) - 20 ))
timeout -k 10 $((BUDGET + 10)) $PY benchmarks/gpu_suite.py --part first --out "$OUT" --work "$WORK" --budget "$BUDGET" \
  --timeout "$BUDGET" ${TINY:+--tiny} > "$OUT/suite.log" 2>&1
echo "suite: exit $? at ${SECONDS}s"
$PY benchmarks/gpu_suite.py --table "$OUT" > "$OUT/table.md" 2>&1
cat "$OUT/table.md"
