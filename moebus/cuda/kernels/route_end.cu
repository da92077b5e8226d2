// The routing's end of one decode token in one block (route_end.py; twenty-third session): norm_route.route_tail's
// work, in CUDA C with one warp for the ranking. From the o projection's ROUTE entry (moe_quant_mma.cu): partial
// (DIM / 16 tiles, EXPERTS + 1) float32, each tile's sums of router[e][i] * norm_weight[i] * total[i] and of
// total[i]^2; total (1, DIM) float32 (residual + o). Writes h (1, DIM) = norm_weight * (total * 1 / rms), the top_k
// chosen experts' ids and weights (1, top_k) by rank, and the pair tables (top_k,) by expert id: pair_token 0,
// pair_slot the expert's placement (table_row[e]: a slot, or -1 - a host-store row), pair_out its rank.
// The same bits as route_tail (norm_route.py) by the same expressions in the same order:
//  - a column's sum: ROUTE_PARTS parts, part j the tiles j, j + ROUTE_PARTS, ... in order from 0, then the parts in order;
//  - 1 / rms = 1 / sqrtf(sum of squares / DIM + eps), logit = sum * 1 / rms;
//  - one_token_tail's softmax (warp 0, a lane an expert: the butterflies' maximum, expf, sum, a division), ranks by
//    descending probability with ties to the lower id, the chosen probabilities summed in rank order;
//  - h = w * (total * 1 / rms) (fused.normed_store's order).
// Where route_tail's ranking goes through shared memory and block barriers, here warp 0 ranks by shuffles and places
// the chosen pairs by a ballot, and every warp takes 1 / rms from the sums itself for h (no barrier after the sums).
// PDL: the norm's weights (weights: no kernel of the step writes them) loaded before griddepcontrol.wait, then the
// trigger where PDL_TRIGGER; every other read after.
// More than 32 experts (WIDE; twenty-fourth session: Qwen3-30B-A3B's 128; route_end.WIDE, on since the twenty-fifth session: 5.4 against route_tail's 10.9 us a layer):
// route_tail's topk_row + sort_pairs (a lane the experts lane, lane + 32, ...: the per-lane maximum then the
// butterflies', expf, the per-lane sum then the butterflies', a division; the top_k by descending probability, ties to
// the lower id, the chosen summed in rank order) by ranks (a thread an expert, against every probability in shared
// memory) in place of top_k rounds of warp argmaxes, the same bits. Its partials (66 KB at 128 experts) are not
// staged: a thread a (column, part) pair, consecutive threads consecutive columns of one tile row, every load issued
// before the first sum.

#ifndef EXPERTS
#define EXPERTS 32      // <= 32: a lane an expert; up to 128 (WIDE): a lane EXPERTS / 32 of them
#endif
#define WIDE (EXPERTS > 32)
#ifndef DIM
#define DIM 2048        // the hidden size: a multiple of 16 (the ROUTE entry's tiles)
#endif
#ifndef THREADS
#define THREADS 256
#endif
#ifndef PDL_TRIGGER
#define PDL_TRIGGER 0
#endif
#ifndef ENTRY
#define ENTRY route_end
#endif
#define TILES (DIM / 16)
#define COLUMNS (EXPERTS + 1)                                    // the experts' logits, then the squares
#define PARTIALS (TILES * COLUMNS)
#define TRIPS ((PARTIALS + 4 * THREADS - 1) / (4 * THREADS))     // float4 of the partials a thread stages
#define PER_LANE ((EXPERTS + 31) / 32)                           // WIDE: the experts a lane ranks
#define PAIRS (COLUMNS * ROUTE_PARTS)                             // WIDE: (column, part) pairs, a sum each
#define PASSES ((PAIRS + THREADS - 1) / THREADS)                  // WIDE: the pairs a thread sums
#define PART_TILES ((TILES + ROUTE_PARTS - 1) / ROUTE_PARTS)      // WIDE: the tiles of a part
#define QUADS (DIM / 4)
#define H_TRIPS ((QUADS + THREADS - 1) / THREADS)                // float4 of h a thread writes

typedef unsigned int u32;
typedef unsigned short u16;

#include "route_sums.cuh"

