// Included by flash_attention.cu (flash_attention.source inlines it there, after the helpers): what
// float32 keys and values take. split_planes splits them once per call into bf16 planes, hi and lo,
// the keys padded to HDP dims and 64 keys, the values transposed, so that every tile of every query
// block is a plain 16-byte copy into shared memory (load_tile); and at up to 96 dims the products'
// mma are issued over every n-tile / d-tile in turn (scores, accumulate: INTERLEAVE). With SPLIT_QK
// (SPLIT_PV) 0 the products of the keys (values) are plain bf16, and their lo planes are neither
// written nor read.

#if F32_KV
// 16 bytes from global to shared memory: cp.async (completes at cp_async_wait_*) when two tiles
// alternate (STAGES 2), else a plain load and store
__device__ __forceinline__ void copy16(u16 *dst, const u16 *src) {
#if STAGES == 2
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src)
                 : "memory");
#else
    *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(src);
#endif
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

__device__ __forceinline__ void cp_async_wait_all_but_newest() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }

// Keys [key0, key0 + BN) into ks[part][j][d] and values transposed into vt[part][d][j], from
// split_planes' planes of this (image, head): keys (2, keys_padded, HDP) and values (2, HD,
// keys_padded), already zero past the last key and HD: plain 16-byte copies (the hi parts alone
// where a product is plain bf16).
__device__ __forceinline__ void load_tile(const u16 *kp, const u16 *vp, int keys_padded, int key0, u16 (*ks)[BN][KP],
                                          u16 (*vt)[HD][VP]) {
    const long long k_part = (long long)keys_padded * HDP, v_part = (long long)HD * keys_padded;
    const int k_chunks = HDP / CHUNK, v_chunks = BN / CHUNK;
    for (int idx = threadIdx.x; idx < K_PARTS * BN * k_chunks; idx += WARPS * 32) {
        int part = idx / (BN * k_chunks), rest = idx % (BN * k_chunks), j = rest / k_chunks, c = rest % k_chunks;
        copy16(&ks[part][j][c * CHUNK], kp + part * k_part + (long long)(key0 + j) * HDP + c * CHUNK);
    }
    for (int idx = threadIdx.x; idx < V_PARTS * HD * v_chunks; idx += WARPS * 32) {
        int part = idx / (HD * v_chunks), rest = idx % (HD * v_chunks), d = rest / v_chunks, c = rest % v_chunks;
        copy16(&vt[part][d][c * CHUNK], vp + part * v_part + (long long)d * keys_padded + key0 + c * CHUNK);
    }
}
#endif

#if INTERLEAVE
// S (16 x BN of this warp) = Q K^T over the tile: per k-step, each of the three split products over
// every n-tile in turn, so that consecutive mma feed different accumulators (a chain of dependent
// mma per n-tile would leave the tensor cores waiting on each one's latency); each accumulator
// still sums Qlo Khi, Qhi Klo, Qhi Khi per k-step, in that order.
// A head dim of 8 past a multiple of 16 (72: the Qwen3-VL and SigLIP towers') ends on half a k-step:
// with HALF_KSTEP (default 1) its products are m16n8k8 (the last 8 dims, not 16 of which 8 are the
// planes' zero padding): a tenth fewer mma and key fragment reads for Q K^T at hd 72.
#ifndef HALF_KSTEP
#define HALF_KSTEP 1
#endif
#define LAST_HALF (HALF_KSTEP && HD % 16 == 8)

// c += a (16 x 8, row: a[0], a[1] as m16n8k16's) b (8 x 8, col: b0), bf16 -> fp32
__device__ __forceinline__ void mma_k8(float c[4], const u32 a[4], u32 b0) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(b0));
}

