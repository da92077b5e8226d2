// The quantized expert GEMVs of a decode step at batch 1 on tensor cores (moe_quant_mma.py; eighteenth session): the
// same inputs and outputs as moe_quant_round.one_round_kernel (runs of one pair: pair tables, arena / host-store
// placement, 128 x 128 block scales, gate|up's silu(g) * u into h, down's out_table), the products on
// mma.sync m16n8k16 (f16 in, f32 sums) instead of ~7 CUDA-core instructions a code.
//
// A warp takes a tile of 16 rows (of each matrix: gate|up both) over WORDS steps of 64 k. Lane (g, t) (g = lane / 4,
// t = lane % 4) loads the 16-byte word of rows g and g + 8 at k0 = 64 s + 16 t: the 4 lanes of a group cover the
// step's 64 k. A dot product does not care about the order of k, so mma i (i < 4) of a step gives the fragment's k
// slots {2t, 2t + 1, 2t + 8, 2t + 9} the codes 4i .. 4i + 3 of the lane's own word; B's rows for those slots are
// then x[k0 + 4i .. k0 + 4i + 3], the lane's own x. Every column of B holds the same x (c0 of any lane is row g,
// c2 row g + 8). e4m3 -> f16 is exact (cvt.rn.f16x2.e4m3x2), the products f16 x f16 exact in f32.
// x in f16 is the only rounding added. Range: the block stages x into shared memory as f16 scaled by a power of
// two a 64-k chunk (the largest |x| of the chunk into [2^14, 2^15)): no overflow (h = silu(g) u may exceed
// f16's 65504), every element that is not tiny keeps 11 significant bits; the power's inverse is folded into
// the step's block scale in f32 (exact: a power of two). A step's 4 mma start from zero (a fresh accumulator) and
// add scale x 2^-e x it to the row's f32 total, so a step never mixes two 128-k scale blocks.
// K is split over KSPLIT warps of a block (TILES tiles a block): every code word of a warp's steps is loaded
// before x is staged and the block's barrier (ptxas cannot sink them past it), the warps' partial sums added in
// shared memory in a fixed order. Rows past the matrix are clamped (not stored), k past a row's end reads zero.
// PDL: griddepcontrol.wait before any global read (EARLY, the down GEMV: after its pair tables and code words,
// as moe_quant_round.DOWN_LOAD_BEFORE_WAIT), then launch_dependents where PDL_TRIGGER (pdl.trigger_after_wait).
// DENSE (linear_quant_mma.py, nineteenth session): the same GEMV for an FP8 dense projection at batch 1 (the
// attention's q|k|v and o): one x row, one matrix (ROWS x COLS codes), a float32 scale per row and 128 inputs
// (linear_quant.py's layout: rows g and g + 8 each their own), out[row]; the wait first (EARLY: the weights before it).
// ROUTE (DENSE, twentieth session; linear_quant_mma.launch_route): the o projection with norm_route's start as its
// end, for E = ROUTE experts (bf16 router (E, ROWS) and norm weight (ROWS,)): total[row] = residual[row] + out, and
// a tile's partial[tile][e] = sum over its 16 rows of router[e][row] * (norm_weight[row] * total[row]), and
// partial[tile][E] = sum of total[row]^2 (in row order); norm_route.route_tail_cuda sums the tiles' partials in a
// fixed order and ends the routing. The router's 32 bytes of a tile (thread e: expert e) and the norm weight's are
// weights: loaded with the codes (before the wait with EARLY).
// ROUTED (gate|up, twenty-first session; moe_quant_mma.launch_gate_up_routed): the gate|up GEMV that ends the routing
// the ROUTE entry began, in place of norm_route.route_tail's kernel: every block sums the o projection's tiles'
// partials (route_tail's order: TAIL_PARTS threads a column, each the tiles j, j + TAIL_PARTS, ..., then the parts in
// order), takes 1 / rms and the logits, softmax and ranks as routing.one_token_tail (E <= 32 experts, warp 0 a lane
// an expert), and runs pair blockIdx.y: the place-th chosen expert by id, its slot from the placement row. x is
// h = norm_weight * (total * 1 / rms), route_tail's h, made while it is staged. Blocks (0, j) write pair j's
// tables, ids and weight (route_tail's outputs). The norm's weights are loaded before the wait (weights).
// COMBINE (down, twenty-second session; moe_quant_mma.launch_down_combine): the down GEMVs of one token's COMBINE
// pairs in one block (a group of TILES * KSPLIT warps a pair, each with its own h row staged; a 16-row tile of each
// pair's rows), ended by fused.combine_add_rmsnorm's first half: total = residual + the sum over ranks of weight *
// y, and the tile's sum of total^2, from which the next layer's NORMED projection takes 1 / rms. The combine kernel
// (3.8 us true a layer at A3B b1) leaves the chain.
// NORMED (DENSE, twenty-second session; linear_quant_mma.launch_normed): the FP8 projection of rmsnorm(x), 1 / rms
// from the COMBINE entry's squares (every warp sums them), x staged as w * (x * 1 / rms) as ROUTED stages h.
// INT4: 32 codes a word (a step of 128 inputs: one (scale, minimum) group of each row): a word's 32-bit quarter q
// holds codes 8q .. 8q + 7 (byte b: 8q + 2b low nibble, 8q + 2b + 1 high); two mma a quarter take the nibbles at
// bits {0, 16} / {4, 20} (codes 8q, 8q + 4 / 8q + 1, 8q + 5), then a byte up; x is staged in groups of 8 as
// (x0, x4), (x1, x5), (x2, x6), (x3, x7) to match, and a step adds s 2^-e sum q x16 + m sum x (sum x in f32).