__device__ __forceinline__ float bf16_low(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_high(u32 w) { return __uint_as_float(w & 0xFFFF0000u); }

#if WIDE
// WIDE: warp 0's softmax as topk_row's (moe.py) for PER_LANE experts a lane (lane l holds experts l, l + 32, ...): the
// lane's maximum then the butterflies', expf of the difference, the lane's sum in order then the butterflies', a
// division; into probs[e] (TAKEN = -1 past the experts).
__device__ __forceinline__ void wide_softmax(const float (*sums)[COLUMNS], float inv, int lane, float *probs) {
    const float neg_inf = -__int_as_float(0x7F800000);
    float p[PER_LANE];
    float peak = neg_inf;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        const int e = lane + 32 * i;
        float logit = 0.f;
        if (e < EXPERTS) {
#pragma unroll
            for (int j = 0; j < ROUTE_PARTS; ++j) logit += sums[j][e];
        }
        p[i] = e < EXPERTS ? __fmul_rn(logit, inv) : neg_inf;  // (no fma with the subtraction below)
        peak = fmaxf(peak, p[i]);
    }
    peak = butterfly_max(peak);
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        p[i] = expf(p[i] - peak);  // expf(-inf) = 0 past the experts
        total += p[i];
    }
    total = butterfly_sum(total);
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) probs[lane + 32 * i] = lane + 32 * i < EXPERTS ? p[i] / total : -1.f;
}
#endif


