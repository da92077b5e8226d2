// Decode attention on tensor cores (attention_decode_tc.py; fifteenth session, an experiment beside the numba
// kernel of attention_decode.py): one block of DWARPS warps per (token, kv head, split), the split's keys
// [first, end) cut as attention_decode.splitter cuts them (decode_splits, split_positions), so its merge
// (attention_decode.merge_splits, apart) combines the partials this kernel leaves in the decode scratch
// (T, heads, scratch_splits, HD + 2): sum_j e^(s_j - m) v_j, m (natural units), sum_j e^(s_j - m).
// The products are flash_attention.cu's mma.sync m16n8k16 on split bf16 parts (fp32 sums): the group's query
// heads are the rows of A (head g of lane g = lane / 4: a group of at most 8; rows g + 8 zero), each warp takes
// 16 keys at a time (tiles w, w + DWARPS, ... of the split): S = Q K^T as two n-tiles of 8 keys, then
// O += P V over the 16 keys. No shared memory on the way: each lane loads its fragments straight from the
// cache with 16-byte loads, the contraction's dims permuted so that a lane's are contiguous:
//   Q K^T: k-row 2t + j of k-step ks is dim 32 t + 4 ks + j, k-row 2t + 8 + j is dim 32 t + 4 ks + 2 + j (t = lane % 4)
//          so lane (g, t) reads key g's dims [32 t, 32 t + 32) (64 bytes) for each n-tile;
//   P V:   column g of d-tile dt is dim 16 g + dt, so lane (g, t) reads keys 2t, 2t+1, 2t+8, 2t+9's dims
//          [16 g, 16 g + 16) (32 bytes each) and packs key pairs with byte permutes.
// The warps' states are combined through shared memory at the end. Compiled with HEAD_DIM 128, F32_KV 0.
// Given counters (done, out not null; attention_decode.TC_MERGE_IN_SPLIT, sixteenth session) the kernel merges
// too, with no merge_splits launch: a token whose positions make one split writes its normalized output
// directly (no partials, no counter); else the last split block of a (token, kv head) to finish (a counter a
// pair, which that block resets for the next launch or graph replay) merges the group's heads as
// attention_decode.merger does, in the same order with the same expressions (expf, fmaf, a division: the
// same bits as the merge apart).
// With TC_PDL (attention_decode.TC_PDL, sixteenth session) every block waits first (griddepcontrol.wait, before
// any global read; PDL_TRIGGER: then releases its dependents, as pdl.grid_dependency_wait does), and the entry
// is TC_ENTRY (decode_attention_tc_pdl), so a captured graph's edge into it may be programmatic (pdl.py).
// With ROPE (attention_decode_tc.launch_rope, twenty-third session) the kernel takes the fused q | k | v projection's
// row instead of q and does fused.qkv_rope_store's work for its (token, kv head) first, as its prologue: a warp a
// row (the group's q heads, then k, then v), a lane its elements lane + 32 i (fused.head_rope_store's layout and
// expressions: the squares in i order then an xor butterfly, 1 / sqrtf, w * (x * 1 / rms), x1 c - x2 s and
// x2 c + x1 s); q into shared memory (float32, as q_out held it), k and v rounded to bf16 (as the cache holds them)
// into shared memory, from where the last split's block writes them into the caches and its warps take the token's
// own key and value (never from global memory: this kernel writes that row). qkv_rope_store's kernel (2.8 us true a
// layer at A3B b1) leaves the decode's chain. EARLY_KV: the position and slot (the step's inputs, copied before the
// graph) and an L1 prefetch of each lane's first 16 keys' lines before the PDL wait.

#include "flash_attention.cu"

