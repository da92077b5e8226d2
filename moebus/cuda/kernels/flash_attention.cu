// Fused (flash) attention on tensor cores: a block of WARPS warps per (tile of BM queries, query head,
// image); the keys and values stream through shared memory in tiles of BN, the softmax runs online
// in fp32 registers and the probabilities never leave the SM. Products are mma.sync m16n8k16 bf16
// -> fp32 on split operands: a float32 x = hi + lo (hi = bf16(x), lo = bf16(x - hi)), so
//   S = Qhi K + Qlo K            (bf16 keys: exact)      or  Qhi Khi + Qhi Klo + Qlo Khi  (float32 keys)
//   O = Phi V + Plo V            (bf16 values: exact)    or  Phi Vhi + Phi Vlo + Plo Vhi  (float32 values)
// which leaves ~2^-16 relative error per term, fp32 sums. Float32 keys and values may take plain
// bf16 products instead (one mma: S = Qhi Khi with SPLIT_QK 0, O = Phi Vhi with SPLIT_PV 0; ~2^-9
// relative per operand): the towers' precision choice (flash_attention.IMAGE_PRECISION).
// flash_attention.py documents the parameters; flash_attention_ref there is this kernel's
// arithmetic in numpy.
//
// Compiled by NVRTC at run time with HEAD_DIM (a multiple of 8, <= 128) and F32_KV (0: keys and
// values are bf16 bits, 1: float32) defined, WARPS (4 or 8) and WARP_ROWS (queries a warp: 16, or
// 32 for float32 keys of up to 96 dims: two m-tiles, so that each key / value fragment read from
// shared memory feeds two mma; each row's arithmetic is the same at either). Float32 keys and
// values come split once per call into bf16 planes (split_planes, flash_planes.cuh, included below);
// SPLIT_QK and SPLIT_PV (default 1) say whether their products use the lo planes.
// Fragment layouts (PTX ISA, mma.m16n8k16, bf16): with
// g = lane / 4 and t = lane % 4, A (16 x 16, row) a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g,
// 2t+8..), a3 = (g+8, 2t+8..); B (16 x 8, col) b0 = (k 2t..2t+1, n g), b1 = (k 2t+8.., n g); C
// (16 x 8) c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1).

#ifndef HEAD_DIM
#error "define HEAD_DIM"
#endif
#ifndef F32_KV
#error "define F32_KV"
#endif

