#!/usr/bin/env bash
# Fetch, on a machine with package-index access, the wheels that the GPU device image lacks, so that
# scripts/device_check.sh can run otdus there with no network. The device's python3 (3.12) already holds
# torch, transformers, safetensors, huggingface_hub, rich, pyyaml, numpy and scipy; it has no POT
# and no pydantic, and its typer may be older than ours. Wheels go to .whl/ (git-ignored through
# .git/info/exclude); carry ".whl" in the device run and device_check.sh installs them from there.
#
#   scripts/device_wheels.sh            # then: device run with carry [".whl"], command scripts/device_check.sh
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
PKGS=(POT==0.9.7.post1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
      typing-inspection==0.4.5 typer==0.29.2 annotated-doc shellingham)
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${PKGS[@]}"
du -sh .whl