#ifndef DWARPS
#define DWARPS 4
#endif
#ifndef MIN_BLOCKS_TC
#define MIN_BLOCKS_TC 2
#endif
#ifndef MERGE_CAP
#define MERGE_CAP 256           // splits the in-block merge takes at most (a multiple of 32)
#endif
#ifndef TC_PDL
#define TC_PDL 0
#endif
#ifndef PDL_TRIGGER
#define PDL_TRIGGER 0
#endif
#ifndef TC_ENTRY
#define TC_ENTRY decode_attention_tc
#endif
#ifndef ROPE
#define ROPE 0                  // 1: q | k | v from the fused projection, qkv_rope_store's work first (above)
#endif
#ifndef EARLY_KV
#define EARLY_KV 0              // ROPE: the token's place and its first keys' prefetch before the PDL wait
#endif
#define ROPE_ROWS ((8 + 2 + DWARPS - 1) / DWARPS)  // rows a warp takes in the prologue (group q heads, k, v)
#define LANE_ELEMS (HD / 32)    // a row's elements a lane holds in the prologue: lane + 32 i
#define KEYS 16
#define MERGE_CHUNK 4           // splits whose values a merging thread loads at once
#define MERGE_OUTS (8 * HD / (DWARPS * 32))  // outputs a merging thread writes (a group of at most 8)
#define LANE_DIMS (HD / 4)      // dims of a key a lane reads for Q K^T (32 at hd 128)
#define V_DIMS (HD / 8)         // dims of a value a lane reads for P V (16 at hd 128)

__device__ __forceinline__ uint4 load16(const u16 *p) { return __ldg(reinterpret_cast<const uint4 *>(p)); }
// 8 bf16 of a cached key or value row at ``row``; in the ROPE build the token's own row (``key`` its position, which
// this kernel writes) from ``own`` in shared memory instead (unevaluated otherwise: new_sh is ROPE's)
#if ROPE
#define CACHED_OR_OWN(row, key, own) ((key) == position ? *reinterpret_cast<const uint4 *>(own) : load16(row))
#else
#define CACHED_OR_OWN(row, key, own) load16(row)
#endif

// out[t_tok, the group's heads] from the partials of their num_splits splits (the other blocks' through L2:
// __ldcg, never a line L1 kept), as attention_decode.merger: a warp a head loads every split's max and sum at
// once, the peak by a butterfly (max: any order), the weights expf(m_s - peak) and the sums into shared memory
// (stats: 8 x MERGE_CAP pairs); then each thread adds its outputs' values and sums weighted, split after split
// in order (fmaf), MERGE_CHUNK splits' values in flight, and divides.
__device__ __forceinline__ void merge_in_block(const float *partial, float *out, float2 *stats, int t_tok,
                                               int kv_head, int group, int heads, int scratch_splits,
                                               int num_splits) {
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
    const long long head0 = (long long)t_tok * heads + kv_head * group;
    for (int j = w; j < group; j += DWARPS) {  // warp-uniform: every lane takes part in the butterfly
        const float *row = partial + (head0 + j) * scratch_splits * (HD + 2) + HD;
        float m[MERGE_CAP / 32], sum[MERGE_CAP / 32], peak = NEG_INF;
#pragma unroll
        for (int i = 0; i < MERGE_CAP / 32; ++i) {
            const bool valid = lane + 32 * i < num_splits;
            m[i] = valid ? __ldcg(row + (long long)(lane + 32 * i) * (HD + 2)) : NEG_INF;
            sum[i] = valid ? __ldcg(row + (long long)(lane + 32 * i) * (HD + 2) + 1) : 0.f;
        }
#pragma unroll
        for (int i = 0; i < MERGE_CAP / 32; ++i) peak = fmaxf(peak, m[i]);
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2)
            peak = fmaxf(peak, __shfl_xor_sync(0xFFFFFFFFu, peak, offset));
#pragma unroll
        for (int i = 0; i < MERGE_CAP / 32; ++i) {
            if (lane + 32 * i < num_splits)
                stats[j * MERGE_CAP + lane + 32 * i] = make_float2(expf(m[i] - peak), sum[i]);
        }
    }
    __syncthreads();
    float value[MERGE_OUTS], total[MERGE_OUTS];