#define HD HEAD_DIM
#define HDP ((HD + 15) / 16 * 16)       // the contraction of Q K^T, padded with zeros
#define KSTEPS (HDP / 16)
#define DTILES (HD / 8)                 // n-tiles of O
#define PARTS (F32_KV ? 2 : 1)          // parts of a key / value in split_planes' planes
#ifndef SPLIT_QK
#define SPLIT_QK 1
#endif
#ifndef SPLIT_PV
#define SPLIT_PV 1
#endif
#define K_PARTS (F32_KV && SPLIT_QK ? 2 : 1)  // parts of a key / value kept in shared memory
#define V_PARTS (F32_KV && SPLIT_PV ? 2 : 1)
#define Q_LO (!F32_KV || SPLIT_QK)      // Qlo's products: exact bf16 keys, or split ones
#define P_LO (!F32_KV || SPLIT_PV)
#ifndef WARPS
#define WARPS 4
#endif
#ifndef WARP_ROWS
#define WARP_ROWS 16
#endif
#define MT (WARP_ROWS / 16)             // m-tiles of 16 queries a warp
#define BM (WARP_ROWS * WARPS)          // queries per block
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1                    // blocks an SM must hold at once (registers per thread capped to fit)
#endif
#define PLANE_KEYS 64                   // split_planes pads the keys to a multiple of this (and of BN)
// Float32 keys and values: with STAGES_WANTED 2 (the default) and where two tiles fit the 48 KiB of
// static shared memory, the next tile's copies (cp.async) run while the block computes on this one
#ifndef STAGES_WANTED
#define STAGES_WANTED 2
#endif
#define KP (HDP + 8)                    // row pitches (bf16): conflict-free fragment reads
#define TILE_BYTES_AT(bn) (2 * (K_PARTS * (bn) * KP + V_PARTS * HD * ((bn) + 8)))
#define SMEM_BYTES (48 * 1024)
// Keys per tile (BN; PLANE_KEYS a multiple of it): 64, unless float32 keys and values then fit one
// stage only: two stages of 32 (split images at hd 72: 0.558 ms an attention instead of 0.728 with
// one stage of 64, H200, vltower8), else what one stage holds. flash_attention_ref.tile_keys mirrors it.
#if defined(TILE_KEYS)
#define BN TILE_KEYS
#elif !F32_KV
#define BN 64
#elif STAGES_WANTED == 2 && 2 * TILE_BYTES_AT(64) <= SMEM_BYTES
#define BN 64
#elif STAGES_WANTED == 2 && 2 * TILE_BYTES_AT(32) <= SMEM_BYTES
#define BN 32
#elif TILE_BYTES_AT(64) <= SMEM_BYTES
#define BN 64
#else
#define BN 32
#endif
#define VP (BN + 8)
#define CHUNK 8                         // bf16 elements per 16-byte load
// Float32 keys of up to 96 dims: each product's mma interleaved over the n-tiles / d-tiles (scores,
// accumulate); at more dims the fragments this holds would not fit the registers
#define INTERLEAVE (F32_KV && HDP <= 96)
#define DGROUP (DTILES <= 9 ? DTILES : 8)  // d-tiles whose products accumulate interleaved (accumulate)
#if WARP_ROWS != 16 && !(WARP_ROWS == 32 && INTERLEAVE)
#error "WARP_ROWS: 16, or 32 for float32 keys of up to 96 dims"
#endif
#if F32_KV && STAGES_WANTED == 2 && 2 * TILE_BYTES_AT(BN) <= SMEM_BYTES
#define STAGES 2
#else
#define STAGES 1
#endif

typedef unsigned short u16;
typedef unsigned int u32;
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ u32 f32_bits(float x) { return __float_as_uint(x); }

// bf16 bits of x, rounded to nearest even (as attention_parts._part and gemm.split_rows)
__device__ __forceinline__ u32 bf16_round(float x) {
    u32 bits = f32_bits(x);
    return (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ float bf16_value(u32 bits) { return __uint_as_float(bits << 16); }

// the two parts of x as bf16 bits: hi = bf16(x), lo = bf16(x - hi)
__device__ __forceinline__ void split(float x, u32 &hi, u32 &lo) {
    hi = bf16_round(x);
    lo = bf16_round(x - bf16_value(hi));
}

// (bf16(x0), bf16(x1)) packed, x0 in the low half: one cvt, rounded to nearest even as bf16_round
__device__ __forceinline__ u32 pack_bf16(float x0, float x1) {
    u32 packed;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(x1), "f"(x0));  // the first source is the high half
    return packed;
}

// split() of a pair, packed: hi = (hi(x0), hi(x1)), lo = (lo(x0), lo(x1)); where lo is unused
// (plain bf16 products) the compiler drops its arithmetic
__device__ __forceinline__ void split_pair(float x0, float x1, u32 &hi, u32 &lo) {
    hi = pack_bf16(x0, x1);
    lo = pack_bf16(x0 - __uint_as_float(hi << 16), x1 - __uint_as_float(hi & 0xFFFF0000u));
}

__device__ __forceinline__ void mma(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 smem_pair(const u16 *row, int col) {
    return *reinterpret_cast<const u32 *>(row + col);
}

// Q's fragments for rows r0 (and r0 + 8) of this warp, both parts, scaled by nothing (the scale
// multiplies the fp32 scores): columns past HD are zero.
__device__ __forceinline__ void load_q(const float *q, long long row_pitch, int rows_valid, int r0, u32 qh[KSTEPS][4],
                                       u32 ql[KSTEPS][4], int t) {
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int row = r0 + (e & 1) * 8, col = ks * 16 + 2 * t + (e >> 1) * 8;
            float2 x = make_float2(0.f, 0.f);
            if (row < rows_valid && col < HD) x = *reinterpret_cast<const float2 *>(q + row * row_pitch + col);
            split_pair(x.x, x.y, qh[ks][e], ql[ks][e]);
        }
    }
}

