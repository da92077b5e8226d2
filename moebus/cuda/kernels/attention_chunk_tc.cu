// A prompt's chunk beside decode rows, its attention on tensor cores (attention_chunk_tc.py): one
// block of WARPS warps per (tile, kv head, split). A tile is up to BM / group consecutive rows of one
// sequence (attention_chunk.chunk_tiles, a table on the device, so a captured step follows its
// chunk); its BM (row, query head of this kv head) pairs are the rows of Q, 16 per warp, pair p =
// (row p / group, head p % group), so the block reads each key of its split once for all of them.
// The keys of split `split` of the tile's last row [first, end) (split_range below) stream through
// shared memory BN at a time and the products are flash_attention.cu's (mma.sync m16n8k16 on split
// bf16 parts, fp32 sums; bf16 keys and values): the device functions come from that file, which
// attention_chunk_tc.source() puts in place of the #include. A pair sees keys <= its row's position.
// Each block writes its pairs' unnormalised outputs, max (natural log units) and sum into the
// attention scratch (T, H, splits, HD + 2) as attention_decode's splits do; merge_tile_splits in
// attention_chunk.py combines them. Compiled with F32_KV 0 (the cache's bf16 bits) and WARPS 4.

#include "flash_attention.cu"

// attention_decode.split_range over [0, pos] with splits of at least split_positions keys
__device__ __forceinline__ void chunk_split_range(int pos, int split, int split_positions, int max_splits, int &first,
                                                  int &end, int &num_splits) {
    const int count = pos + 1;
    num_splits = min(max_splits, (count + split_positions - 1) / split_positions);
    first = (int)((long long)split * count / num_splits);
    end = (int)((long long)(split + 1) * count / num_splits);
}

// Q's fragments (both split parts) of this warp's pairs r0 and r0 + 8 (zero past the tile's pairs)
__device__ __forceinline__ void load_q_pairs(const float *q, long long row_pitch, int first_row, int head0, int group,
                                             int num_pairs, int r0, u32 qh[KSTEPS][4], u32 ql[KSTEPS][4], int t) {
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int pair = r0 + (e & 1) * 8, col = ks * 16 + 2 * t + (e >> 1) * 8;
            float2 x = make_float2(0.f, 0.f);
            if (pair < num_pairs && col < HD) {
                const float *row = q + (long long)(first_row + pair / group) * row_pitch +
                                   (long long)(head0 + pair % group) * HD;
                x = *reinterpret_cast<const float2 *>(row + col);
            }
            split_pair(x.x, x.y, qh[ks][e], ql[ks][e]);
        }
    }
}

// tiles: (num tiles, 3) int32 (first row, rows, KV slot); tiles of fewer than 2 rows exit (decode
// rows: the decode kernel's). q: (T, heads, HD) float32; k, v: the bf16 caches (slots, kv_heads,
// context, HD); partial: (T, heads, num_splits_max, HD + 2) float32. scale_log2 = scale * log2(e).
extern "C" __global__ void __launch_bounds__(WARPS * 32, 1) chunk_attention(
    const float *q, const u16 *k, const u16 *v, float *partial, const int *tiles, const int *token_pos, int heads,
    int kv_heads, int context, int group, int scratch_splits, int split_positions, int max_splits, float scale_log2) {
    __shared__ __align__(16) u16 ks_all[1][1][BN][KP];
    __shared__ __align__(16) u16 vt_all[1][1][HD][VP];
    const int tile = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;
    const int first_row = tiles[3 * tile], rows = tiles[3 * tile + 1], slot = tiles[3 * tile + 2];
    if (rows < 2) return;  // the whole block: an unused tile, or a decode row
    int key_first, key_end, num_splits;
    chunk_split_range(token_pos[first_row + rows - 1], split, split_positions, max_splits, key_first, key_end,
                      num_splits);
    if (split >= num_splits) return;
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    const int num_pairs = min(rows * group, BM), r0 = w * 16 + g;
    const long long row_pitch = (long long)heads * HD;
    u32 qh[KSTEPS][4], ql[KSTEPS][4];
    load_q_pairs(q, row_pitch, first_row, kv_head * group, group, num_pairs, r0, qh, ql, t);
    for (int idx = threadIdx.x; idx < BN * (KP - HD); idx += WARPS * 32)  // the zero padding of the keys' rows
        ks_all[0][0][idx / (KP - HD)][HD + idx % (KP - HD)] = 0;
    int pos[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // -1: not a pair of this tile (sees no key)
        int pair = r0 + 8 * r;
        pos[r] = pair < num_pairs ? token_pos[first_row + pair / group] : -1;
    }
    const long long kv_at = ((long long)slot * kv_heads + kv_head) * context * HD;
    const u16 *kz = k + kv_at, *vz = v + kv_at;

    float o[DTILES][4];
#pragma unroll
    for (int dt = 0; dt < DTILES; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
    float row_max[2] = {NEG_INF, NEG_INF}, row_sum[2] = {0.f, 0.f};
    for (int key0 = key_first; key0 < key_end; key0 += BN) {
        __syncthreads();  // the previous tile (and the padding) are done with
        load_tile(kz, vz, HD, key0, key_end, ks_all[0], vt_all[0]);
        __syncthreads();
        float s[BN / 8][4];
        scores(s, qh, ql, ks_all[0], g, t);
        float tile_max[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int key = key0 + nt * 8 + 2 * t + (e & 1), r = e >> 1;
                s[nt][e] = key < key_end && key <= pos[r] ? s[nt][e] * scale_log2 : NEG_INF;
                tile_max[r] = fmaxf(tile_max[r], s[nt][e]);
            }
        }
        float shrink[2], base[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float new_max = fmaxf(row_max[r], quad_max(tile_max[r]));
            base[r] = new_max == NEG_INF ? 0.f : new_max;  // a pair with nothing seen yet stays at 0
            shrink[r] = exp2f(row_max[r] - base[r]);
            row_max[r] = new_max;
            row_sum[r] *= shrink[r];
        }
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[nt][e] = exp2f(s[nt][e] - base[e >> 1]);
                row_sum[e >> 1] += s[nt][e];
            }
        }
#pragma unroll
        for (int dt = 0; dt < DTILES; ++dt) {
            o[dt][0] *= shrink[0];
            o[dt][1] *= shrink[0];
            o[dt][2] *= shrink[1];
            o[dt][3] *= shrink[1];
        }
        accumulate(o, s, vt_all[0], g, t);
    }
    // the split's partials, as the decode kernel leaves them: sum_j e^(s_j - m) v_j, m, sum_j e^(s_j - m)
    // with m in natural-log units (a pair that saw no key of the split: 0, -inf, 0)
    const float ln2 = 0.69314718055994530942f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        int pair = r0 + 8 * r;
        float total = quad_sum(row_sum[r]);
        if (pair < num_pairs) {
            long long row = (long long)(first_row + pair / group) * heads + kv_head * group + pair % group;
            float *dst = partial + (row * scratch_splits + split) * (HD + 2);
#pragma unroll
            for (int dt = 0; dt < DTILES; ++dt)
                *reinterpret_cast<float2 *>(dst + dt * 8 + 2 * t) = make_float2(o[dt][2 * r], o[dt][2 * r + 1]);
            if (t == 0) {
                dst[HD] = row_max[r] == NEG_INF ? NEG_INF : row_max[r] * ln2;
                dst[HD + 1] = total;
            }
        }
    }
}