__device__ __forceinline__ void scores(float s[BN / 8][4], const u32 qh[KSTEPS][4], const u32 ql[KSTEPS][4],
                                       u16 (*ks)[BN][KP], int g, int t) {
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
        const int col = kk * 16 + 2 * t;
        if (LAST_HALF && kk == KSTEPS - 1) {  // dims kk * 16 ... + 7 only; the same three products in order
            u32 hi[BN / 8];
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt) hi[nt] = smem_pair(ks[0][nt * 8 + g], col);
#if SPLIT_QK
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt) mma_k8(s[nt], ql[kk], hi[nt]);
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt) mma_k8(s[nt], qh[kk], smem_pair(ks[1][nt * 8 + g], col));
#endif
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt) mma_k8(s[nt], qh[kk], hi[nt]);
            continue;
        }
        u32 hi[BN / 8][2];
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
            hi[nt][0] = smem_pair(ks[0][nt * 8 + g], col);
            hi[nt][1] = smem_pair(ks[0][nt * 8 + g], col + 8);
        }
#if SPLIT_QK
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) mma(s[nt], ql[kk], hi[nt][0], hi[nt][1]);
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt)
            mma(s[nt], qh[kk], smem_pair(ks[1][nt * 8 + g], col), smem_pair(ks[1][nt * 8 + g], col + 8));
#endif
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) mma(s[nt], qh[kk], hi[nt][0], hi[nt][1]);
    }
}

// O (16 x HD of this warp) += P V over the tile, P from the scores' registers split in two parts;
// the products interleaved over the d-tiles as in scores: per accumulator Plo Vhi, Phi Vlo, Phi Vhi.
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
        const int col = kk * 16 + 2 * t;
#pragma unroll
        for (int d0 = 0; d0 < DTILES; d0 += DGROUP) {  // groups of d-tiles: their Vhi fragments in registers
            u32 hi[DGROUP][2];
#pragma unroll
            for (int j = 0; j < DGROUP; ++j) {
                if (d0 + j < DTILES) {
                    hi[j][0] = smem_pair(vt[0][(d0 + j) * 8 + g], col);
                    hi[j][1] = smem_pair(vt[0][(d0 + j) * 8 + g], col + 8);
                }
            }
#if SPLIT_PV
#pragma unroll
            for (int j = 0; j < DGROUP; ++j)
                if (d0 + j < DTILES) mma(o[d0 + j], pl, hi[j][0], hi[j][1]);
#pragma unroll
            for (int j = 0; j < DGROUP; ++j)
                if (d0 + j < DTILES)
                    mma(o[d0 + j], ph, smem_pair(vt[1][(d0 + j) * 8 + g], col),
                        smem_pair(vt[1][(d0 + j) * 8 + g], col + 8));
#endif
#pragma unroll
            for (int j = 0; j < DGROUP; ++j)
                if (d0 + j < DTILES) mma(o[d0 + j], ph, hi[j][0], hi[j][1]);
        }
    }
}
#endif

#if MT > 1
// scores() for a warp's MT m-tiles of 16 queries (WARP_ROWS 32): each key fragment read from shared
// memory feeds the mma of every m-tile; each accumulator s[m][nt] sums the same products in the same
// order as scores() (Qlo Khi, Qhi Klo, Qhi Khi per k-step), so a row's scores are those of WARP_ROWS 16.
__device__ __forceinline__ void scores_rows(float s[MT][BN / 8][4], const u32 qh[MT][KSTEPS][4],
                                            const u32 ql[MT][KSTEPS][4], u16 (*ks)[BN][KP], int g, int t) {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) s[m][nt][0] = s[m][nt][1] = s[m][nt][2] = s[m][nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
        const int col = kk * 16 + 2 * t;
        if (LAST_HALF && kk == KSTEPS - 1) {  // dims kk * 16 ... + 7 only (m16n8k8), as in scores()
            u32 hi[BN / 8];
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt) hi[nt] = smem_pair(ks[0][nt * 8 + g], col);
#if SPLIT_QK
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int nt = 0; nt < BN / 8; ++nt) mma_k8(s[m][nt], ql[m][kk], hi[nt]);
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt) {
                const u32 lo = smem_pair(ks[1][nt * 8 + g], col);
#pragma unroll
                for (int m = 0; m < MT; ++m) mma_k8(s[m][nt], qh[m][kk], lo);
            }
#endif
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int nt = 0; nt < BN / 8; ++nt) mma_k8(s[m][nt], qh[m][kk], hi[nt]);
            continue;
        }
        u32 hi[BN / 8][2];
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
            hi[nt][0] = smem_pair(ks[0][nt * 8 + g], col);
            hi[nt][1] = smem_pair(ks[0][nt * 8 + g], col + 8);
        }