#include "flash_planes.cuh"  // float32 keys and values: their bf16 planes (flash_attention.source inlines it)

#if !F32_KV
// Keys [key0, key0 + BN) into ks[0][j][d] and values transposed into vt[0][d][j], from the bf16
// cache; keys at or past key_end are zeros (never read from memory: a cache's unwritten rows may
// hold any bits).
__device__ __forceinline__ void load_tile(const void *k, const void *v, long long row_stride, int key0, int key_end,
                                          u16 (*ks)[BN][KP], u16 (*vt)[HD][VP]) {
    const int per_row = HD / CHUNK;
    for (int idx = threadIdx.x; idx < BN * per_row; idx += WARPS * 32) {
        int j = idx / per_row, d0 = (idx % per_row) * CHUNK;
        bool real = key0 + j < key_end;
        long long at = (long long)(key0 + j) * row_stride + d0;
        uint4 kx = make_uint4(0, 0, 0, 0), vx = kx;
        if (real) {
            kx = *reinterpret_cast<const uint4 *>(static_cast<const u16 *>(k) + at);
            vx = *reinterpret_cast<const uint4 *>(static_cast<const u16 *>(v) + at);
        }
        *reinterpret_cast<uint4 *>(&ks[0][j][d0]) = kx;
        u32 vw[4] = {vx.x, vx.y, vx.z, vx.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            vt[0][d0 + 2 * e][j] = (u16)(vw[e] & 0xFFFFu);
            vt[0][d0 + 2 * e + 1][j] = (u16)(vw[e] >> 16);
        }
    }
}
#endif

#if !INTERLEAVE
// S (16 x BN of this warp) = Q K^T over the tile, split parts summed in fp32
__device__ __forceinline__ void scores(float s[BN / 8][4], const u32 qh[KSTEPS][4], const u32 ql[KSTEPS][4],
                                       u16 (*ks)[BN][KP], int g, int t) {
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
        s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            const u16 *row = ks[0][nt * 8 + g];
            u32 b0 = smem_pair(row, kk * 16 + 2 * t), b1 = smem_pair(row, kk * 16 + 2 * t + 8);
#if Q_LO
            mma(s[nt], ql[kk], b0, b1);
#endif
#if K_PARTS == 2
            mma(s[nt], qh[kk], smem_pair(ks[1][nt * 8 + g], kk * 16 + 2 * t),
                smem_pair(ks[1][nt * 8 + g], kk * 16 + 2 * t + 8));
#endif
            mma(s[nt], qh[kk], b0, b1);
        }
    }
}

// O (16 x HD of this warp) += P V over the tile, P from the scores' registers, split in two parts
__device__ __forceinline__ void accumulate(float o[DTILES][4], const float p[BN / 8][4], u16 (*vt)[HD][VP], int g,
                                           int t) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
        u32 ph[4], pl[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {  // a0: (g, 2t..) of n-tile 2kk; a1: its row g+8; a2, a3: n-tile 2kk+1
            const float *c = p[2 * kk + (e >> 1)] + (e & 1) * 2;
            split_pair(c[0], c[1], ph[e], pl[e]);
        }
#pragma unroll
        for (int dt = 0; dt < DTILES; ++dt) {
            const u16 *row = vt[0][dt * 8 + g];
            u32 b0 = smem_pair(row, kk * 16 + 2 * t), b1 = smem_pair(row, kk * 16 + 2 * t + 8);
#if P_LO
            mma(o[dt], pl, b0, b1);
#endif
#if V_PARTS == 2
            mma(o[dt], ph, smem_pair(vt[1][dt * 8 + g], kk * 16 + 2 * t),
                smem_pair(vt[1][dt * 8 + g], kk * 16 + 2 * t + 8));
#endif
            mma(o[dt], ph, b0, b1);
        }
    }
}
#endif

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xFFFFFFFFu, x, 1);
    return x + __shfl_xor_sync(0xFFFFFFFFu, x, 2);
}

