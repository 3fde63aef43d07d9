#!/usr/bin/env bash
# Download, into .whl/ (git-ignored), the wheels benchmarks/gpu_check.py needs on a GPU machine that has torch,
# torchvision and pytest but no Jupyter (this project's lent machine: Python 3.12, x86-64, no network there).
# Then, on that machine: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
           manylinux_2_12_x86_64 manylinux2010_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64)
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]/#/--platform=}" -d .whl nbmake ipykernel
# What that machine already has (and would be shadowed by a second copy): keep its own.
for present in pytest pluggy iniconfig packaging psutil attrs pygments typing_extensions python_dateutil tzdata six; do
  rm -f .whl/"${present}"-[0-9]*.whl
done
du -sh .whl
