# One H200 (issue 15 item 4, issue 19's attention), most important first: GPU tests of the attention
# kernels with both KV dtypes, decode attention alone, decode tok/s at 1k / 4k / 32k context with
# bf16 vs fp32 KV on a ${LAYERS:-48} x 32 A3B-shaped model, the landed kernel beside this tree's (when
# $LANDED names a landed tree), fidelity per KV dtype (models: $FID_MODELS, default all six), prefill
# per KV dtype, and (SWEEP=1) a sweep of the decode kernel's two tunables.
source tools/device/setup.sh
echo "== GPU tests"; date
MOEBUS_TEST_GPU=1 timeout 70 python3 -m pytest -q -x -p no:cacheprovider tests/cuda/test_attention.py \
  tests/cuda/test_fused.py tests/cuda/test_e2e.py tests/cuda/test_prefill_tensor_cores.py tests/cuda/test_gemm.py \
  -k "attention or qkv or bf16 or softmax or prefill_then" 2>&1 | tail -2
echo "== decode attention alone"; date
timeout 40 python3 tools/device/attn_kernel_bench.py "this tree" 2>&1 | tee $OUT/kernel.txt
echo "== decode at long context"; date
python3 -m moebus.cli init-model /tmp/attn_m48 --preset a3b --layers ${LAYERS:-48} --experts 32 2>&1 | tail -1
timeout 120 python3 -m moebus.cli bench decode-context --model /tmp/attn_m48 --device cuda --contexts 1024,4096,32768 \
  --kv-dtype bf16,fp32 --tokens 32 --repeats 2 2>&1 | grep -v Warn | tee $OUT/decode_context.txt | tail -8
if [ -n "$LANDED" ]; then
  here=$PWD
  (cd "$LANDED" && PYTHONPATH=/tmp/site:$LANDED timeout 30 python3 $here/tools/device/attn_kernel_bench.py landed) 2>&1 \
    | tee $OUT/kernel_landed.txt
fi
echo "== fidelity"; date
FID_MODELS=$FID_MODELS timeout 60 python3 tools/device/tc_fidelity.py /tmp/fid split/split,off/split,split/split/bf16,off/split/bf16 2>&1 | grep -v Warn | tee $OUT/fidelity.txt | grep FIDELITY
echo "== prefill per KV dtype"; date
timeout 60 python3 tools/device/attn_prefill.py /tmp/attn_m48 ${PREFILL:-2048,8192} 2>&1 | grep PREFILL | tee $OUT/prefill.txt
if [ -n "$SWEEP" ]; then echo "== sweep"; timeout 90 python3 tools/device/attn_kernel_bench.py --sweep 2>&1 | tee $OUT/sweep.txt; fi
date