// Block (x, y, z) = (query tile from the end: the causal blocks with the most keys start first,
// query head, image). q, out: float32 rows of (heads x HD), query i of this z at row
// q_row0 + z * rows_per_z + i. Keys: key j of kv head h at k + k_base + z * k_z_stride +
// h * k_head_stride + j * k_row_stride (elements); values likewise. Query i sits at position
// first_pos + i and sees keys j <= first_pos + i (causal; and j > first_pos + i - window when
// window > 0), or all num_keys keys (not causal). scale_log2 = scale * log2(e).
extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS) flash_attention(
    const float *q, const void *k, const void *v, float *out, int q_row0, int rows_per_z, int num_queries, int heads,
    int group, long long k_base, long long k_z_stride, long long k_head_stride, long long k_row_stride, int num_keys,
    int first_pos, int window, int causal, float scale_log2, int out_parts) {
    __shared__ __align__(16) u16 ks_all[STAGES][K_PARTS][BN][KP];
    __shared__ __align__(16) u16 vt_all[STAGES][V_PARTS][HD][VP];
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    const int tile = gridDim.x - 1 - blockIdx.x, head = blockIdx.y, z = blockIdx.z;
    const int q0 = tile * BM;  // the block's first query
    const long long row_pitch = (long long)heads * HD;
    const long long q_at = ((long long)q_row0 + (long long)z * rows_per_z + q0) * row_pitch + (long long)head * HD;
#if F32_KV
    // split_planes' planes of this (image, head); k_row_stride is their keys_padded
    const int keys_padded = (int)k_row_stride;
    const long long plane_at = ((long long)z * heads + head / group) * PARTS * keys_padded;
    const u16 *kz = static_cast<const u16 *>(k) + plane_at * HDP, *vz = static_cast<const u16 *>(v) + plane_at * HD;
#else
    const long long kv_at = k_base + z * k_z_stride + (long long)(head / group) * k_head_stride;
    const u16 *kz = static_cast<const u16 *>(k) + kv_at, *vz = static_cast<const u16 *>(v) + kv_at;
#endif
    const int rows_valid = num_queries - q0;  // of this block, rows at or past it are not stored
    const int r0 = w * WARP_ROWS + g;          // m-tile m's rows: r0 + 16 m and r0 + 16 m + 8
    u32 qh[MT][KSTEPS][4], ql[MT][KSTEPS][4];
#pragma unroll
    for (int m = 0; m < MT; ++m) load_q(q + q_at, row_pitch, rows_valid, r0 + 16 * m, qh[m], ql[m], t);

#if !F32_KV
    for (int idx = threadIdx.x; idx < PARTS * BN * (KP - HD); idx += WARPS * 32) {  // the zero padding
        int c = idx % (KP - HD), rest = idx / (KP - HD);
        ks_all[0][rest / BN][rest % BN][HD + c] = 0;
    }
#endif
    const int last_query = min(q0 + BM, num_queries) - 1;
    const int key_end = causal ? min(num_keys, first_pos + last_query + 1) : num_keys;
    int key_begin = (causal && window > 0) ? max(0, first_pos + q0 - window + 1) : 0;
    key_begin -= key_begin % BN;

    float o[MT][DTILES][4], row_max[MT][2], row_sum[MT][2];  // rows r0 + 16 m, + 8 (per-thread sums)
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int dt = 0; dt < DTILES; ++dt) o[m][dt][0] = o[m][dt][1] = o[m][dt][2] = o[m][dt][3] = 0.f;
        row_max[m][0] = row_max[m][1] = NEG_INF;
        row_sum[m][0] = row_sum[m][1] = 0.f;
    }
    int pos[MT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m) pos[m][0] = first_pos + q0 + r0 + 16 * m, pos[m][1] = pos[m][0] + 8;

    int stage = 0;
#if STAGES == 2
    if (key_begin < key_end) load_tile(kz, vz, keys_padded, key_begin, ks_all[0], vt_all[0]);
    cp_async_commit();
