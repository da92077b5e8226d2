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

#ifndef EXPERTS
#define EXPERTS 32      // <= 32: a lane an expert
#endif
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
#define QUADS (DIM / 4)
#define H_TRIPS ((QUADS + THREADS - 1) / THREADS)                // float4 of h a thread writes

typedef unsigned int u32;
typedef unsigned short u16;

#include "route_sums.cuh"

__device__ __forceinline__ float bf16_low(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_high(u32 w) { return __uint_as_float(w & 0xFFFF0000u); }

extern "C" __global__ void __launch_bounds__(THREADS, 1)
ENTRY(const float *partial, const float *total, const u16 *norm_weight, float eps, const int *table_row, int top_k,
      int normalize, float *h, int *ids, float *weights, int *pair_token, int *pair_slot, int *pair_out) {
    static_assert(EXPERTS <= 32 && DIM % 16 == 0 && THREADS % 32 == 0, "a lane an expert, whole tiles, whole warps");
    __shared__ __align__(16) float staged[TRIPS * THREADS * 4];
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
    float4 quads[TRIPS], t[H_TRIPS];  // every load first: the partials, total, the placement
    load_partials<TRIPS, THREADS, PARTIALS>(partial, quads);
#pragma unroll
    for (int i = 0; i < H_TRIPS; ++i) {
        const int q = i * THREADS + tid;
        t[i] = q < QUADS ? *reinterpret_cast<const float4 *>(total + 4 * q) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
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
