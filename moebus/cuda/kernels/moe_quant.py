"""Expert FFNs from quantized experts (fp8 or int4 blobs, common/quant_layout.py), dequantized in
registers: out[pair_out[j]] = down(silu(gate x) * up x), as ``moe.expert_ffn_ref`` for bf16 experts.
Same work split as moe_ffn.py (warp per output row, runs of pairs on one slot inside a chunk, a
negative placement entry read from the mapped host store), so a decode step moves 1 byte (fp8) or
~0.56 byte (int4) per weight instead of 2.

The blob is read as 8-byte words: 8 fp8 codes or 16 4-bit codes, never straddling a block or group
(rows are multiples of 16 values, blocks and groups 128). Per word a lane forms sum_c x_c * code_c
and scales once: fp8 by its block's scale; int4 as s * sum x_c q_c + m * sum x_c.

Shapes: T tokens, D hidden, I expert intermediate, J listed pairs, B blob bytes."""
from __future__ import annotations

import functools
import math

import numpy as np

from moebus.common.quant import BLOCK
from moebus.common.quant_layout import ExpertLayout
from moebus.cuda.kernels.compat import WARP, bits_as_f32, blocks, cuda, device, float32, int32, kernel, threads, \
    warp_sum_many
from moebus.cuda.kernels.elementwise import silu_ref
from moebus.cuda.kernels.launch import ceil_div, require
from moebus.cuda.kernels.moe_ffn import MAX_CHUNK, MAX_GRID_Y, WARPS, _placement, _run_length


VALUES_PER_WORD = {"fp8": 8, "int4": 16}
E4M3_RESCALE = float32(2.0**120)  # float32 exponent bias 127 - e4m3 bias 7
LO32 = np.uint64(0xFFFFFFFF)
GATE_UP_SUMS = 2 * MAX_CHUNK  # per-lane sums of the gate_up kernel: gate's, then up's
MAG7, SIGN8, NIBBLE, BYTE = np.uint64(0x7F), np.uint64(0x80), np.uint64(0xF), np.uint64(0xFF)
SHIFT_MANT, SHIFT_SIGN, SHIFT_HI = np.uint64(20), np.uint64(24), np.uint64(32)


# -- numpy reference ----------------------------------------------------------------------------------

def expert_ffn_quant_ref(x, pair_token, pair_slot, pair_out, arena, layout: ExpertLayout, out, store=None):
    # x (T, D) float32; pair_* (J,) int32; arena (slots, B) uint8; out (P, D) float32. A negative
    # slot reads row -1 - slot of the host store; rows of out not listed are left alone.
    x = np.asarray(x, dtype=np.float32)
    pair_token, pair_slot, pair_out = (np.asarray(a) for a in (pair_token, pair_slot, pair_out))
    for slot in np.unique(pair_slot):
        pairs = np.nonzero(pair_slot == slot)[0]
        blob = arena[int(slot)] if slot >= 0 else store[-1 - int(slot)]
        gate, up, down = layout.dequantize(np.asarray(blob))
        xs = x[pair_token[pairs]]
        out[pair_out[pairs]] = (silu_ref(xs @ gate.T) * (xs @ up.T)) @ down.T
    return out


# -- device: reading one word ------------------------------------------------------------------------

@device
def _e4m3(code):
    # exact, subnormals included: e4m3's exponent and mantissa placed in a float32 and rescaled
    return bits_as_f32(((code & MAG7) << SHIFT_MANT) | ((code & SIGN8) << SHIFT_SIGN)) * E4M3_RESCALE


@device
def _f32_at(words, slot, index):
    """The float32 at 4-byte index ``index`` of a row of 8-byte words."""
    u = words[slot, index >> 1]
    return bits_as_f32((u >> np.uint64(32 * (index & 1))) & LO32)


@device
def _codes_fp8(u, buf):
    for c in range(8):
        buf[c] = _e4m3((u >> np.uint64(8 * c)) & BYTE)


@device
def _codes_int4(u, buf):
    for c in range(16):
        buf[c] = float32((u >> np.uint64(4 * c)) & NIBBLE)