#ifndef TILES
#define TILES 1         // row tiles (16 rows) a block
#endif
#ifndef KSPLIT
#define KSPLIT 8        // warps a tile, each on its own steps of 64 k
#endif
#ifndef WORDS
#define WORDS 4         // steps of 64 k a warp takes a pass (16-byte words a lane and row)
#endif
#ifndef MATS
#define MATS 2          // 2: gate|up, 1: down
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1
#endif
#ifndef EARLY
#define EARLY 0
#endif
#ifndef PDL_TRIGGER
#define PDL_TRIGGER 0
#endif
#ifndef ENTRY
#define ENTRY moe_quant_mma
#endif
#ifndef COLS
#define COLS 2048       // codes a row (x's length), a multiple of 16
#endif
#ifndef ROWS
#define ROWS 768        // rows of each matrix (the output's length)
#endif
#ifndef SEPARATE
#define SEPARATE __syncwarp
#endif
#ifndef DENSE
#define DENSE 0         // 1: a dense fp8 projection (linear_quant_mma.py): one x row, one matrix, a scale a row
#endif                  // and 128 inputs (linear_quant.py's layout), out[row]
#ifndef INT4
#define INT4 0          // 1: 4-bit codes (32 a 16-byte word, two a byte, low nibble first; a (scale, minimum) a row
#endif                  // and 128 inputs: value = q s + m), the x chunk and a step 128 inputs
#ifndef ROUTE
#define ROUTE 0         // DENSE: experts E of the routing this projection starts (0: a plain projection)
#endif
#ifndef ROUTED
#define ROUTED 0        // gate|up: experts E (<= 32) of the routing it ends from the ROUTE entry's partials (0: none)
#endif
#ifndef COMBINE
#define COMBINE 0       // down: the pairs (top_k) of one token a block, combined with the residual (0: a pair a block)
#endif
#ifndef NORMED
#define NORMED 0        // DENSE: x staged as rmsnorm(x) from the COMBINE entry's squares (0: x as it is)
#endif
#define GROUPS (COMBINE ? COMBINE : 1)       // warp groups a block, each its own x row and matrix
#define GTHREADS (32 * TILES * KSPLIT)       // threads a group
#define THREADS (GTHREADS * GROUPS)
#if GROUPS > 1
#define GROUP_TID (threadIdx.x % GTHREADS)   // a thread's place in its group
#else
#define GROUP_TID threadIdx.x
#endif
#define ROW_SCALES (INT4 || DENSE)  // a scale (int4: a pair) per row and 128 inputs
#define BLOCK 128
#define VALUES (INT4 ? 32 : 16)               // codes a 16-byte word
#define STEP_K (4 * VALUES)                   // inputs a step: a lane group's 4 words
#define ROW_BYTES (INT4 ? COLS / 2 : COLS)
#define STEPS ((COLS + STEP_K - 1) / STEP_K)  // steps a row
#define SCALE_COLS ((COLS + BLOCK - 1) / BLOCK)
#define QUADS (STEPS * STEP_K / 4)            // float4 of x staged (zero past COLS)
#define PER_THREAD (INT4 ? 2 : 1)             // float4 a thread stages a trip (a chunk: 16 threads)
#define STAGE_TRIPS ((QUADS / PER_THREAD + GTHREADS - 1) / GTHREADS)
// shapes that need no clamp or bounds test (A3B's): fewer address instructions, the loads at constant offsets
#define WHOLE_ROWS (ROWS % (16 * TILES) == 0)
#define WHOLE_STEPS (COLS % STEP_K == 0 && STEPS % (KSPLIT * WORDS) == 0)

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#if PDL_TRIGGER
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
#endif
}

__device__ __forceinline__ uint4 load_code(const u8 *p) {  // evict-first: read once a step
    uint4 r;
    asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// x after the code words: volatile, so that neither compiler issues it (and the maximum that waits on it) between
// them (ptxas did: half the words then left one L2 trip later)
__device__ __forceinline__ float4 load_x(const float *p) {
    float4 r;
    asm volatile("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ u32 e4m3x2(u32 pair) {  // two e4m3 codes (low 16 bits) -> f16x2, low code low
    u32 r;
    asm("{ .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo; }" : "=r"(r) : "r"(pair));
    return r;
}

__device__ __forceinline__ u32 e4m3x2_hi(u32 pair) {  // the high 16 bits' two codes
    u32 r;
    asm("{ .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi; }" : "=r"(r) : "r"(pair));
    return r;
}

// 4-bit codes -> f16x2, exact: the nibbles at bits 0 and 16 of w (0x000F000F) or 4 and 20 (0x00F000F0) under
// the exponent of 1024 (0x6400: 1024 + n, or 1024 + 16 n), less 1024 (or times 1/16 less 64)
__device__ __forceinline__ u32 nibbles_low(u32 w) {
    u32 r, h;
    asm("lop3.b32 %0, %1, 0x000F000F, 0x64006400, 0xEA;" : "=r"(h) : "r"(w));  // (w & mask) | magic
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(h), "r"(0x64006400u));
    return r;
}

__device__ __forceinline__ u32 nibbles_high(u32 w) {
    u32 r, h;
    asm("lop3.b32 %0, %1, 0x00F000F0, 0x64006400, 0xEA;" : "=r"(h) : "r"(w));
    // (1024 + 16 n) / 16 - 64: 1/16 is 0x2C00, -64 0xD400
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(h), "r"(0x2C002C00u), "r"(0xD400D400u));
    return r;
}