#if SPLIT_QK
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt) mma(s[m][nt], ql[m][kk], hi[nt][0], hi[nt][1]);
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
            const u32 lo0 = smem_pair(ks[1][nt * 8 + g], col), lo1 = smem_pair(ks[1][nt * 8 + g], col + 8);
#pragma unroll
            for (int m = 0; m < MT; ++m) mma(s[m][nt], qh[m][kk], lo0, lo1);
        }
#endif
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt) mma(s[m][nt], qh[m][kk], hi[nt][0], hi[nt][1]);
    }
}

// accumulate() for MT m-tiles: each value fragment feeds every m-tile's mma; per accumulator Plo Vhi,
// Phi Vlo, Phi Vhi, as in accumulate(). RGROUP d-tiles' fragments at a time (MT of them interleaved each:
// fewer registers held than DGROUP's, which at 32 rows a warp spill)
#ifndef RGROUP
#define RGROUP (DTILES % 3 == 0 ? 3 : DTILES % 2 == 0 ? 2 : 1)
#endif
__device__ __forceinline__ void accumulate_rows(float o[MT][DTILES][4], const float p[MT][BN / 8][4],
                                                u16 (*vt)[HD][VP], int g, int t) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
        u32 ph[MT][4], pl[MT][4];
#pragma unroll
        for (int m = 0; m < MT; ++m) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float *c = p[m][2 * kk + (e >> 1)] + (e & 1) * 2;
                split_pair(c[0], c[1], ph[m][e], pl[m][e]);
            }
        }
        const int col = kk * 16 + 2 * t;
#pragma unroll
        for (int d0 = 0; d0 < DTILES; d0 += RGROUP) {
            u32 hi[RGROUP][2];
#pragma unroll
            for (int j = 0; j < RGROUP; ++j) {
                if (d0 + j < DTILES) {
                    hi[j][0] = smem_pair(vt[0][(d0 + j) * 8 + g], col);
                    hi[j][1] = smem_pair(vt[0][(d0 + j) * 8 + g], col + 8);
                }
            }
#if SPLIT_PV
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int j = 0; j < RGROUP; ++j)
                    if (d0 + j < DTILES) mma(o[m][d0 + j], pl[m], hi[j][0], hi[j][1]);
#pragma unroll
            for (int j = 0; j < RGROUP; ++j) {
                if (d0 + j < DTILES) {
                    const u32 lo0 = smem_pair(vt[1][(d0 + j) * 8 + g], col), lo1 = smem_pair(vt[1][(d0 + j) * 8 + g], col + 8);
#pragma unroll
                    for (int m = 0; m < MT; ++m) mma(o[m][d0 + j], ph[m], lo0, lo1);
                }
            }
#endif
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int j = 0; j < RGROUP; ++j)
                    if (d0 + j < DTILES) mma(o[m][d0 + j], ph[m], hi[j][0], hi[j][1]);
        }
    }
}
#endif

// The values' planes of a block's PLANE_KEYS keys from its shared tile (key j's value at tile[j][d]),
// written along the keys: hi at vz[d * keys_padded + key], lo v_part further where P V is split.
__device__ __forceinline__ void store_value_planes(float (*tile)[HD + 1], u16 *vz, long long v_part,
                                                   int keys_padded, int key0) {
    for (int idx = threadIdx.x; idx < HD * PLANE_KEYS; idx += blockDim.x) {
        int d = idx / PLANE_KEYS, j = idx % PLANE_KEYS;
        u32 hi, lo;
        split(tile[j][d], hi, lo);
        vz[(long long)d * keys_padded + key0 + j] = (u16)hi;
        if (SPLIT_PV) vz[v_part + (long long)d * keys_padded + key0 + j] = (u16)lo;
    }
}

