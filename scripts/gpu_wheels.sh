#!/usr/bin/env bash
# The wheels the device machine lacks (it has torch, Triton and no network): xdsl at the
# version this checkout's pyproject pins, and its two dependencies, for CPython 3.12 on
# x86-64 Linux, into .whl/ (git-ignored). Then run the device tool with carry [".whl"]:
#   bash scripts/gpu_wheels.sh && <device run> NOVA_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_check.sh ...
set -euo pipefail
cd "$(dirname "$0")/.."
xdsl=$(python3 - <<'PY'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(next(d for d in deps if re.match(r"xdsl\b", d)).replace(" ", ""))
PY
)
get() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "$@"
}
rm -rf .whl && mkdir -p .whl
get "$xdsl"
# its own requirements, as its wheel states them (typing-extensions comes with torch there)
mapfile -t reqs < <(unzip -p .whl/xdsl-*.whl '*/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v -e extra -e typing-extensions | tr -d ' ')
get "${reqs[@]}"
ls .whl
