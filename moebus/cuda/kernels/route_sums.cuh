// route_tail's column sums of the o projection's ROUTE partials (norm_route.py's order), its 1 / rms and
// one_token_tail's softmax, shared by route_end.cu and moe_quant_mma.cu's ROUTED entry (route_end.with_route_sums puts this text in place of their #include). Template
// parameters are named k*: the including files' macros (TILES, THREADS, ...) would replace plain names.
#define ROUTE_PARTS 8  // norm_route.TAIL_PARTS

// The partials (kPartials floats, 16-byte aligned) this thread stages: a float4 a trip (kThreads threads), zero past
// the end. Issued together, before their first use.
template <int kTrips, int kThreads, int kPartials>
__device__ __forceinline__ void load_partials(const float *partial, float4 (&quads)[kTrips]) {
#pragma unroll
    for (int trip = 0; trip < kTrips; ++trip) {
        const int q = trip * kThreads + (int)threadIdx.x;
        quads[trip] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (4 * q + 3 < kPartials) {
            quads[trip] = *reinterpret_cast<const float4 *>(partial + 4 * q);
        } else if (4 * q < kPartials) {  // the last, partial quad
            quads[trip].x = partial[4 * q];
            if (4 * q + 1 < kPartials) quads[trip].y = partial[4 * q + 1];
            if (4 * q + 2 < kPartials) quads[trip].z = partial[4 * q + 2];
        }
    }
}

template <int kTrips, int kThreads>
__device__ __forceinline__ void stage_partials(float *staged, const float4 (&quads)[kTrips]) {
#pragma unroll
    for (int trip = 0; trip < kTrips; ++trip) reinterpret_cast<float4 *>(staged)[trip * kThreads + threadIdx.x] = quads[trip];
}

// After the staging's barrier: sums[j][c] = column c's tiles j, j + ROUTE_PARTS, ... in order from 0 (the caller's
// barrier before they are read).
template <int kTiles, int kColumns, int kThreads>
__device__ __forceinline__ void column_sums(const float *staged, float (*sums)[kColumns]) {
#pragma unroll
    for (int p = 0; p < (kColumns * ROUTE_PARTS + kThreads - 1) / kThreads; ++p) {
        const int c = ((int)threadIdx.x + p * kThreads) / ROUTE_PARTS, j = ((int)threadIdx.x + p * kThreads) % ROUTE_PARTS;
        if (c < kColumns) {
            float part = 0.f;
#pragma unroll
            for (int tile = j; tile < kTiles; tile += ROUTE_PARTS) part += staged[tile * kColumns + c];
            sums[j][c] = part;
        }
    }
}

// 1 / rms from the squares' column (the last of kColumns): route_tail's 1 / sqrtf(sum / dim + eps), the parts in order
template <int kColumns>
__device__ __forceinline__ float route_inv_rms(const float (*sums)[kColumns], int dim, float eps) {
    float square_sum = 0.f;
#pragma unroll
    for (int j = 0; j < ROUTE_PARTS; ++j) square_sum += sums[j][kColumns - 1];
    return 1.f / sqrtf(square_sum / (float)dim + eps);
}

// the butterflies (compat.warp_max / warp_sum's): every lane the same bits
__device__ __forceinline__ float butterfly_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
    return v;
}

__device__ __forceinline__ float butterfly_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
    return v;
}

// one_token_tail's softmax by one warp, a lane an expert (kColumns - 1 experts, at most 32): the logit (its column's
// parts in order) times 1 / rms, the butterflies' maximum, expf, the butterflies' sum, a division (0 past the experts)
template <int kColumns>
__device__ __forceinline__ float expert_prob(const float (*sums)[kColumns], float inv, int lane) {
    float prob = -__int_as_float(0x7F800000);  // -inf: expf gives 0
    if (lane < kColumns - 1) {
        float logit = 0.f;
#pragma unroll
        for (int j = 0; j < ROUTE_PARTS; ++j) logit += sums[j][lane];
        prob = logit * inv;
    }
    prob = expf(prob - butterfly_max(prob));
    return prob / butterfly_sum(prob);
}