#endif
    for (int key0 = key_begin; key0 < key_end; key0 += BN) {
#if STAGES == 2
        if (key0 + BN < key_end) load_tile(kz, vz, keys_padded, key0 + BN, ks_all[stage ^ 1], vt_all[stage ^ 1]);
        cp_async_commit();
        cp_async_wait_all_but_newest();  // this thread's copies of this tile have landed
        __syncthreads();                 // and every thread's
#else
        __syncthreads();  // the previous tile (and the padding) are done with
#if F32_KV
        load_tile(kz, vz, keys_padded, key0, ks_all[0], vt_all[0]);
#else
        load_tile(kz, vz, k_row_stride, key0, key_end, ks_all[0], vt_all[0]);
#endif
        __syncthreads();
#endif
        u16(*ks)[BN][KP] = ks_all[stage];
        u16(*vt)[HD][VP] = vt_all[stage];
        float s[MT][BN / 8][4];
#if MT == 1
        scores(s[0], qh[0], ql[0], ks, g, t);
#else
        scores_rows(s, qh, ql, ks, g, t);
#endif
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            float tile_max[2] = {NEG_INF, NEG_INF};
#if F32_KV
            if (!causal && key0 + BN <= num_keys) {  // an image's tile of real keys only: no mask to compute
#pragma unroll
                for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        s[m][nt][e] *= scale_log2;
                        tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[m][nt][e]);
                    }
                }
            } else
#endif
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    int key = key0 + nt * 8 + 2 * t + (e & 1), r = e >> 1;
                    bool seen = causal ? (key <= pos[m][r] && (window <= 0 || key > pos[m][r] - window)) : key < num_keys;
                    s[m][nt][e] = seen ? s[m][nt][e] * scale_log2 : NEG_INF;
                    tile_max[r] = fmaxf(tile_max[r], s[m][nt][e]);
                }
            }
            float shrink[2], base[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float new_max = fmaxf(row_max[m][r], quad_max(tile_max[r]));
                base[r] = new_max == NEG_INF ? 0.f : new_max;  // a row with nothing seen yet stays at 0
                shrink[r] = exp2f(row_max[m][r] - base[r]);
                row_max[m][r] = new_max;
                row_sum[m][r] *= shrink[r];
            }
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    s[m][nt][e] = exp2f(s[m][nt][e] - base[e >> 1]);
                    row_sum[m][e >> 1] += s[m][nt][e];
                }
            }
#pragma unroll
            for (int dt = 0; dt < DTILES; ++dt) {
                o[m][dt][0] *= shrink[0];
                o[m][dt][1] *= shrink[0];
                o[m][dt][2] *= shrink[1];
                o[m][dt][3] *= shrink[1];
            }
        }
#if MT == 1
        accumulate(o[0], s[0], vt, g, t);
#else
        accumulate_rows(o, s, vt, g, t);
#endif
#if STAGES == 2
        __syncthreads();  // every warp is done with this stage before the next round's copies refill it
        stage ^= 1;
#endif
    }
    // out_parts 0: float32 rows; 1 or 2: the next product's split input instead (gemm.split_rows'
    // parts of those values: (out_parts, gridDim.z * rows_per_z, heads x HD) bf16 bits at out)
    const long long part_stride = (long long)gridDim.z * rows_per_z * row_pitch;
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            int row = r0 + 16 * m + 8 * r;
            float total = quad_sum(row_sum[m][r]);
            float inverse = total > 0.f ? 1.f / total : 0.f;
            if (row < rows_valid) {
                if (out_parts) {
                    u32 *dst = reinterpret_cast<u32 *>(reinterpret_cast<u16 *>(out) + q_at + row * row_pitch);
#pragma unroll
                    for (int dt = 0; dt < DTILES; ++dt) {
                        u32 hi, lo;
                        split_pair(o[m][dt][2 * r] * inverse, o[m][dt][2 * r + 1] * inverse, hi, lo);
                        dst[(dt * 8 + 2 * t) / 2] = hi;
                        if (out_parts == 2) dst[(part_stride + dt * 8 + 2 * t) / 2] = lo;
                    }
                } else {
                    float *dst = out + q_at + row * row_pitch;
#pragma unroll
                    for (int dt = 0; dt < DTILES; ++dt)
                        *reinterpret_cast<float2 *>(dst + dt * 8 + 2 * t) =
                            make_float2(o[m][dt][2 * r] * inverse, o[m][dt][2 * r + 1] * inverse);
                }
            }
        }
    }
}

