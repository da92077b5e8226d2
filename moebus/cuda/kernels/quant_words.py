"""Quantized experts' 8-byte words (common/quant_layout.py) to float32 in registers, for the expert
GEMVs of moe_quant.py: ``decoder(fmt, hardware)`` gives decode(u, scale, minimum, buf), which puts
the word's codes into buf (chunks of 4 floats) and returns the factor of their sum.

Why this is its own file: at one token the quantized GEMVs looked bound by these few lines. Compiled
for sm_90 (tools/device/quant7_sass.py), the old decode spent ~7 integer instructions a code
(64-bit shifts and masks, each two 32-bit ones). Now codes move in 32-bit halves (fp8: 4 bit moves
and a multiply a code; int4: one byte permute, prmt.b32, a code), and GPUs of compute capability
8.9+ (Ada, Hopper) can convert two e4m3 codes to an f16 pair in one instruction
(``cvt.rn.f16x2.e4m3x2``) and each f16 to float32 in another; every e4m3 value is an f16, so both
fp8 paths give the same bits. Measured on an H200 (docs/performance.md), fewer instructions did not
make one-token calls faster (they are bound by latency and launches there), so the instruction
path serves runs of several tokens only (``HARDWARE_E4M3_MIN_RUN``).

- fp8: the e4m3 values, factor the block's scale.
- int4: q + m / s (the nibble as the low mantissa bits of 2^23: float32 2^23 + q, exact, less
  2^23), factor s."""
from __future__ import annotations

import functools

import numpy as np

from moebus.cuda.kernels.compat import SIMULATOR, bits_as_f32, cuda, device, float32, uint32

E4M3_RESCALE = float32(2.0**120)  # float32 exponent bias 127 - e4m3 bias 7
TWO23 = float32(2.0**23)
SIGN32, MAG32 = np.uint32(0x80000000), np.uint32(0x07F00000)
NIBBLE, NIBBLES, MAGIC23 = np.uint32(0xF), np.uint32(0x0F0F0F0F), np.uint32(0x4B000000)  # MAGIC23: float32 2^23
HARDWARE_E4M3_CC = (8, 9)  # cvt.rn.f16x2.e4m3x2: PTX ISA 7.8, sm_89 and later


# e4m3 by the conversion instruction or by bit moves: the same bits. On an H200 (2026-12-02,
# docs/performance.md) the instruction measured 6% slower at one token (29.6 vs 27.9 us the expert
# FFN), while for runs of many tokens it issues 5-7% fewer instructions (tools/device/quant7_sass.py)
# and the 8-token figures were measured with it. So: the instruction for runs of this many tokens or
# more, bit moves below.
HARDWARE_E4M3_MIN_RUN = 3


@functools.cache
def can_convert_e4m3() -> bool:
    """Whether this process's GPU converts e4m3 pairs in one instruction."""
    return not SIMULATOR and tuple(cuda.get_current_device().compute_capability) >= HARDWARE_E4M3_CC


def hardware_e4m3(chunk: int) -> bool:
    """Whether the fp8 GEMVs with runs of up to ``chunk`` tokens decode e4m3 by the conversion
    instruction (``decoder``'s hardware)."""
    return chunk >= HARDWARE_E4M3_MIN_RUN and can_convert_e4m3()


@device
def _halves(u):
    """The low and high 32 bits of a uint64."""
    return uint32(u & np.uint64(0xFFFFFFFF)), uint32(u >> np.uint64(32))


@device
def e4m3_at(w, shift):
    """The e4m3 code at bits shift .. shift + 7 (shift <= 24) of a 32-bit word, exact (subnormals
    included): its bits moved to the top byte, the sign kept there and exponent | mantissa placed at
    a float32's bits 26..20 (the float32 is then the value times 2^-120), rescaled."""
    top = uint32(w) << uint32(24 - shift)
    return bits_as_f32((top & SIGN32) | ((top >> uint32(4)) & MAG32)) * E4M3_RESCALE