__device__ __forceinline__ u32 f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ void mma(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 2^e as a float, e in [-126, 127]
__device__ __forceinline__ float power_of_two(int e) { return __int_as_float((e + 127) << 23); }

// ROUTED, NORMED: the norm's weights of the x a thread stages (bf16: int4 8 a trip, fp8 4), loaded before the wait,
// and 1 / rms: x_k staged as w_k * (x_k * inv) (route_tail's h, fused.normed_store's order). NORMED: 1 / rms from
// the squares (COLS / 16 tiles' sums of x^2), after the wait.
struct Norm {
    uint4 w[STAGE_TRIPS];
    float inv;
    const float *square;
    float eps;
};

__device__ __forceinline__ float bf16_low(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_high(u32 w) { return __uint_as_float(w & 0xFFFF0000u); }

__device__ __forceinline__ float4 normed(float4 v, u32 lo, u32 hi, float inv) {
#if ROUTED || NORMED
    return make_float4(bf16_low(lo) * (v.x * inv), bf16_high(lo) * (v.y * inv), bf16_low(hi) * (v.z * inv),
                       bf16_high(hi) * (v.w * inv));
#else
    return v;
#endif
}

// ROUTED, NORMED: the norm's weights of the x this thread stages (a Norm's w), loaded as weights (evict-first)
__device__ __forceinline__ Norm load_norm(const u16 *norm_weight) {
    Norm norm;
#pragma unroll
    for (int trip = 0; trip < STAGE_TRIPS; ++trip) {
        norm.w[trip] = make_uint4(0, 0, 0, 0);
        const int at = trip * GTHREADS + (int)GROUP_TID;  // int4: x[8 at ..], 16 bytes; fp8: x[4 at ..], 8 bytes
        if (INT4 && 8 * at < COLS) {
            norm.w[trip] = load_code(reinterpret_cast<const u8 *>(norm_weight + 8 * at));
        } else if (!INT4 && 4 * at < COLS) {
            asm volatile("ld.global.cs.v2.u32 {%0, %1}, [%2];" : "=r"(norm.w[trip].x), "=r"(norm.w[trip].y)
                         : "l"(norm_weight + 4 * at));
        }
    }
    return norm;
}

#if NORMED
// NORMED: 1 / rms of x from the squares (COLS / 16 tiles' sums of x^2, the COMBINE entry's): every warp sums them
// the same way (a lane's float4s in order, then a butterfly), so every thread holds the same bits. rsqrtf (2 ulp):
// the precise 1 / sqrtf's slow-path call spilled 24 bytes beside the code words in flight; x is then rounded to f16
__device__ __forceinline__ float rms_inverse(const float *square, float eps) {
    static_assert(COLS % 64 == 0, "whole float4 of tiles' squares");
    const int lane = threadIdx.x % 32;
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < (COLS / 64 + 31) / 32; ++i) {
        const int q = lane + 32 * i;
        if ((COLS / 64) % 32 == 0 || q < COLS / 64) {
            const float4 v = *reinterpret_cast<const float4 *>(square + 4 * q);
            s += (v.x + v.y) + (v.z + v.w);
        }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xFFFFFFFFu, s, offset);
    return rsqrtf(s / (float)COLS + eps);
}
#endif

// x's row into xs as f16, each 64-k chunk scaled by 2^e (its largest |x| into [2^14, 2^15); e in [-100, 100]),
// 2^-e into inverse[chunk]; zero past COLS up to the chunks' end. A chunk is 16 float4 of consecutive threads
// (half a warp): its maximum by 4 butterflies. Every trip's loads first, then the conversions.
#if INT4
// int4: as below over 128-input chunks, 8 inputs a thread, each group of 8 stored as the pairs (x0, x4), (x1, x5),
// (x2, x6), (x3, x7) (B's registers for a word's 32-bit quarter: nibbles_low / nibbles_high pair those codes), and
// the chunk's f32 sum of x (the minimum's share, m sum x) into xsum[chunk]
__device__ __forceinline__ void stage_x(const float *x, u32 *xs, float *inverse, float *xsum, const Norm &norm,
                                        float inv) {
    float4 v[STAGE_TRIPS][2];
#pragma unroll
    for (int trip = 0; trip < STAGE_TRIPS; ++trip) {
        const int o = trip * GTHREADS + GROUP_TID;  // x[8 o .. 8 o + 7]
        v[trip][0] = v[trip][1] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (8 * o < COLS) {  // COLS a multiple of 32
            v[trip][0] = load_x(x + 8 * o);
            v[trip][1] = load_x(x + 8 * o + 4);
        }
    }
#pragma unroll
    for (int trip = 0; trip < STAGE_TRIPS; ++trip) {
        const int o = trip * GTHREADS + GROUP_TID;
        const float4 a = normed(v[trip][0], norm.w[trip].x, norm.w[trip].y, inv);
        const float4 b = normed(v[trip][1], norm.w[trip].z, norm.w[trip].w, inv);
        float m = fmaxf(fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(a.z), fabsf(a.w))),
                        fmaxf(fmaxf(fabsf(b.x), fabsf(b.y)), fmaxf(fabsf(b.z), fabsf(b.w))));
        float sum = ((a.x + a.y) + (a.z + a.w)) + ((b.x + b.y) + (b.z + b.w));
#pragma unroll
        for (int offset = 1; offset < 16; offset *= 2) {
            m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, offset));
            sum += __shfl_xor_sync(0xFFFFFFFFu, sum, offset);
        }
        int e = 0;
        if (m > 0.f) e = min(max(14 - (((__float_as_int(m) >> 23) & 0xFF) - 127), -100), 100);
        const float p = power_of_two(e);
        if ((QUADS / 2) % GTHREADS == 0 || o < QUADS / 2) {
            reinterpret_cast<uint4 *>(xs)[o] = make_uint4(f16x2(a.x * p, b.x * p), f16x2(a.y * p, b.y * p),
                                                          f16x2(a.z * p, b.z * p), f16x2(a.w * p, b.w * p));
            if (o % 16 == 0) {
                inverse[o / 16] = power_of_two(-e);
                xsum[o / 16] = sum;
            }
        }
    }
}
#else
__device__ __forceinline__ void stage_x(const float *x, u32 *xs, float *inverse, float *, const Norm &norm,
                                        float inv) {
    float4 v[STAGE_TRIPS];
#pragma unroll
    for (int trip = 0; trip < STAGE_TRIPS; ++trip) {
        const int q = trip * GTHREADS + GROUP_TID;
        v[trip] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (4 * q < COLS) v[trip] = normed(load_x(x + 4 * q), norm.w[trip].x, norm.w[trip].y, inv);
    }
#pragma unroll
    for (int trip = 0; trip < STAGE_TRIPS; ++trip) {
        const int q = trip * GTHREADS + GROUP_TID;
        float m = fmaxf(fmaxf(fabsf(v[trip].x), fabsf(v[trip].y)), fmaxf(fabsf(v[trip].z), fabsf(v[trip].w)));
#pragma unroll
        for (int offset = 1; offset < 16; offset *= 2) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, offset));
        int e = 0;
        if (m > 0.f) e = min(max(14 - (((__float_as_int(m) >> 23) & 0xFF) - 127), -100), 100);
        const float p = power_of_two(e);
        if (QUADS % GTHREADS == 0 || q < QUADS) {
            reinterpret_cast<uint2 *>(xs)[q] = make_uint2(f16x2(v[trip].x * p, v[trip].y * p),
                                                          f16x2(v[trip].z * p, v[trip].w * p));
            if (q % 16 == 0) inverse[q / 16] = power_of_two(-e);
        }
    }
}
#endif