#pragma unroll
    for (int k = 0; k < MERGE_OUTS; ++k) value[k] = total[k] = 0.f;
    for (int s0 = 0; s0 < num_splits; s0 += MERGE_CHUNK) {
        float vals[MERGE_OUTS][MERGE_CHUNK];
#pragma unroll
        for (int k = 0; k < MERGE_OUTS; ++k) {  // every load first
            const int e = min((int)threadIdx.x + k * DWARPS * 32, group * HD - 1);
            const float *row = partial + (head0 + e / HD) * scratch_splits * (HD + 2) + e % HD;
#pragma unroll
            for (int c = 0; c < MERGE_CHUNK; ++c)
                vals[k][c] = __ldcg(row + (long long)min(s0 + c, num_splits - 1) * (HD + 2));
        }
#pragma unroll
        for (int k = 0; k < MERGE_OUTS; ++k) {
            const int j = min((int)threadIdx.x + k * DWARPS * 32, group * HD - 1) / HD;
#pragma unroll
            for (int c = 0; c < MERGE_CHUNK; ++c) {
                if (s0 + c < num_splits) {
                    const float2 stat = stats[j * MERGE_CAP + s0 + c];  // (weight, sum)
                    total[k] = fmaf(stat.y, stat.x, total[k]);
                    value[k] = fmaf(vals[k][c], stat.x, value[k]);
                }
            }
        }
    }
#pragma unroll
    for (int k = 0; k < MERGE_OUTS; ++k) {
        const int e = threadIdx.x + k * DWARPS * 32;
        if (e < group * HD) out[head0 * HD + e] = value[k] / total[k];
    }
}

__device__ __forceinline__ void prefetch_l1(const void *p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }

// The lines of a warp's first 16 keys (from key0) that its lanes read (K: key key0 + 8 nt + g's dims [32 t, 32 t + 32);
// V: keys key0 + 2 t + {0, 1, 8, 9}'s dims [16 g, 16 g + 16)) into L1: a hint, never a read of their values.
__device__ __forceinline__ void prefetch_keys(const u16 *k, const u16 *v, long long base, int key0, int end, int g,
                                              int t) {
    if (key0 >= end) return;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) prefetch_l1(k + (base + min(key0 + 8 * nt + g, end - 1)) * HD + LANE_DIMS * t);
#pragma unroll
    for (int j = 0; j < 4; ++j)
        prefetch_l1(v + (base + min(key0 + 2 * t + (j & 1) + 8 * (j >> 1), end - 1)) * HD + V_DIMS * g);
}

