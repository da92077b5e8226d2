# source tools/device/setup.sh — the GPU machine's image lacks a few wheels; they travel in .whl/
# A multi-branch call (lead12_call.sh) installs them once and sets MOEBUS_SITE_READY=1, so branch scripts
# started side by side do not race on /tmp/site.
if [ -z "$MOEBUS_SITE_READY" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export MOEBUS_CACHE_DIR=/tmp/moebus-cache
if [ -z "$MOEBUS_SITE_READY" ]; then
  nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv
  python3 -c "import numba, numpy, numba.cuda as c; print('numba', numba.__version__, 'numpy', numpy.__version__, 'gpus', len(c.gpus))"
fi