// The block's rows of M matrices (codes[m]: rows of ROW_BYTES; scales[m]: fp8 experts one per 128 x 128 block,
// ROW_SCALES one per row and 128 inputs, int4 a (scale, minimum) pair per row and group) times x_row: returns the
// output row this thread holds (threads < TILES * 16, row < ROWS) with its sums in sum[], else -1.
// COMBINE: each group of the block its own x_row, codes and scales; the sums of group threadIdx.x / (TILES * 16).
template <int M>
__device__ __forceinline__ int gemv(const float *x_row, const u8 *const (&codes)[2], const float *const (&scales)[2],
                                    float (&sum)[M], const Norm &norm = Norm()) {
#if GROUPS > 1
    __shared__ __align__(16) u32 xs_all[GROUPS][QUADS * 2];
    __shared__ float inverse_all[GROUPS][STEPS];
    __shared__ float xsum_all[GROUPS][INT4 ? STEPS : 1];
    __shared__ float part_all[GROUPS][TILES][KSPLIT][M][16];
    const int group = threadIdx.x / GTHREADS;
    u32 *xs = xs_all[group];
    float *inverse = inverse_all[group], *xsum = xsum_all[group];
    float (*part)[KSPLIT][M][16] = part_all[group];
#else
    __shared__ __align__(16) u32 xs[QUADS * 2];
    __shared__ float inverse[STEPS];
    __shared__ float xsum[INT4 ? STEPS : 1];
    __shared__ float part[TILES][KSPLIT][M][16];
#endif
    const int lane = threadIdx.x % 32, warp = GROUP_TID / 32, g = lane / 4, t = lane % 4;
    const int tile = warp / KSPLIT, kw = warp % KSPLIT;
    const int row0 = (blockIdx.x * TILES + tile) * 16;
    const int row_a = WHOLE_ROWS ? row0 + g : min(row0 + g, ROWS - 1);
    const int row_b = WHOLE_ROWS ? row_a + 8 : min(row0 + g + 8, ROWS - 1);
    // a row's first scale: the fp8 experts' 128-row block's (the same for rows g and g + 8: one load), else its own
    const int block_row = ((WHOLE_ROWS ? row0 : min(row0, ROWS - 1)) / BLOCK) * SCALE_COLS;
    const int scale_a = ROW_SCALES ? row_a * SCALE_COLS : block_row;
    const int scale_b = ROW_SCALES ? row_b * SCALE_COLS : block_row;
    float total[M][2];
#pragma unroll
    for (int m = 0; m < M; ++m) total[m][0] = total[m][1] = 0.f;
    const int per_pass = KSPLIT * WORDS;
#pragma unroll
    for (int first = 0; first < STEPS; first += per_pass) {
        uint4 word[WORDS][M][2];
#if INT4
        float2 param[WORDS][M][2];  // rows g and g + 8: (scale, minimum) of the step's group
#else
        float scale[WORDS][M][2];  // rows g and g + 8 (the fp8 experts' the same: one load)
#endif
#pragma unroll
        for (int i = 0; i < WORDS; ++i) {
            const int s = first + kw * WORDS + i, k0 = STEP_K * s + VALUES * t;
#pragma unroll
            for (int m = 0; m < M; ++m) {
                const bool in = WHOLE_STEPS || (s < STEPS && k0 < COLS), live = WHOLE_STEPS || s < STEPS;
                const u8 *at = codes[m] + (INT4 ? k0 / 2 : k0);
                word[i][m][0] = in ? load_code(at + (long long)row_a * ROW_BYTES) : make_uint4(0, 0, 0, 0);
                word[i][m][1] = in ? load_code(at + (long long)row_b * ROW_BYTES) : make_uint4(0, 0, 0, 0);
#if INT4
                const float2 *pairs = reinterpret_cast<const float2 *>(scales[m]);
                param[i][m][0] = live ? pairs[scale_a + s] : make_float2(0.f, 0.f);
                param[i][m][1] = live ? pairs[scale_b + s] : make_float2(0.f, 0.f);
#else
                scale[i][m][0] = live ? scales[m][scale_a + (64 * s) / BLOCK] : 0.f;
                scale[i][m][1] = live ? scales[m][scale_b + (64 * s) / BLOCK] : 0.f;
#endif
            }
        }
        if (first == 0) {
#if EARLY
            pdl_wait();  // only the pair tables and the weights were read before it
#else
            SEPARATE();  // x's loads, and the maxima that wait on them, after every code word's load
#endif
#if NORMED
            stage_x(x_row, xs, inverse, xsum, norm, rms_inverse(norm.square, norm.eps));
#else
            stage_x(x_row, xs, inverse, xsum, norm, norm.inv);
#endif
            __syncthreads();  // the code loads above stay above it
        }
#pragma unroll
        for (int i = 0; i < WORDS; ++i) {
            const int s = first + kw * WORDS + i;
            if (!WHOLE_STEPS && s >= STEPS) break;  // warp-uniform
            const float inv = inverse[s];
#if INT4
            u32 b[16];  // the lane's 32 x as stage_x pairs them
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const uint4 v = *reinterpret_cast<const uint4 *>(xs + 64 * s + 16 * t + 4 * c);
                b[4 * c] = v.x, b[4 * c + 1] = v.y, b[4 * c + 2] = v.z, b[4 * c + 3] = v.w;
            }
            const float sum_x = xsum[s];
#else
            const uint4 lo = *reinterpret_cast<const uint4 *>(xs + 32 * s + 8 * t);  // x[k0 .. k0 + 7] as f16x2
            const uint4 hi = *reinterpret_cast<const uint4 *>(xs + 32 * s + 8 * t + 4);  // x[k0 + 8 .. k0 + 15]
            const u32 b[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#endif
#pragma unroll
            for (int m = 0; m < M; ++m) {
                const uint4 ra = word[i][m][0], rb = word[i][m][1];
                const u32 wa[4] = {ra.x, ra.y, ra.z, ra.w}, wb[4] = {rb.x, rb.y, rb.z, rb.w};
                float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int q = 0; q < 4; ++q) {
#if INT4  // quarter q: codes 8q .. 8q + 7; slots 2t, 2t + 1 <- 8q, 8q + 4 and 2t + 8, 2t + 9 <- 8q + 1, 8q + 5
          // (then 8q + 2, 8q + 6 and 8q + 3, 8q + 7, a byte up)
                    mma(d, nibbles_low(wa[q]), nibbles_low(wb[q]), nibbles_high(wa[q]), nibbles_high(wb[q]), b[4 * q],
                        b[4 * q + 1]);
                    mma(d, nibbles_low(wa[q] >> 8), nibbles_low(wb[q] >> 8), nibbles_high(wa[q] >> 8),
                        nibbles_high(wb[q] >> 8), b[4 * q + 2], b[4 * q + 3]);
#else     // slots 2t, 2t + 1 <- codes 4q, 4q + 1; 2t + 8, 2t + 9 <- 4q + 2, 4q + 3
                    mma(d, e4m3x2(wa[q]), e4m3x2(wb[q]), e4m3x2_hi(wa[q]), e4m3x2_hi(wb[q]), b[2 * q], b[2 * q + 1]);
#endif
                }
#if INT4
                const float2 pa = param[i][m][0], pb = param[i][m][1];
                total[m][0] = fmaf(pa.x * inv, d[0], fmaf(pa.y, sum_x, total[m][0]));
                total[m][1] = fmaf(pb.x * inv, d[2], fmaf(pb.y, sum_x, total[m][1]));
#else
                total[m][0] = fmaf(scale[i][m][0] * inv, d[0], total[m][0]);
                total[m][1] = fmaf(scale[i][m][1] * inv, d[2], total[m][1]);
#endif
            }
        }
    }
    if (t == 0) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            part[tile][kw][m][g] = total[m][0];
            part[tile][kw][m][g + 8] = total[m][1];
        }
    }
    __syncthreads();
    if (threadIdx.x >= GROUPS * TILES * 16) return -1;