// ROPE's prologue: fused.qkv_rope_store's work for token t_tok's kv head (its group's q heads, k and v) into q_sh
// (float32) and new_sh (bf16 bits: k rotated, v), every warp its rows w, w + DWARPS, ... of [group q heads, k, v].
__device__ __forceinline__ void rope_rows(const float *qkv, const u16 *q_weight, const u16 *k_weight, float eps,
                                          const float *cos_table, const float *sin_table, int t_tok, int kv_head,
                                          int heads, int kv_heads, int group, int position, float (*q_sh)[HD],
                                          u16 (*new_sh)[HD]) {
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
    const float *row0 = qkv + (long long)t_tok * (heads + 2 * kv_heads) * HD;
    float values[ROPE_ROWS][LANE_ELEMS], qw[LANE_ELEMS], kw[LANE_ELEMS], cs[LANE_ELEMS / 2], sn[LANE_ELEMS / 2];
#pragma unroll
    for (int r = 0; r < ROPE_ROWS; ++r) {  // every load first
        const int row = min(w + r * DWARPS, group + 1);
        const int col = row < group ? kv_head * group + row : (row == group ? heads : heads + kv_heads) + kv_head;
#pragma unroll
        for (int i = 0; i < LANE_ELEMS; ++i) values[r][i] = row0[(long long)col * HD + lane + 32 * i];
    }
#pragma unroll
    for (int i = 0; i < LANE_ELEMS; ++i) {
        qw[i] = bf16_value(q_weight[lane + 32 * i]);
        kw[i] = bf16_value(k_weight[lane + 32 * i]);
    }
#pragma unroll
    for (int i = 0; i < LANE_ELEMS / 2; ++i) {
        cs[i] = cos_table[(long long)position * (HD / 2) + lane + 32 * i];
        sn[i] = sin_table[(long long)position * (HD / 2) + lane + 32 * i];
    }
#pragma unroll
    for (int r = 0; r < ROPE_ROWS; ++r) {
        const int row = w + r * DWARPS;  // warp-uniform
        if (row > group + 1) break;
        if (row == group + 1) {  // v: as the cache holds it
#pragma unroll
            for (int i = 0; i < LANE_ELEMS; ++i) new_sh[1][lane + 32 * i] = (u16)bf16_round(values[r][i]);
            continue;
        }
        float square = 0.f;
#pragma unroll
        for (int i = 0; i < LANE_ELEMS; ++i) square += values[r][i] * values[r][i];
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) square += __shfl_xor_sync(0xFFFFFFFFu, square, offset);
        const float inv_rms = 1.f / sqrtf(square / (float)HD + eps);
        const bool is_q = row < group;
#pragma unroll
        for (int i = 0; i < LANE_ELEMS; ++i) values[r][i] = (is_q ? qw[i] : kw[i]) * (values[r][i] * inv_rms);
#pragma unroll
        for (int i = 0; i < LANE_ELEMS / 2; ++i) {
            const int d = lane + 32 * i;
            const float x1 = values[r][i], x2 = values[r][i + LANE_ELEMS / 2];
            const float a = x1 * cs[i] - x2 * sn[i], b = x2 * cs[i] + x1 * sn[i];
            if (is_q) {
                q_sh[row][d] = a;
                q_sh[row][d + HD / 2] = b;
            } else {
                new_sh[0][d] = (u16)bf16_round(a);
                new_sh[0][d + HD / 2] = (u16)bf16_round(b);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(DWARPS * 32, MIN_BLOCKS_TC) TC_ENTRY(
    const float *q, const u16 *k, const u16 *v, float *partial, const int *token_slot, const int *token_pos,
    int heads, int kv_heads, int context, int scratch_splits, int decode_splits, int split_positions,
    float scale_log2, int *done, float *out, const float *qkv, const u16 *q_weight, const u16 *k_weight, float eps,
    const float *cos_table, const float *sin_table) {
    static_assert(2 * 8 * MERGE_CAP <= DWARPS * 8 * HD, "the merge's weights and sums live in o_sh");
    __shared__ __align__(16) float o_sh[DWARPS][8][HD];  // a group of at most 8 heads: rows g + 8 of A are zero
    __shared__ float stat_sh[DWARPS][8][2];
#if TC_PDL && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !(ROPE && EARLY_KV)
    asm volatile("griddepcontrol.wait;" ::: "memory");  // first in every block, before any global read or write
#if PDL_TRIGGER
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
#endif
    const int t_tok = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;
    const int group = heads / kv_heads;
    const int count = token_pos[t_tok] + 1;
    const int num_splits = min(decode_splits, (count + split_positions - 1) / split_positions);
    if (split >= num_splits) return;
    const int first = (int)((long long)split * count / num_splits);
    const int end = (int)((long long)(split + 1) * count / num_splits);
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    const long long base = ((long long)token_slot[t_tok] * kv_heads + kv_head) * context;
#if ROPE
    __shared__ __align__(16) float q_sh[8][HD];   // the group's q heads, normalized and rotated
    __shared__ __align__(16) u16 new_sh[2][HD];   // the token's k (normalized, rotated) and v, bf16
    const int position = count - 1;               // the token's own key: [first, end) of the last split only
    prefetch_keys(k, v, base, first + KEYS * w, end, g, t);
#if EARLY_KV && TC_PDL && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");  // the projection's row (above: the step's inputs, a hint)
#if PDL_TRIGGER
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
#endif
    rope_rows(qkv, q_weight, k_weight, eps, cos_table, sin_table, t_tok, kv_head, heads, kv_heads, group, position,
              q_sh, new_sh);
    __syncthreads();
    if (split == num_splits - 1 && threadIdx.x < 2 * HD / 8) {  // the token's k and v into the caches
        const int which = threadIdx.x / (HD / 8), e = 8 * (threadIdx.x % (HD / 8));
        u16 *cache = const_cast<u16 *>(which ? v : k);
        *reinterpret_cast<uint4 *>(cache + (base + position) * HD + e) =
            *reinterpret_cast<const uint4 *>(&new_sh[which][e]);
    }
#endif

    // Q's fragments: a0/a2 head g (zero past the group), a1/a3 rows g + 8: zero; both split parts
    u32 qh[KSTEPS][4], ql[KSTEPS][4];
#if ROPE
    const float *q_row = &q_sh[min(g, group - 1)][LANE_DIMS * t];
#else
    const float *q_row = q + ((long long)t_tok * heads + kv_head * group + min(g, group - 1)) * HD + LANE_DIMS * t;
#endif
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
        float4 x = g < group ? *reinterpret_cast<const float4 *>(q_row + 4 * ks) : make_float4(0.f, 0.f, 0.f, 0.f);
        split_pair(x.x, x.y, qh[ks][0], ql[ks][0]);
        split_pair(x.z, x.w, qh[ks][2], ql[ks][2]);
        qh[ks][1] = ql[ks][1] = qh[ks][3] = ql[ks][3] = 0u;
    }
    float o[DTILES][4];
#pragma unroll
    for (int dt = 0; dt < DTILES; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
    float row_max[2] = {NEG_INF, NEG_INF}, row_sum[2] = {0.f, 0.f};

    for (int key0 = first + KEYS * w; key0 < end; key0 += KEYS * DWARPS) {
        // every load first: K of keys key0 + 8 nt + g (dims [32 t, 32 t + 32)), V of keys key0 + 2t + {0, 1, 8, 9}
        uint4 kw[2][LANE_DIMS / 8], vw[4][V_DIMS / 8];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            const int key = min(key0 + 8 * nt + g, end - 1);
            const u16 *row = k + (base + key) * HD + LANE_DIMS * t;
#pragma unroll
            for (int i = 0; i < LANE_DIMS / 8; ++i) {
                kw[nt][i] = CACHED_OR_OWN(row + 8 * i, key, &new_sh[0][LANE_DIMS * t + 8 * i]);
            }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int key = min(key0 + 2 * t + (j & 1) + 8 * (j >> 1), end - 1);
            const u16 *row = v + (base + key) * HD + V_DIMS * g;
#pragma unroll
            for (int i = 0; i < V_DIMS / 8; ++i) {
                vw[j][i] = CACHED_OR_OWN(row + 8 * i, key, &new_sh[1][V_DIMS * g + 8 * i]);
            }
        }
        float s[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            const u32 *words = reinterpret_cast<const u32 *>(kw[nt]);
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ++ks) {
                mma(s[nt], qh[ks], words[2 * ks], words[2 * ks + 1]);
                mma(s[nt], ql[ks], words[2 * ks], words[2 * ks + 1]);
            }
        }
        float tile_max[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = key0 + 8 * nt + 2 * t + (e & 1), r = e >> 1;
                s[nt][e] = key < end ? s[nt][e] * scale_log2 : NEG_INF;
                tile_max[r] = fmaxf(tile_max[r], s[nt][e]);
            }
        }
        float shrink[2], base_r[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float new_max = fmaxf(row_max[r], quad_max(tile_max[r]));
            base_r[r] = new_max == NEG_INF ? 0.f : new_max;
            shrink[r] = exp2f(row_max[r] - base_r[r]);
            row_max[r] = new_max;
            row_sum[r] *= shrink[r];
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[nt][e] = exp2f(s[nt][e] - base_r[e >> 1]);
                row_sum[e >> 1] += s[nt][e];
            }
        }
        u32 ph[4], pl[4];  // P as A: a0 = (head g, keys 2t, 2t+1), a2 = keys 2t + 8, 2t + 9; a1, a3 rows g + 8: zero
        split_pair(s[0][0], s[0][1], ph[0], pl[0]);
        split_pair(s[1][0], s[1][1], ph[2], pl[2]);
        ph[1] = pl[1] = ph[3] = pl[3] = 0u;
        const u32 *v0 = reinterpret_cast<const u32 *>(vw[0]), *v1 = reinterpret_cast<const u32 *>(vw[1]);
        const u32 *v2 = reinterpret_cast<const u32 *>(vw[2]), *v3 = reinterpret_cast<const u32 *>(vw[3]);
#pragma unroll
        for (int dt = 0; dt < DTILES; ++dt) {
            const unsigned sel = (dt & 1) ? 0x7632u : 0x5410u;
            const u32 b0 = __byte_perm(v0[dt >> 1], v1[dt >> 1], sel), b1 = __byte_perm(v2[dt >> 1], v3[dt >> 1], sel);
            o[dt][0] *= shrink[0];
            o[dt][1] *= shrink[0];
            o[dt][2] *= shrink[1];
            o[dt][3] *= shrink[1];
            mma(o[dt], ph, b0, b1);
            mma(o[dt], pl, b0, b1);
        }
    }
    // the warps' states through shared memory: o[dt] c0, c1 = (head g, dims 32 t + dt, 32 t + 16 + dt)
    const float total = quad_sum(row_sum[0]);