// Float32 keys and values (rows of heads x HD, image z's key j at row z * positions + j) -> bf16
// planes per (image, head): keys (2, keys_padded, HDP) hi and lo, values transposed (2, HD,
// keys_padded); zero past the last key and (keys) past HD; a lo plane only where its product is split. Block (x, y, z) = (PLANE_KEYS keys, head,
// image), 256 threads; the values pass through shared memory to be written along the keys.
extern "C" __global__ void __launch_bounds__(256) split_planes(const float *k, const float *v, u16 *kp, u16 *vp,
                                                               int positions, int keys_padded, int heads) {
    __shared__ float tile[PLANE_KEYS][HD + 1];
    const int key0 = blockIdx.x * PLANE_KEYS, head = blockIdx.y, z = blockIdx.z;
    const long long row_pitch = (long long)heads * HD, rows_at = (long long)z * positions;
    const long long plane_at = ((long long)z * heads + head) * 2 * keys_padded;
    u16 *kz = kp + plane_at * HDP, *vz = vp + plane_at * HD;
    const long long k_part = (long long)keys_padded * HDP, v_part = (long long)HD * keys_padded;
    for (int idx = threadIdx.x; idx < PLANE_KEYS * HDP; idx += blockDim.x) {
        int j = idx / HDP, d = idx % HDP, key = key0 + j;
        bool real = key < positions && d < HD;
        long long at = (rows_at + key) * row_pitch + (long long)head * HD + d;
        u32 hi = 0, lo = 0;
        if (real) split(k[at], hi, lo);
        kz[(long long)key * HDP + d] = (u16)hi;
        if (SPLIT_QK) kz[k_part + (long long)key * HDP + d] = (u16)lo;
        if (d < HD) tile[j][d] = key < positions ? v[at] : 0.f;
    }
    __syncthreads();
    store_value_planes(tile, vz, v_part, keys_padded, key0);
}

// rope_planes below: 1 = a thread per rotary pair (each q and k read once; flash_attention.IMAGE_DEFINES,
// MOEBUS_FLASH_ROPE_PAIRS), 0 = a thread per dim. The same values either way.
#ifndef ROPE_PAIRS
#define ROPE_PAIRS 0
#endif

// The product's value at dim d of a head's row after the 2-D (or M-) rotary, rotate-half form: the
// pair (i, i + HD/2) turns by cos/sin of its frequency i at the position of axis axes[i]; each
// product and sum rounded on its own (no fused multiply-add), as mrope_ref in numpy computes it.
__device__ __forceinline__ float rotated(float own, float partner, float c, float s, bool first_half) {
    return first_half ? __fsub_rn(__fmul_rn(own, c), __fmul_rn(partner, s))
                      : __fadd_rn(__fmul_rn(own, c), __fmul_rn(partner, s));
}