#if GROUPS > 1  // the sums of group threadIdx.x / (TILES * 16)
    const unsigned r_at = threadIdx.x % (TILES * 16);
    float (*r_part)[KSPLIT][M][16] = part_all[threadIdx.x / (TILES * 16)];
#else
    const unsigned r_at = threadIdx.x;
#define r_part part
#endif
    const int r_tile = r_at / 16, r = r_at % 16, row = (blockIdx.x * TILES + r_tile) * 16 + r;
#pragma unroll
    for (int m = 0; m < M; ++m) {
        sum[m] = 0.f;
#pragma unroll
        for (int w = 0; w < KSPLIT; ++w) sum[m] += r_part[r_tile][w][m][r];
    }
#undef r_part
    return row < ROWS ? row : -1;
}

// An expert's GEMV (gemv) at batch 1: its blob by its placement ``entry`` (a slot of the arena, or -1 - a row of the
// host store), its matrices' codes and scales at the byte offsets code* / scale* (down: code1 = code0, scale1 =
// scale0).
template <int M>
__device__ __forceinline__ int expert_gemv(const float *x_row, int entry, const u8 *arena, const u8 *store,
                                           long long blob_bytes, long long code0, long long code1, long long scale0,
                                           long long scale1, float (&sum)[M], const Norm &norm = Norm()) {
    const u8 *blob = entry >= 0 ? arena + entry * blob_bytes : store + (-1 - entry) * blob_bytes;
    const u8 *const codes[2] = {blob + code0, blob + code1};
    const float *const scales[2] = {reinterpret_cast<const float *>(blob + scale0),
                                    reinterpret_cast<const float *>(blob + scale1)};
    return gemv<M>(x_row, codes, scales, sum, norm);
}

