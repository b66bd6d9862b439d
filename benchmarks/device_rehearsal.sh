#!/usr/bin/env bash
# The GPU image's Python stack on this CPU: what would break there, found before device time is spent.
#
# The device image (the device tool's KINDS.md, read 2026-11) has Python 3.12, torch 2.11.0 (CUDA 13),
# triton 3.6.0, transformers 5.17.0, tokenizers 0.23.2, accelerate 1.15.0, numpy 2.5.2, safetensors 0.8.0;
# the packages it lacks travel as wheels at this checkout's .venv versions (gpu_wheels.sh), installed here
# at the same versions. PyPI's torch 2.11 wheel is the CUDA build (about 5 GB with its CUDA libraries);
# it runs on a CPU. Then it runs, in that environment:
#   1. the unit tests;
#   2. `gpu_session.sh` with the suite's tiny shapes (TINY=1): the device call itself, with
#      `trainforge selftest` (every CPU path against its reference) and `gpu_suite.py --part first`;
#   3. `gpu_suite.py --tiny`, parts 1 to 3, and the table.
# About 15 minutes on 2 cores once the environment exists (the first run installs it: a few minutes).
#
#   bash benchmarks/device_rehearsal.sh [VENV] [OUT]      # defaults: /tmp/device-venv /tmp/device-rehearsal
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-/tmp/device-venv}
OUT=${2:-/tmp/device-rehearsal}
IMAGE="torch==2.11.0 triton==3.6.0 transformers==5.17.0 tokenizers==0.23.2 accelerate==1.15.0 numpy==2.5.2 safetensors==0.8.0"
# what gpu_wheels.sh carries; and peft, on the image at a version not read: this checkout's
CARRIED="$(cat benchmarks/gpu_carried.txt) peft"
TESTING="pytest-xdist pyarrow tensorboard matplotlib pyyaml typer rich"
if [ ! -f "$VENV/.rehearsal-installed" ]; then  # a marker: an interrupted install is redone, not reused
  PY312=""  # the first python3.12 that runs (a pyenv shim is on PATH even where 3.12 is not the selected version)
  for c in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
    "$c" -c "" 2>/dev/null && { PY312=$c; break; }
  done
  [ -n "$PY312" ] || { echo "device_rehearsal: needs python3.12 (the image's Python)" >&2; exit 2; }
  # shellcheck disable=SC2086
  PINS=$(.venv/bin/python benchmarks/pins.py $CARRIED) || { echo "device_rehearsal: run make install first" >&2; exit 2; }
  [ -x "$VENV/bin/python" ] || "$PY312" -m venv "$VENV" || exit 2
  # shellcheck disable=SC2086
  "$VENV/bin/pip" install -q $IMAGE $PINS $TESTING || exit 2
  touch "$VENV/.rehearsal-installed"
fi
"$VENV/bin/pip" install -q --no-deps -e . || exit 2
mkdir -p "$OUT"
"$VENV/bin/python" benchmarks/pins.py torch triton transformers peft trl liger-kernel torchao | tee "$OUT/versions.txt"
status=0
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist worksteal tests/unit 2>&1 | tee "$OUT/unit.log" | tail -15
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
TINY=1 OUT="$OUT/session" WORK="$OUT/session-work" PY="$VENV/bin/python" bash benchmarks/gpu_session.sh > "$OUT/session.log" 2>&1 || status=1
grep -q "selftest: all" "$OUT/session/selftest.log" || status=1
tail -1 "$OUT/session/selftest.log"
for part in 1 2 3; do
  PYTHONPATH=src "$VENV/bin/python" benchmarks/gpu_suite.py --tiny --part $part --out "$OUT/gpu" > "$OUT/gpu-part-$part.log" 2>&1 || status=1
done
# a variant that failed is a row in the table, not an exit code: look for "failed"
PYTHONPATH=src "$VENV/bin/python" benchmarks/gpu_suite.py --table "$OUT/gpu" | tee "$OUT/table.md" | grep -E "failed|skipped" || true
grep -q "| failed" "$OUT/table.md" "$OUT/session/table.md" && status=1
echo "device_rehearsal: $([ $status -eq 0 ] && echo passed || echo FAILED); logs in $OUT"
exit $status
