#!/usr/bin/env bash
# The Python packages the GPU device image lacks (see the device README), as wheels for its Python 3.12 on
# x86-64 Linux, into .whl/ (ignored by git; name it in the device call's `carry`). The versions are the ones in
# this checkout's .venv, so the GPU runs the code the CPU tests ran. Then, on the device:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
#   python benchmarks/gpu_suite.py --part 1 --out $OUT/gpu
set -euo pipefail
cd "$(dirname "$0")/.."
EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF '/.whl/' "$EXCLUDE" 2>/dev/null || echo '/.whl/' >> "$EXCLUDE"
# gpu_carried.txt: trainforge's own needs the image lacks (pydantic), the suite's baselines (trl, datasets and
# theirs), the GPU extra, bitsandbytes (QLoRA and the 8-bit optimizers: 41 MiB of the 64 MiB a call carries);
# device_rehearsal.sh installs the same list
NAMES=$(cat benchmarks/gpu_carried.txt)
PINS=$(.venv/bin/python benchmarks/pins.py $NAMES)
rm -rf .whl && mkdir -p .whl
PLATFORMS=""
for n in 17 24 27 28 31 34 35; do PLATFORMS="$PLATFORMS --platform manylinux_2_${n}_x86_64"; done
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $PLATFORMS --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $PINS
ls .whl && du -sh .whl