__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.f + expf(-g)) * u; }  // h of gate|up

#if DENSE && !ROUTE && !NORMED
// x: (1, COLS) float32; codes (ROWS, COLS) e4m3; scales (ROWS, SCALE_COLS) float32; out (1, ROWS) = x W^T.
// Grid ceil(ceil(ROWS / 16) / TILES), THREADS threads.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
ENTRY(const float *x, const u8 *codes, const float *scales, float *out) {
#if !EARLY
    pdl_wait();  // before any global read or write (EARLY: the weights before it, x after)
#endif
    const u8 *const code[2] = {codes, codes};
    const float *const scale[2] = {scales, scales};
    float sum[1];
    const int row = gemv<1>(x, code, scale, sum);
    if (row >= 0) out[row] = sum[0];
}
#elif DENSE && NORMED
// x: (1, COLS) float32 (the residual stream: the COMBINE entry's total); square (COLS / 16,) float32, its 16-row
// tiles' sums of x^2; norm_weight (COLS,) bf16; codes, scales, out: the DENSE entry's. out = rmsnorm(x) W^T, the
// norm as fused.normed_store's (w * (x * 1 / rms), 1 / rms = 1 / sqrt(sum x^2 / COLS + eps)) made while x is staged.
// Grid ceil(ceil(ROWS / 16) / TILES), THREADS threads.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
ENTRY(const float *x, const u8 *codes, const float *scales, const u16 *norm_weight, const float *square, float eps,
      float *out) {
#if !EARLY
    pdl_wait();  // before any global read or write (EARLY: the weights, the norm's too, before it; x and the squares
#endif           // after)
    Norm norm = load_norm(norm_weight);
    norm.square = square;
    norm.eps = eps;
    const u8 *const code[2] = {codes, codes};
    const float *const scale[2] = {scales, scales};
    float sum[1];
    const int row = gemv<1>(x, code, scale, sum, norm);
    if (row >= 0) out[row] = sum[0];
}
#elif DENSE && ROUTE
// x: (1, COLS) float32 (the attention's output); codes, scales: the o projection's (ROWS, COLS); residual, total:
// (1, ROWS) float32; norm_weight (ROWS,) and router (ROUTE, ROWS) bf16; partial (tiles, ROUTE + 1) float32.
// Grid ceil(ROWS / 16) (TILES 1, ROWS a multiple of 16), THREADS (> ROUTE) threads.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
ENTRY(const float *x, const u8 *codes, const float *scales, const float *residual, const u16 *norm_weight,
      const u16 *router, float *total, float *partial) {
    static_assert(TILES == 1 && ROWS % 16 == 0 && ROUTE < THREADS, "a tile a block, whole tiles, a thread an expert");
#if !EARLY
    pdl_wait();  // before any global read or write (EARLY: the weights before it, x and the residual after)
#endif
    const int e = threadIdx.x, row0 = blockIdx.x * 16;
    uint4 rw[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};  // router[e][row0 .. row0 + 15]
    if (e < ROUTE) {
        const u8 *at = reinterpret_cast<const u8 *>(router + (long long)e * ROWS + row0);
        rw[0] = load_code(at);
        rw[1] = load_code(at + 16);
    }
    uint4 nw = make_uint4(0, 0, 0, 0);  // norm_weight[row0 .. row0 + 15], by thread 0 .. 15's quarter
    if (e < 16) nw = load_code(reinterpret_cast<const u8 *>(norm_weight + row0) + 16 * (e / 8));
    const u8 *const code[2] = {codes, codes};
    const float *const scale[2] = {scales, scales};
    float sum[1];
    const int row = gemv<1>(x, code, scale, sum);  // threads 0 .. 15: rows row0 .. row0 + 15
    __shared__ float scaled[16], squares[16];  // norm_weight * total, total^2 of the tile's rows
    if (row >= 0) {
        const float t = residual[row] + sum[0];  // norm_route's x + y
        total[row] = t;
        const u32 words[4] = {nw.x, nw.y, nw.z, nw.w}, w = words[(e % 8) / 2];
        scaled[e] = (e % 2 ? bf16_high(w) : bf16_low(w)) * t;
        squares[e] = t * t;
    }
    __syncthreads();
    float *mine = partial + (long long)blockIdx.x * (ROUTE + 1);
    if (e < ROUTE) {
        const u32 r[8] = {rw[0].x, rw[0].y, rw[0].z, rw[0].w, rw[1].x, rw[1].y, rw[1].z, rw[1].w};
        float p = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            p = fmaf(bf16_low(r[i]), scaled[2 * i], p);
            p = fmaf(bf16_high(r[i]), scaled[2 * i + 1], p);
        }
        mine[e] = p;
    } else if (e == ROUTE) {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < 16; ++i) s += squares[i];
        mine[ROUTE] = s;
    }
}
#elif ROUTED
#include "route_sums.cuh"
#define TAIL_PARTS ROUTE_PARTS                                  // norm_route.TAIL_PARTS
#define ROUTE_TILES (COLS / 16)                                 // the o projection's 16-row tiles
#define PARTIALS (ROUTE_TILES * (ROUTED + 1))                   // floats of its partials
#define PARTIAL_TRIPS (((PARTIALS + 3) / 4 + THREADS - 1) / THREADS)  // float4 a thread stages

