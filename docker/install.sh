#!/bin/sh
# The image's install steps, also replayed by tests/docker in a fresh venv:
#   install.sh VENV SRC    a venv at VENV with moebus from SRC and its runtime dependencies, plus the
#                          extras in $EXTRAS (default "cuda": numba-cuda's CUDA 12 toolkit wheels,
#                          which carry NVVM and libdevice for compiling the kernels at start)
set -eu
venv=${1:?usage: install.sh VENV SRC}
src=${2:?usage: install.sh VENV SRC}
extras=${EXTRAS-cuda}
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --no-cache-dir --upgrade pip
"$venv/bin/python" -m pip install --no-cache-dir "$src${extras:+[$extras]}"