// split_planes after the tower's rotary, with the qkv product's biases, in one pass: q, k, v the three
// results of the fused qkv product without their biases (rows of heads x HD each; image z's key j at
// row z * positions + j), bias (3, heads x HD) bf16 bits (q's, k's, v's); the rotary's positions
// rope_pos (rows, axes_count) int32, axes (HD/2) int32, tables cos, sin (., HD/2) float32. Writes
// q_out = mrope(q + q's bias) (float32, q's shape) and the planes of mrope(k + k's bias) and of
// v + v's bias exactly as split_planes writes those of its k and v. Block (x, y, z) = (PLANE_KEYS
// keys, head, image), 256 threads.
extern "C" __global__ void __launch_bounds__(256) rope_planes(const float *q, const float *k, const float *v,
                                                              const u16 *bias, const int *rope_pos, int axes_count,
                                                              const int *axes, const float *cos_table,
                                                              const float *sin_table, float *q_out, u16 *kp, u16 *vp,
                                                              int positions, int keys_padded, int heads) {
    __shared__ float tile[PLANE_KEYS][HD + 1];
    const int key0 = blockIdx.x * PLANE_KEYS, head = blockIdx.y, z = blockIdx.z, half = HD / 2;
    const long long row_pitch = (long long)heads * HD, rows_at = (long long)z * positions;
    const long long plane_at = ((long long)z * heads + head) * 2 * keys_padded;
    u16 *kz = kp + plane_at * HDP, *vz = vp + plane_at * HD;
    const u16 *q_bias = bias + head * HD, *k_bias = q_bias + row_pitch, *v_bias = k_bias + row_pitch;
    const long long k_part = (long long)keys_padded * HDP, v_part = (long long)HD * keys_padded;
#if ROPE_PAIRS
    // a thread per pair (i, i + HD/2) of a key, then per padding dim past HD: each pair's loads and its
    // rotary lookups once (the per-dim loop below reads each q and k twice, as its own and as its partner's)
    constexpr int SLOTS = HD / 2 + (HDP - HD);
    for (int idx = threadIdx.x; idx < PLANE_KEYS * SLOTS; idx += blockDim.x) {
        const int j = idx / SLOTS, i = idx % SLOTS, key = key0 + j;
        if (i >= half) {  // a padding dim: zero in both key planes
            const int d = HD + i - half;
            kz[(long long)key * HDP + d] = 0;
            if (SPLIT_QK) kz[k_part + (long long)key * HDP + d] = 0;
            continue;
        }
        const long long row = rows_at + key, at = row * row_pitch + (long long)head * HD + i;
        u32 hi0 = 0, lo0 = 0, hi1 = 0, lo1 = 0;
        float v0 = 0.f, v1 = 0.f;
        if (key < positions) {
            const int p = rope_pos[row * axes_count + axes[i]];
            const float c = cos_table[p * half + i], s = sin_table[p * half + i];
            const float q0 = __fadd_rn(q[at], bf16_value(q_bias[i]));
            const float q1 = __fadd_rn(q[at + half], bf16_value(q_bias[i + half]));
            const float k0 = __fadd_rn(k[at], bf16_value(k_bias[i]));
            const float k1 = __fadd_rn(k[at + half], bf16_value(k_bias[i + half]));
            q_out[at] = rotated(q0, q1, c, s, true);
            q_out[at + half] = rotated(q1, q0, c, s, false);
            split(rotated(k0, k1, c, s, true), hi0, lo0);
            split(rotated(k1, k0, c, s, false), hi1, lo1);
            v0 = __fadd_rn(v[at], bf16_value(v_bias[i]));
            v1 = __fadd_rn(v[at + half], bf16_value(v_bias[i + half]));
        }
        kz[(long long)key * HDP + i] = (u16)hi0;
        kz[(long long)key * HDP + i + half] = (u16)hi1;
        if (SPLIT_QK) {
            kz[k_part + (long long)key * HDP + i] = (u16)lo0;
            kz[k_part + (long long)key * HDP + i + half] = (u16)lo1;
        }
        tile[j][i] = v0;
        tile[j][i + half] = v1;
    }
#else
    for (int idx = threadIdx.x; idx < PLANE_KEYS * HDP; idx += blockDim.x) {
        int j = idx / HDP, d = idx % HDP, key = key0 + j;
        bool real = key < positions && d < HD;
        long long row = rows_at + key, at = row * row_pitch + (long long)head * HD + d;
        u32 hi = 0, lo = 0;
        if (real) {
            const bool first_half = d < half;
            const int i = first_half ? d : d - half, other = first_half ? d + half : d - half;
            const long long other_at = at - d + other;
            const int p = rope_pos[row * axes_count + axes[i]];
            const float c = cos_table[p * half + i], s = sin_table[p * half + i];
            const float q_own = __fadd_rn(q[at], bf16_value(q_bias[d]));
            const float q_other = __fadd_rn(q[other_at], bf16_value(q_bias[other]));
            const float k_own = __fadd_rn(k[at], bf16_value(k_bias[d]));
            const float k_other = __fadd_rn(k[other_at], bf16_value(k_bias[other]));
            q_out[at] = rotated(q_own, q_other, c, s, first_half);
            split(rotated(k_own, k_other, c, s, first_half), hi, lo);
        }
        kz[(long long)key * HDP + d] = (u16)hi;
        if (SPLIT_QK) kz[k_part + (long long)key * HDP + d] = (u16)lo;
        if (d < HD) tile[j][d] = key < positions ? __fadd_rn(v[at], bf16_value(v_bias[d])) : 0.f;
    }
#endif
    __syncthreads();
    store_value_planes(tile, vz, v_part, keys_padded, key0);
}