struct Pair {
    int entry;  // the pair's placement: a slot, or -1 - a host-store row
    float inv;  // the norm's 1 / rms
};

// The routing of one token from the ROUTE entry's partials (partial (ROUTE_TILES, ROUTED + 1), 16-byte aligned):
// route_tail's sums in its order, 1 / rms, logits, one_token_tail's softmax and ranks; returns pair ``place``'s
// placement (table_row[expert]) and 1 / rms. ``tables``: this block writes the pair's ids, weights and tables
// (route_tail's outputs). The partials are staged into shared memory 16 bytes a thread, every load issued before the
// first use (6.3 MB of L2 reads over A3B's 384 blocks; call B's first version read a column's tiles a thread as
// route_tail does, 32 sectors a warp's load, at 530.0 tok/s int4, this one's with the down GEMV as now not timed).
__device__ __forceinline__ Pair route_pair(const float *partial, const int *table_row, float eps, int top_k,
                                           int normalize, int place, bool tables, int *ids, float *weights,
                                           int *pair_token, int *pair_slot, int *pair_out) {
    __shared__ __align__(16) float staged[PARTIAL_TRIPS * THREADS * 4];
    __shared__ float sums[TAIL_PARTS][ROUTED + 1];
    __shared__ float probs[32], by_rank[32];
    __shared__ int ranks[32], places[ROUTED];
    __shared__ Pair chosen_pair;
    const int tid = threadIdx.x;
    float4 quads[PARTIAL_TRIPS];
    load_partials<PARTIAL_TRIPS, THREADS, PARTIALS>(partial, quads);
    const int place_of = tid < ROUTED ? table_row[tid] : 0;
    stage_partials<PARTIAL_TRIPS, THREADS>(staged, quads);
    if (tid < ROUTED) places[tid] = place_of;
    __syncthreads();
    column_sums<ROUTE_TILES, ROUTED + 1, THREADS>(staged, sums);
    __syncthreads();
    float inv = 0.f;
    if (tid < 32) {  // route_tail's 1 / rms and logits, then one_token_tail's softmax: warp 0, a lane an expert
        inv = route_inv_rms<ROUTED + 1>(sums, COLS, eps);
        probs[tid] = expert_prob<ROUTED + 1>(sums, inv, tid);
    }
    __syncthreads();
    int rank = ROUTED;
    if (tid < ROUTED) {  // ranks by descending probability, ties to the lower id
        const float prob = probs[tid];
        rank = 0;
        for (int j = 0; j < ROUTED; ++j) rank += probs[j] > prob || (probs[j] == prob && j < tid);
        ranks[tid] = rank;
        if (rank < top_k) by_rank[rank] = prob;
    }
    __syncthreads();
    if (rank < top_k) {  // a chosen expert: its place among the chosen by id
        int at = 0;
        for (int j = 0; j < tid; ++j) at += ranks[j] < top_k;
        if (at == place) {
            chosen_pair.entry = places[tid];
            if (tables) {
                float chosen = 0.f;
                for (int k = 0; k < top_k; ++k) chosen += by_rank[k];  // in rank order, as topk_row adds them
                const float prob = probs[tid];
                ids[rank] = tid;
                weights[rank] = normalize ? prob / chosen : prob;
                pair_token[place] = 0;
                pair_slot[place] = places[tid];
                pair_out[place] = rank;  // pair t * A + k of token 0
            }
        }
    }
    if (tid == 0) chosen_pair.inv = inv;
    __syncthreads();
    return chosen_pair;
}