extern "C" __global__ void __launch_bounds__(THREADS, 1)
ENTRY(const float *partial, const float *total, const u16 *norm_weight, float eps, const int *table_row, int top_k,
      int normalize, float *h, int *ids, float *weights, int *pair_token, int *pair_slot, int *pair_out) {
    static_assert(EXPERTS <= 128 && DIM % 16 == 0 && THREADS % 32 == 0 && (!WIDE || THREADS >= 32 * PER_LANE),
                  "4 experts a lane, whole tiles, whole warps, a thread an expert");
#if !WIDE
    __shared__ __align__(16) float staged[TRIPS * THREADS * 4];
#endif
    __shared__ float sums[ROUTE_PARTS][COLUMNS];
    __shared__ float by_rank[32];
    const int tid = threadIdx.x, lane = tid % 32;
    uint2 w[H_TRIPS];  // the norm's weights of this thread's quads of h (4 bf16)
#pragma unroll
    for (int i = 0; i < H_TRIPS; ++i) {
        const int q = i * THREADS + tid;
        w[i] = make_uint2(0, 0);
        if (q < QUADS)
            asm volatile("ld.global.cs.v2.u32 {%0, %1}, [%2];" : "=r"(w[i].x), "=r"(w[i].y) : "l"(norm_weight + 4 * q));
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");  // before any read of what the step writes
#if PDL_TRIGGER
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
#endif
#if WIDE  // every load first: the partials, total, the placement
    float4 t[H_TRIPS];
    float parts[PASSES][PART_TILES];  // pair p = tid + pass * THREADS: column p % COLUMNS, part p / COLUMNS
#pragma unroll
    for (int pass = 0; pass < PASSES; ++pass) {
        const int p = tid + pass * THREADS, c = p % COLUMNS, j = p / COLUMNS;
#pragma unroll
        for (int k = 0; k < PART_TILES; ++k) {
            const int tile = j + k * ROUTE_PARTS;
            parts[pass][k] = p < PAIRS && tile < TILES ? partial[tile * COLUMNS + c] : 0.f;
        }
    }
#else
    float4 quads[TRIPS], t[H_TRIPS];
    load_partials<TRIPS, THREADS, PARTIALS>(partial, quads);
#endif
#pragma unroll
    for (int i = 0; i < H_TRIPS; ++i) {
        const int q = i * THREADS + tid;
        t[i] = q < QUADS ? *reinterpret_cast<const float4 *>(total + 4 * q) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#if WIDE
    __shared__ int places[EXPERTS];
    if (tid < EXPERTS) places[tid] = table_row[tid];
#pragma unroll
    for (int pass = 0; pass < PASSES; ++pass) {  // route_tail's sum of a part: its tiles in order from 0
        const int p = tid + pass * THREADS;
        float part = 0.f;
#pragma unroll
        for (int k = 0; k < PART_TILES; ++k)
            if ((p / COLUMNS) + k * ROUTE_PARTS < TILES) part += parts[pass][k];
        if (p < PAIRS) sums[p / COLUMNS][p % COLUMNS] = part;
    }
    __syncthreads();
    const float inv = route_inv_rms<COLUMNS>(sums, DIM, eps);  // every thread the same bits
    __shared__ __align__(16) float probs[PER_LANE * 32];
    __shared__ int chosen_in_warp[PER_LANE];
    if (tid < 32) wide_softmax(sums, inv, lane, probs);
    __syncthreads();
    // a thread an expert (warps 0 .. PER_LANE - 1): its rank counts the experts of higher probability or equal and
    // lower id (topk_row's rounds of warp argmaxes choose in that order); by_rank[r] the r-th chosen probability
    bool chosen = false;
    int rank = 0;
    unsigned mask = 0u;
    float prob = 0.f;
    if (tid < PER_LANE * 32) {
        prob = probs[tid];
#pragma unroll
        for (int q = 0; q < PER_LANE * 8; ++q) {
            const float4 o = reinterpret_cast<const float4 *>(probs)[q];
            rank += (o.x > prob || (o.x == prob && 4 * q < tid)) + (o.y > prob || (o.y == prob && 4 * q + 1 < tid))
                  + (o.z > prob || (o.z == prob && 4 * q + 2 < tid)) + (o.w > prob || (o.w == prob && 4 * q + 3 < tid));
        }
        chosen = tid < EXPERTS && rank < top_k;
        if (chosen) by_rank[rank] = prob;
        mask = __ballot_sync(0xFFFFFFFFu, chosen);
        if (lane == 0) chosen_in_warp[tid / 32] = __popc(mask);
    }
    __syncthreads();
    if (chosen) {  // the pairs by expert id (sort_pairs' ranks of one token's distinct ids)
        float chosen_sum = 0.f;
        for (int k = 0; k < top_k; ++k) chosen_sum += by_rank[k];  // in rank order, as topk_row adds them
        int at = __popc(mask & ((1u << lane) - 1u));
        for (int w = 0; w < tid / 32; ++w) at += chosen_in_warp[w];
        ids[rank] = tid;
        weights[rank] = normalize ? prob / chosen_sum : prob;
        pair_token[at] = 0;
        pair_slot[at] = places[tid];
        pair_out[at] = rank;  // pair t * A + k of token 0
    }
#else
    const int place = tid < EXPERTS ? table_row[tid] : 0;
    stage_partials<TRIPS, THREADS>(staged, quads);
    __syncthreads();
    column_sums<TILES, COLUMNS, THREADS>(staged, sums);
    __syncthreads();
    const float inv = route_inv_rms<COLUMNS>(sums, DIM, eps);  // every thread the same bits
    if (tid < 32) {  // one_token_tail's softmax and ranks: warp 0, a lane an expert
        const float prob = expert_prob<COLUMNS>(sums, inv, lane);
        int rank = 0;  // descending probability, ties to the lower id
#pragma unroll
        for (int j = 0; j < EXPERTS; ++j) {
            const float other = __shfl_sync(0xFFFFFFFFu, prob, j);
            rank += other > prob || (other == prob && j < lane);
        }
        const bool chosen = lane < EXPERTS && rank < top_k;
        if (chosen) by_rank[rank] = prob;
        const u32 mask = __ballot_sync(0xFFFFFFFFu, chosen);
        __syncwarp();
        if (chosen) {
            float chosen_sum = 0.f;
            for (int k = 0; k < top_k; ++k) chosen_sum += by_rank[k];  // in rank order, as topk_row adds them
            const int at = __popc(mask & ((1u << lane) - 1u));  // its place among the chosen, by expert id
            ids[rank] = lane;
            weights[rank] = normalize ? prob / chosen_sum : prob;
            pair_token[at] = 0;
            pair_slot[at] = place;
            pair_out[at] = rank;  // pair t * A + k of token 0
        }
    }
#endif
#pragma unroll
    for (int i = 0; i < H_TRIPS; ++i) {
        const int q = i * THREADS + tid;
        if (q < QUADS) {
            const float4 v = t[i];
            *reinterpret_cast<float4 *>(h + 4 * q) =
                make_float4(bf16_low(w[i].x) * (v.x * inv), bf16_high(w[i].x) * (v.y * inv),
                            bf16_low(w[i].y) * (v.z * inv), bf16_high(w[i].y) * (v.w * inv));
        }
    }
}