#pragma unroll
    for (int dt = 0; dt < DTILES; ++dt) {
        o_sh[w][g][32 * t + dt] = o[dt][0];
        o_sh[w][g][32 * t + 16 + dt] = o[dt][1];
    }
    if (t == 0) {
        stat_sh[w][g][0] = row_max[0];
        stat_sh[w][g][1] = total;
    }
    __syncthreads();
    const float ln2 = 0.69314718055994530942f;
    const bool one_split = done != nullptr && num_splits == 1;  // the output directly, no partials
    for (int e = threadIdx.x; e < group * HD; e += DWARPS * 32) {
        const int head = e / HD, d = e % HD;
        float peak = NEG_INF;
#pragma unroll
        for (int i = 0; i < DWARPS; ++i) peak = fmaxf(peak, stat_sh[i][head][0]);
        float value = 0.f, total = 0.f;
#pragma unroll
        for (int i = 0; i < DWARPS; ++i) {
            const float weight = exp2f(stat_sh[i][head][0] - peak);  // 0 for a warp that saw no key
            value += o_sh[i][head][d] * weight;
            total += stat_sh[i][head][1] * weight;
        }
        if (one_split) {  // merge_splits' expressions at one split: weight expf(0) = 1, fmaf(x, 1, 0) = x + 0
            out[((long long)t_tok * heads + kv_head * group + head) * HD + d] = __fadd_rn(value, 0.f) / total;
            continue;
        }
        float *dst = partial + (((long long)t_tok * heads + kv_head * group + head) * scratch_splits + split) * (HD + 2);
        dst[d] = value;
        if (d == 0) {
            dst[HD] = peak * ln2;
            dst[HD + 1] = total;
        }
    }
    if (done == nullptr || one_split) return;
    __shared__ int is_last;
    __threadfence();  // this block's partials before its count
    __syncthreads();
    if (threadIdx.x == 0) {
        int *count = done + t_tok * kv_heads + kv_head;
        is_last = atomicAdd(count, 1) == num_splits - 1;
        if (is_last) *count = 0;  // every split has counted: at 0 for the next launch (a graph replays this one)
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();  // the other blocks' partials, seen through their fence and the counter
    merge_in_block(partial, out, reinterpret_cast<float2 *>(&o_sh[0][0][0]), t_tok, kv_head, group, heads,
                   scratch_splits, num_splits);
}