@device
def _params_fp8(words, slot, scale_index, row, col, cols):
    """(scale, minimum) of the block holding (row, col); scale_index counts 4-byte floats."""
    per_row = (cols + BLOCK - 1) // BLOCK
    return _f32_at(words, slot, scale_index + (row // BLOCK) * per_row + col // BLOCK), float32(0.0)


@device
def _params_int4(words, slot, scale_index, row, col, cols):
    groups = (cols + BLOCK - 1) // BLOCK
    u = words[slot, (scale_index >> 1) + row * groups + col // BLOCK]  # (scale, minimum): one word
    return bits_as_f32(u & LO32), bits_as_f32(u >> SHIFT_HI)


FORMATS = {"fp8": (_codes_fp8, _params_fp8), "int4": (_codes_int4, _params_int4)}


# -- device: the two GEMVs ------------------------------------------------------------------------------

@functools.cache
def _gate_up_kernel(fmt: str, chunk: int):
    read_codes, read_params = FORMATS[fmt]
    per_word = VALUES_PER_WORD[fmt]

    @device
    def gate_up_word(gate_raw, up_raw, col, x, tokens, acc, gate_buf, up_buf, words, slot, gate_scale, up_scale,
                     row, hidden):
        """One word of a gate row and of an up row into the chunk's sums (acc: gate's, then up's)."""
        read_codes(gate_raw, gate_buf)
        read_codes(up_raw, up_buf)
        g_scale, g_min = read_params(words, slot, gate_scale, row, col, hidden)
        u_scale, u_min = read_params(words, slot, up_scale, row, col, hidden)
        for t in range(chunk):
            g = float32(0.0)
            u = float32(0.0)
            total = float32(0.0)
            for c in range(per_word):
                xv = x[tokens[t], col + c]
                g += xv * gate_buf[c]
                u += xv * up_buf[c]
                total += xv
            acc[t] += g_scale * g + g_min * total
            acc[chunk + t] += u_scale * u + u_min * total

    @kernel
    def quant_gate_up(x, pair_token, pair_slot, arena, store, hidden, inter, gate_word, up_word, gate_scale,
                      up_scale, first_pair, h):
        j = first_pair + cuda.blockIdx.y
        run = _run_length(pair_slot, j, chunk)
        if run == 0:
            return  # the whole block: no reduction is skipped by part of it
        words, slot = _placement(arena, store, pair_slot[j])
        lane = cuda.threadIdx.x % WARP
        warps = cuda.blockDim.x // WARP
        first = cuda.blockIdx.x * warps + cuda.threadIdx.x // WARP
        stride = cuda.gridDim.x * warps
        row_words = hidden // per_word
        tokens = cuda.local.array(chunk, int32)
        for t in range(chunk):  # past the run: recompute its last pair, never store it
            tokens[t] = pair_token[j + min(t, run - 1)]
        acc = cuda.local.array(GATE_UP_SUMS, float32)
        gate_buf = cuda.local.array(per_word, float32)
        up_buf = cuda.local.array(per_word, float32)
        for start in range(0, inter, stride):
            row = min(start + first, inter - 1)
            for t in range(2 * chunk):
                acc[t] = float32(0.0)
            gate_row, up_row = gate_word + row * row_words, up_word + row * row_words
            for word in range(lane, row_words, 2 * WARP):  # two words in flight per matrix (linear.py)
                second = min(word + WARP, row_words - 1)
                gate0, up0 = words[slot, gate_row + word], words[slot, up_row + word]
                gate1, up1 = words[slot, gate_row + second], words[slot, up_row + second]
                gate_up_word(gate0, up0, word * per_word, x, tokens, acc, gate_buf, up_buf, words, slot, gate_scale,
                             up_scale, row, hidden)
                if word + WARP < row_words:
                    gate_up_word(gate1, up1, second * per_word, x, tokens, acc, gate_buf, up_buf, words, slot,
                                 gate_scale, up_scale, row, hidden)
            warp_sum_many(acc, 2 * chunk)
            if lane == 0 and start + first < inter:
                for t in range(chunk):
                    if t < run:
                        g = acc[t]
                        h[j + t, row] = g / (float32(1.0) + math.exp(-g)) * acc[chunk + t]

    return quant_gate_up


@functools.cache
def _down_kernel(fmt: str, chunk: int):
    read_codes, read_params = FORMATS[fmt]
    per_word = VALUES_PER_WORD[fmt]

    @device
    def down_word(raw, col, h, rows, acc, w_buf, words, slot, down_scale, row, inter):
        read_codes(raw, w_buf)
        scale, minimum = read_params(words, slot, down_scale, row, col, inter)
        for t in range(chunk):
            dot = float32(0.0)
            total = float32(0.0)
            for c in range(per_word):
                hv = h[rows[t], col + c]
                dot += hv * w_buf[c]
                total += hv
            acc[t] += scale * dot + minimum * total

    @kernel
    def quant_down(h, pair_slot, pair_out, arena, store, hidden, inter, down_word_at, down_scale, first_pair, out):
        j = first_pair + cuda.blockIdx.y
        run = _run_length(pair_slot, j, chunk)
        if run == 0:
            return
        words, slot = _placement(arena, store, pair_slot[j])
        lane = cuda.threadIdx.x % WARP
        warps = cuda.blockDim.x // WARP
        first = cuda.blockIdx.x * warps + cuda.threadIdx.x // WARP
        stride = cuda.gridDim.x * warps
        row_words = inter // per_word
        rows = cuda.local.array(chunk, int32)  # rows of h: this run's pairs
        for t in range(chunk):
            rows[t] = j + min(t, run - 1)
        acc = cuda.local.array(MAX_CHUNK, float32)
        w_buf = cuda.local.array(per_word, float32)
        for start in range(0, hidden, stride):
            row = min(start + first, hidden - 1)
            for t in range(chunk):
                acc[t] = float32(0.0)
            base = down_word_at + row * row_words
            for word in range(lane, row_words, 2 * WARP):
                second = min(word + WARP, row_words - 1)
                raw0, raw1 = words[slot, base + word], words[slot, base + second]
                down_word(raw0, word * per_word, h, rows, acc, w_buf, words, slot, down_scale, row, inter)
                if word + WARP < row_words:
                    down_word(raw1, second * per_word, h, rows, acc, w_buf, words, slot, down_scale, row, inter)
            warp_sum_many(acc, chunk)
            if lane == 0 and start + first < hidden:
                for t in range(chunk):
                    if t < run:
                        out[pair_out[j + t], row] = acc[t]

    return quant_down


def expert_ffn_quant_cuda(x, pair_token, pair_slot, pair_out, arena, layout: ExpertLayout, out, scratch, stream=0,
                          store=None):
    """expert_ffn_quant_ref on device arrays. ``arena`` and ``store``: (slots, B) uint8 blobs of
    ``layout``; ``scratch``: (J, I) float32 for the activations between the two kernels."""
    hidden, inter = layout.hidden, layout.inter
    num_pairs = pair_slot.shape[0]
    require("x", x, np.float32, shape=(None, hidden))
    for name, table in (("pair_token", pair_token), ("pair_slot", pair_slot), ("pair_out", pair_out)):
        require(name, table, np.int32, shape=(num_pairs,))
    require("arena", arena, np.uint8, shape=(None, layout.blob_bytes))
    store = arena if store is None else store
    require("store", store, np.uint8, shape=(None, layout.blob_bytes))
    require("out", out, np.float32, shape=(None, hidden))
    require("scratch", scratch, np.float32, shape=(None, inter))
    if num_pairs > scratch.shape[0]:
        raise ValueError(f"{num_pairs} pairs: more than the {scratch.shape[0]} scratch rows")
    if num_pairs == 0:
        return out
    chunk = min(MAX_CHUNK, x.shape[0])  # one token's pairs have distinct experts: runs <= tokens
    per_word = VALUES_PER_WORD[layout.dtype]
    gate_w, up_w, down_w, gate_s, up_s, down_s = layout.kernel_words()  # 4-byte offsets
    word = 2  # the kernels read 8-byte words: two 4-byte offsets each
    arena_words, store_words = arena.view(np.uint64), store.view(np.uint64)
    gate_up, down = _gate_up_kernel(layout.dtype, chunk), _down_kernel(layout.dtype, chunk)
    h = scratch[:num_pairs]
    block = threads(WARPS * WARP)
    per_block = block // WARP
    per_launch = MAX_GRID_Y // chunk * chunk  # launch boundaries on chunk boundaries: runs stay whole
    for first in range(0, num_pairs, per_launch):
        count = min(per_launch, num_pairs - first)
        gate_up[(blocks(ceil_div(inter, per_block)), count), block, stream](
            x, pair_token, pair_slot, arena_words, store_words, hidden, inter, gate_w // word, up_w // word,
            gate_s, up_s, first, h)
    for first in range(0, num_pairs, per_launch):
        count = min(per_launch, num_pairs - first)
        down[(blocks(ceil_div(hidden, per_block)), count), block, stream](
            h, pair_slot, pair_out, arena_words, store_words, hidden, inter, down_w // word, down_s, first, out)
    return out