if not SIMULATOR:
    from llvmlite import ir
    from numba.cuda import cgutils, types
    from numba.cuda.extending import intrinsic

    def _pair_loader(instruction: str, ordered: bool = False):
        @intrinsic
        def load(typingctx, array, row, at):
            signature = types.UniTuple(types.uint64, 2)(array, row, at)

            def codegen(context, builder, sig, args):
                array_type = sig.args[0]
                indices = [context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], sig.args[1:])]
                pointer = cgutils.get_item_pointer(context, builder, array_type,
                                                   context.make_array(array_type)(context, builder, value=args[0]),
                                                   indices, wraparound=False)
                i64 = ir.IntType(64)
                asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([i64, i64]), [pointer.type]),
                                   f"{instruction} {{$0, $1}}, [$2];", "=l,=l,l", side_effect=ordered)
                out = builder.call(asm, [pointer])
                return context.make_tuple(builder, sig.return_type, [builder.extract_value(out, i) for i in range(2)])

            return signature, codegen

        return load

    # array[row, at] and array[row, at + 1] of a C-ordered 2-D uint64 array in one 16-byte load
    # (ld.global.v2.u64: at even and rows 16-byte aligned), half the load instructions of two; the
    # streaming one evict-first (ld.global.cs.v2.u64, weights read once a step: moe_quant_round.py)
    load_pair = _pair_loader("ld.global.v2.u64")
    load_pair_streaming = _pair_loader("ld.global.cs.v2.u64")
    # ... kept in program order with other side-effecting statements such as pdl.grid_dependency_wait: an
    # asm load without side effects is free to move (LLVM hoisted one out of a loop above that wait), so
    # what a kernel reads of its predecessor's output goes through this one
    load_pair_ordered = _pair_loader("ld.global.v2.u64", ordered=True)

    @intrinsic
    def load_streaming(typingctx, array, row, at):
        """array[row, at] of a C-ordered 2-D uint64 array, loaded evict-first (ld.global.cs, as
        loads.load_streaming for bf16 weights): an expert's words are read once a step, and 38 MB (fp8)
        a layer at batch 1 then pass through the 50 MB L2 without pushing out what the next kernels
        read. Unsigned indices, no wraparound arithmetic (as load_pair)."""
        signature = types.uint64(array, row, at)

        def codegen(context, builder, sig, args):
            array_type = sig.args[0]
            indices = [context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], sig.args[1:])]
            pointer = cgutils.get_item_pointer(context, builder, array_type,
                                               context.make_array(array_type)(context, builder, value=args[0]),
                                               indices, wraparound=False)
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(64), [pointer.type]), "ld.global.cs.u64 $0, [$1];", "=l,l")
            return builder.call(asm, [pointer])

        return signature, codegen

    @functools.cache
    def streaming_round(count: int, stride: int):
        """load(array, row, at, out, m, r): out[m, r, k] = array[row, at + k * stride] for k < count,
        evict-first (ld.global.cs), in one asm statement at immediate offsets of one address: a
        load a word through load_streaming costs an address (two registers) each, which ptxas counted
        as 16-48 more registers a thread in the expert GEMVs (tools/device/quant9_regs.py)."""
        body = "\n".join(f"ld.global.cs.u64 ${k}, [${count}+{k * stride * 8}];" for k in range(count))

        @intrinsic
        def load(typingctx, array, row, at, out, m, r):
            signature = types.void(array, row, at, out, m, r)

            def codegen(context, builder, sig, args):
                array_type, out_type = sig.args[0], sig.args[3]
                indices = [context.cast(builder, v, t, types.intp) for v, t in zip(args[1:3], sig.args[1:3])]
                pointer = cgutils.get_item_pointer(context, builder, array_type,
                                                   context.make_array(array_type)(context, builder, value=args[0]),
                                                   indices, wraparound=False)
                i64 = ir.IntType(64)
                returns = ir.LiteralStructType([i64] * count) if count > 1 else i64  # one output: no struct
                asm = ir.InlineAsm(ir.FunctionType(returns, [pointer.type]), body, ",".join(["=l"] * count + ["l"]))
                words = builder.call(asm, [pointer])
                target = context.make_array(out_type)(context, builder, value=args[3])
                first = [context.cast(builder, v, t, types.intp) for v, t in zip(args[4:], sig.args[4:])]
                for k in range(count):
                    slot = cgutils.get_item_pointer(context, builder, out_type, target,
                                                    first + [context.get_constant(types.intp, k)], wraparound=False)
                    builder.store(builder.extract_value(words, k) if count > 1 else words, slot)
                return context.get_dummy_value()

            return signature, codegen

        return load

    _E4M3X4 = ("{.reg .b16 lo, hi, a, b, c, d; .reg .b32 p, q;\n"
               "mov.b32 {lo, hi}, $4;\n"
               "cvt.rn.f16x2.e4m3x2 p, lo;\n"
               "cvt.rn.f16x2.e4m3x2 q, hi;\n"
               "mov.b32 {a, b}, p;\n"
               "mov.b32 {c, d}, q;\n"
               "cvt.f32.f16 $0, a;\n"
               "cvt.f32.f16 $1, b;\n"
               "cvt.f32.f16 $2, c;\n"
               "cvt.f32.f16 $3, d;}")

    @intrinsic
    def _e4m3x4(typingctx, word):
        """The 4 e4m3 codes of a uint32 (lowest byte first) as 4 float32, by the hardware."""
        signature = types.UniTuple(types.float32, 4)(types.uint32)

        def codegen(context, builder, sig, args):
            f32 = ir.FloatType()
            asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([f32] * 4), [ir.IntType(32)]), _E4M3X4,
                               "=f,=f,=f,=f,r")
            out = builder.call(asm, args)
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(out, i) for i in range(4)])

        return signature, codegen

    def _byte_permute(selector: int):
        """PTX prmt.b32 with a fixed selector: each byte of the result picked from the 8 bytes of
        (a, b) by a nibble of ``selector`` (an immediate: a register selector costs a move each)."""
        @intrinsic
        def permute(typingctx, a, b):
            signature = types.uint32(types.uint32, types.uint32)

            def codegen(context, builder, sig, args):
                i32 = ir.IntType(32)
                asm = ir.InlineAsm(ir.FunctionType(i32, [i32] * 2), f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r")
                return builder.call(asm, args)

            return signature, codegen

        return permute

    # [byte j of a, 0, 0, 0x4B] from a and 2^23's bits: float32 2^23 + a nibble held in byte j
    _BYTE0, _BYTE1, _BYTE2, _BYTE3 = (_byte_permute(0x7650 + j) for j in range(4))

    @device
    def _int4_quad(nibbles, offset, buf, row, col):
        """The 4 codes held in the bytes of ``nibbles`` (0..15 each), as q + offset, into buf[row + j // 2,
        col + 2 (j % 2)] for byte j."""
        buf[row, col] = bits_as_f32(_BYTE0(nibbles, MAGIC23)) - TWO23 + offset
        buf[row, col + 2] = bits_as_f32(_BYTE1(nibbles, MAGIC23)) - TWO23 + offset
        buf[row + 1, col] = bits_as_f32(_BYTE2(nibbles, MAGIC23)) - TWO23 + offset
        buf[row + 1, col + 2] = bits_as_f32(_BYTE3(nibbles, MAGIC23)) - TWO23 + offset
else:
    def load_pair(array, row, at):
        return array[row, at], array[row, at + 1]

    load_pair_streaming = load_pair_ordered = load_pair

    def load_streaming(array, row, at):
        return array[row, at]

    @functools.cache
    def streaming_round(count: int, stride: int):
        def load(array, row, at, out, m, r):
            for k in range(count):
                out[m, r, k] = array[row, at + k * stride]

        return load

    def _int4_quad(nibbles, offset, buf, row, col):
        for j in range(4):
            bits = ((nibbles >> np.uint32(8 * j)) & NIBBLE) | MAGIC23
            buf[row + j // 2, col + 2 * (j % 2)] = bits_as_f32(bits) - TWO23 + offset


int4_quad = _int4_quad  # moe_quant_round.py's int4 words


@functools.cache
def e4m3_quad(hardware: bool):
    """decode(w, quad): the 4 e4m3 codes of a uint32 (lowest byte first) into quad[0..3] as float32, by
    the conversion instruction (``hardware``) or bit moves: the same values (moe_quant_round.py)."""
    if hardware and not SIMULATOR:
        @device
        def quad_hardware(w, quad):
            quad[0], quad[1], quad[2], quad[3] = _e4m3x4(w)

        return quad_hardware

    @device
    def quad_bits(w, quad):
        for c in range(4):
            quad[c] = e4m3_at(w, 8 * c)

    return quad_bits


@functools.cache
def decoder(fmt: str, hardware: bool = False):
    """decode(u, scale, minimum, buf) for ``fmt``; ``hardware``: e4m3 by the GPU's conversion
    instruction (``hardware_e4m3``), else by 32-bit integer bit moves."""
    if fmt == "fp8" and hardware:
        @device
        def decode_fp8_hardware(u, scale, minimum, buf):
            lo, hi = _halves(u)
            buf[0, 0], buf[0, 1], buf[0, 2], buf[0, 3] = _e4m3x4(lo)
            buf[1, 0], buf[1, 1], buf[1, 2], buf[1, 3] = _e4m3x4(hi)
            return scale

        return decode_fp8_hardware
    if fmt == "fp8":
        @device
        def decode_fp8(u, scale, minimum, buf):
            lo, hi = _halves(u)
            for c in range(4):
                buf[0, c] = e4m3_at(lo, 8 * c)
                buf[1, c] = e4m3_at(hi, 8 * c)
            return scale

        return decode_fp8
    if fmt != "int4":
        raise ValueError(f"no decoder for experts dtype {fmt!r}")

    @device
    def decode_int4(u, scale, minimum, buf):
        offset = _quotient(minimum, scale)  # int4_quantize's scales are never 0
        lo, hi = _halves(u)
        for h in range(2):
            half = lo if h == 0 else hi
            # codes 2j and 2j + 1 of the half in byte j of even and odd
            _int4_quad(uint32(half & NIBBLES), offset, buf, 2 * h, 0)
            _int4_quad(uint32((half >> uint32(4)) & NIBBLES), offset, buf, 2 * h, 1)
        return scale

    return decode_int4


if SIMULATOR:
    def _quotient(a, b):
        return a / b
else:
    @device
    def _quotient(a, b):
        """a / b within 2 ulp, without IEEE division's slow path (a branch, which keeps the round's
        loop from being unrolled and its words in registers)."""
        return cuda.libdevice.fast_fdividef(a, b)


fast_quotient = _quotient  # moe_quant_round.py's int4 words