// total: (1, COLS) float32 (the ROUTE entry's residual + o); partial: (COLS / 16, ROUTED + 1) float32, its tiles'
// sums; norm_weight (COLS,) bf16; table_row: the layer's placement row (ROUTED,) int32 (a slot, or -1 - a host-store
// row); arena / store, blob_bytes, code* / scale*: as the pairs entry; ids, weights (1, top_k) and the pair tables
// (top_k,): route_tail's outputs; out (top_k, ROWS): h of pair j. Grid (ceil(ceil(ROWS / 16) / TILES), top_k).
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
ENTRY(const float *total, const float *partial, const u16 *norm_weight, float eps, const int *table_row, int top_k,
      int normalize, const u8 *arena, const u8 *store, long long blob_bytes, long long code0, long long code1,
      long long scale0, long long scale1, int *ids, float *weights, int *pair_token, int *pair_slot, int *pair_out,
      float *out) {
    static_assert(MATS == 2 && !DENSE && ROUTED <= 32 && ROUTED < THREADS && COLS % 16 == 0,
                  "gate|up, a warp's lanes the experts, a thread an expert, whole tiles of the o projection");
    Norm norm = load_norm(norm_weight);  // the staged x's norm weights: weights, before the wait
    pdl_wait();
    const Pair pair = route_pair(partial, table_row, eps, top_k, normalize, blockIdx.y, blockIdx.x == 0, ids, weights,
                                 pair_token, pair_slot, pair_out);
    norm.inv = pair.inv;
    float sum[2];
    const int row = expert_gemv<2>(total, pair.entry, arena, store, blob_bytes, code0, code1, scale0, scale1, sum,
                                   norm);
    if (row >= 0) out[(long long)blockIdx.y * ROWS + row] = silu_times(sum[0], sum[1]);
}
#elif COMBINE
// The down GEMV of one token's COMBINE pairs (a group of TILES * KSPLIT warps a pair; the block: a 16-row tile of each)
// ended by fused.combine_add_rmsnorm's first half: total[row] = residual[row] + the sum over ranks k (in order, fmaf)
// of weights[k] * y_k[row], and square[tile] = the tile's sum of total^2 (a 16-lane butterfly), from which the next
// layer's NORMED projection takes 1 / rms. h (COMBINE, COLS) float32: pair j's x row j; pair_slot, pair_out
// (COMBINE,) int32: pair j's placement and rank; weights (1, COMBINE) float32 by rank; residual, total (1, ROWS);
// square (ROWS / 16,). EARLY: the tables, weights and residual (written two and three kernels before) and the codes
// read before the wait, h after it. Grid ROWS / 16, THREADS threads.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
ENTRY(const float *h, const int *pair_slot, const int *pair_out, const float *weights, const u8 *arena, const u8 *store,
      long long blob_bytes, long long code0, long long scale0, const float *residual, float *total, float *square) {
    static_assert(MATS == 1 && !DENSE && TILES == 1 && ROWS % 16 == 0 && COMBINE <= 32,
                  "down, a 16-row tile a block, whole tiles");
#if !EARLY
    pdl_wait();  // before any global read or write
#endif
    const int tid = threadIdx.x, j = tid / GTHREADS;  // the group's pair
    const int entry = pair_slot[j];
    const int rank = tid < COMBINE * 16 ? pair_out[tid / 16] : 0;  // of the pair whose sums this thread takes
    float mix[COMBINE], before = 0.f;  // threads < 16: the weights by rank, the tile's residual
#pragma unroll
    for (int k = 0; k < COMBINE; ++k) mix[k] = tid < 16 ? weights[k] : 0.f;
    if (tid < 16) before = residual[blockIdx.x * 16 + tid];
    float sum[1];
    const int row = expert_gemv<1>(h + (long long)j * COLS, entry, arena, store, blob_bytes, code0, code0, scale0,
                                   scale0, sum);
    __shared__ float y[COMBINE][16];  // by rank
    if (row >= 0) y[rank][tid % 16] = sum[0];
    __syncthreads();
    if (tid < 16) {
        float mixed = 0.f;
#pragma unroll
        for (int k = 0; k < COMBINE; ++k) mixed = fmaf(mix[k], y[k][tid], mixed);
        const float t = before + mixed;
        total[blockIdx.x * 16 + tid] = t;
        float s = t * t;
#pragma unroll
        for (int offset = 8; offset > 0; offset /= 2) s += __shfl_xor_sync(0x0000FFFFu, s, offset);
        if (tid == 0) square[blockIdx.x] = s;
    }
}
#else
// x: (T, COLS) float32, row x_table[j] (gate|up) or j (down: h); arena / store: (slots, blob_bytes) blobs; code* /
// scale*: byte offsets of the matrices' codes and scales in a blob; out: (J, ROWS) h (gate|up) or rows
// out_table[j] of (P, ROWS) (down). Grid (ceil(ceil(ROWS / 16) / TILES), pairs), THREADS threads.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
ENTRY(const float *x, const int *x_table, const int *pair_slot, const u8 *arena, const u8 *store, long long blob_bytes,
      long long code0, long long code1, long long scale0, long long scale1, int first_pair, const int *out_table,
      float *out) {
#if !EARLY
    pdl_wait();  // before any global read or write
#endif
    const int j = first_pair + blockIdx.y;
    const int entry = pair_slot[j];
    const float *x_row = x + (long long)(MATS == 2 ? x_table[j] : j) * COLS;  // its index read beside the slot's
    float sum[MATS];
    const int row = expert_gemv<MATS>(x_row, entry, arena, store, blob_bytes, code0, code1, scale0, scale1, sum);
    if (row < 0) return;
    if (MATS == 2) {
        out[(long long)j * ROWS + row] = silu_times(sum[0], sum[MATS - 1]);
    } else {
        out[(long long)out_table[j] * ROWS + row] = sum[0];
    }
}
#endif
