// specstack's flash attention for the calls a speculative decoder makes: one to 63 query rows (a plain step,
// a verification), F16 K and V, AVX-512 or AVX2.
//
// Why: every row of a call attends over its sequence's whole context, and llama.cpp's CPU flash attention
// (ops.cpp, ggml_compute_forward_flash_attn_ext_f16_one_chunk) walks the context one position at a time: a call
// through vec_dot_f16, a scalar expf, a vec_mad_f16 into an F16 accumulator. On the 1B stand-in (64 heads of 32,
// 22 layers) that cost each row 28.8 ms per 1000 context tokens at -t 2, where its K and V (90 MB at depth
// 1000) stream in ~4 ms: deep in a generation one row cost twice the weights' read, and every verified row as much
// again.
//
// What: the context in chunks of 256 positions at fixed offsets (0, 256, 512, ...), each in blocks of 16 (AVX-512)
// or 8 (AVX2): the block's scores from one vector register per position and a transposing sum, the block's
// maximum, its exponentials at once (ggml's own ggml_v_expf), and V accumulated in F32. Each chunk's partial (its maximum, sum and accumulator) is
// a unit of work; a row and head's partials are then merged in chunk order. A block whose positions are all
// masked is skipped, a chunk with none left adds nothing, and positions past the call's KV length count as
// masked. So a row's operations depend only on its own query, mask row and the KV cells, never on the other rows
// of the call, the KV length the call was padded to or the threads: a row is the same bits in a one-row call as
// in a verification at any -t, and a one-row call still spreads a long context over every thread (as llama.cpp's
// split path does, but at offsets no call shape moves). Not llama.cpp's order of operations: exactness here is
// plain decoding against verification, both computed by this kernel.
//
// Declines (llama.cpp's own path runs, each row alone: see specstack_verify_rowwise_attention): 64 rows or more
// (llama.cpp tiles those), other K/V types, heads over 256 or not a multiple of 16, ALiBi, logit soft-capping,
// attention sinks, and builds without AVX2, FMA and F16C.

#include "ggml-impl.h"
#include "ggml-cpu.h"
#include "ggml-cpu-impl.h"
#include "simd-mappings.h"
#include "vec.h"
#include "specstack-verify.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && defined(__F16C__)
#define SA_ENABLED 1
#define SA_ZMM 1
#define SA_BLOCK 16     // context positions per block: the lanes of one vector register
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SA_ENABLED 1
#define SA_ZMM 0
#define SA_BLOCK 8
#include <immintrin.h>
#else
#define SA_ENABLED 0
#define SA_BLOCK 16
#endif

#define SA_MAX_ROWS 63  // below llama.cpp's 64-row tile (GGML_FA_TILE_Q), which takes larger calls
#define SA_MAX_D 256    // head sizes taken, in multiples of 16
#define SA_CHUNK 256    // context positions per unit of work (a multiple of SA_BLOCK), at fixed offsets
#define SA_HEAD 16      // floats before a partial's accumulator: its maximum and sum, padded to a cache line
#define SA_MIN(a, b) ((a) < (b) ? (a) : (b))

#if SA_ENABLED

struct sa_job {
    const struct ggml_tensor * q, * k, * v, * mask;
    struct ggml_tensor * dst;
    float scale;
};

// Where a row, head and stream's query, K, V and mask row start.
struct sa_at {
    const float * q;
    const char * k, * v;
    const ggml_fp16_t * m;
};

static struct sa_at sa_locate(const struct sa_job * j, const int64_t iq1, const int64_t iq2, const int64_t iq3) {
    const struct ggml_tensor * q = j->q, * k = j->k, * v = j->v, * mask = j->mask;
    const int64_t ik2 = iq2 / (q->ne[2] / k->ne[2]), ik3 = iq3 / (q->ne[3] / k->ne[3]);
    const int64_t iv2 = iq2 / (q->ne[2] / v->ne[2]), iv3 = iq3 / (q->ne[3] / v->ne[3]);
    struct sa_at at = {
        (const float *) ((const char *) q->data + iq1 * q->nb[1] + iq2 * q->nb[2] + iq3 * q->nb[3]),
        (const char *) k->data + ik2 * k->nb[2] + ik3 * k->nb[3],
        (const char *) v->data + iv2 * v->nb[2] + iv3 * v->nb[3],
        mask == NULL ? NULL : (const ggml_fp16_t *) ((const char *) mask->data + iq1 * mask->nb[1]
                                                    + (iq2 % mask->ne[2]) * mask->nb[2] + (iq3 % mask->ne[3]) * mask->nb[3]),
    };
    return at;
}

#if SA_ZMM

// lane t of the result = the sum of v[t]'s 16 lanes (a fixed tree: the same bits for the same inputs)
static inline __m512 sa_sum16(const __m512 v[SA_BLOCK]) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; ++i) {  // 256-bit halves: [v2i: 0+2 | 1+3 | v2i+1: 0+2 | 1+3] in 128-bit lanes
        const __m512 x = v[2 * i], y = v[2 * i + 1];
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
    }
    for (int i = 0; i < 4; ++i) {  // 128-bit lane L of b[i]: v[4i + L]'s four partial sums
        const __m512 x = a[2 * i], y = a[2 * i + 1];
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
    }
    const __m512 c0 = _mm512_add_ps(_mm512_unpacklo_ps(b[0], b[1]), _mm512_unpackhi_ps(b[0], b[1]));
    const __m512 c1 = _mm512_add_ps(_mm512_unpacklo_ps(b[2], b[3]), _mm512_unpackhi_ps(b[2], b[3]));
    const __m512 r = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(c0), _mm512_castps_pd(c1))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(c0), _mm512_castps_pd(c1))));
    // element 4L + k of r holds v[4k + L]
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, r);
}

// One query row of one head over context positions [c0, c1): its partial, unnormalised (the maximum, the sum, and
// from SA_HEAD the accumulator).
static void sa_part(const struct sa_job * j, const struct sa_at at, const int64_t c0, const int64_t c1,
                    float * partial) {
    const struct ggml_tensor * k = j->k, * v = j->v;
    const int nc = (int) (k->ne[0] / SA_BLOCK), nv = (int) (v->ne[0] / SA_BLOCK);
    const char * kbase = at.k, * vbase = at.v;
    const ggml_fp16_t * mrow = at.m;
    __m512 qv[SA_MAX_D / SA_BLOCK], acc[SA_MAX_D / SA_BLOCK], part[SA_BLOCK];
    for (int c = 0; c < nc; ++c) qv[c] = _mm512_loadu_ps(at.q + SA_BLOCK * c);
    for (int c = 0; c < nv; ++c) acc[c] = _mm512_setzero_ps();
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
    float M = -INFINITY, S = 0.0f;

    for (int64_t b0 = c0; b0 < c1; b0 += SA_BLOCK) {
        const int64_t left = c1 - b0;
        const __mmask16 in = left >= SA_BLOCK ? (__mmask16) 0xFFFF : (__mmask16) ((1u << left) - 1);
        const __m512 mv = mrow == NULL ? _mm512_setzero_ps()
            : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(in, mrow + b0));
        const __mmask16 live = in & _mm512_cmp_ps_mask(mv, minus_inf, _CMP_NEQ_UQ);
        if (live == 0) {
            continue;
        }
        for (int t = 0; t < SA_BLOCK; ++t) {
            if (!((live >> t) & 1)) {
                part[t] = _mm512_setzero_ps();
                continue;
            }
            const ggml_fp16_t * kr = (const ggml_fp16_t *) (kbase + (b0 + t) * k->nb[1]);
            __m512 d = _mm512_mul_ps(qv[0], _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) kr)));
            for (int c = 1; c < nc; ++c) {
                d = _mm512_fmadd_ps(qv[c], _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (kr + SA_BLOCK * c))), d);
            }
            part[t] = d;
        }
        __m512 s = _mm512_add_ps(_mm512_mul_ps(sa_sum16(part), _mm512_set1_ps(j->scale)), mv);
        s = _mm512_mask_blend_ps(live, minus_inf, s);
        const float top = _mm512_mask_reduce_max_ps(live, s);
        if (top > M) {  // a new maximum: what was summed so far is rescaled to it
            const float ms = expf(M - top);
            M = top;
            S *= ms;
            const __m512 msv = _mm512_set1_ps(ms);
            for (int c = 0; c < nv; ++c) acc[c] = _mm512_mul_ps(acc[c], msv);
        }
        const __m512 p = ggml_v_expf(_mm512_sub_ps(s, _mm512_set1_ps(M)));  // dead lanes: exp(-inf) = 0
        S += _mm512_reduce_add_ps(p);
        float pv[SA_BLOCK];
        _mm512_storeu_ps(pv, p);
        for (int t = 0; t < SA_BLOCK; ++t) {
            if (!((live >> t) & 1)) {
                continue;
            }
            const ggml_fp16_t * vr = (const ggml_fp16_t *) (vbase + (b0 + t) * v->nb[1]);
            const __m512 w = _mm512_set1_ps(pv[t]);
            for (int c = 0; c < nv; ++c) {
                acc[c] = _mm512_fmadd_ps(w, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (vr + SA_BLOCK * c))), acc[c]);
            }
        }
    }

    partial[0] = M;
    partial[1] = S;
    for (int c = 0; c < nv; ++c) _mm512_storeu_ps(partial + SA_HEAD + SA_BLOCK * c, acc[c]);
}

#else  // AVX2: blocks of 8

// lane t of the result = the sum of v[t]'s 8 lanes (a fixed tree)
static inline __m256 sa_sum8(const __m256 v[SA_BLOCK]) {
    const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);  // 128-bit halves: v0..3 | v4..7's halves
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

static inline float sa_hmax8(const __m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline float sa_hsum8(const __m256 x) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

static void sa_part(const struct sa_job * j, const struct sa_at at, const int64_t c0, const int64_t c1,
                    float * partial) {
    const struct ggml_tensor * k = j->k, * v = j->v;
    const int nc = (int) (k->ne[0] / SA_BLOCK), nv = (int) (v->ne[0] / SA_BLOCK);
    __m256 acc[SA_MAX_D / SA_BLOCK], part[SA_BLOCK];
    for (int c = 0; c < nv; ++c) acc[c] = _mm256_setzero_ps();
    const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
    float M = -INFINITY, S = 0.0f;

    for (int64_t b0 = c0; b0 < c1; b0 += SA_BLOCK) {
        const int64_t left = c1 - b0;
        ggml_fp16_t mh[SA_BLOCK];
        for (int t = 0; t < SA_BLOCK; ++t) {  // past the call's KV length: masked (0xFC00 is F16's -inf)
            mh[t] = t < left ? (at.m == NULL ? (ggml_fp16_t) 0 : at.m[b0 + t]) : (ggml_fp16_t) 0xFC00;
        }
        const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) mh));
        const __m256 keep = _mm256_cmp_ps(mv, minus_inf, _CMP_NEQ_UQ);
        const int live = _mm256_movemask_ps(keep);
        if (live == 0) {
            continue;
        }
        for (int t = 0; t < SA_BLOCK; ++t) {
            if (!((live >> t) & 1)) {
                part[t] = _mm256_setzero_ps();
                continue;
            }
            const ggml_fp16_t * kr = (const ggml_fp16_t *) (at.k + (b0 + t) * k->nb[1]);
            __m256 d = _mm256_mul_ps(_mm256_loadu_ps(at.q), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) kr)));
            for (int c = 1; c < nc; ++c) {
                d = _mm256_fmadd_ps(_mm256_loadu_ps(at.q + SA_BLOCK * c),
                                    _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (kr + SA_BLOCK * c))), d);
            }
            part[t] = d;
        }
        __m256 s = _mm256_add_ps(_mm256_mul_ps(sa_sum8(part), _mm256_set1_ps(j->scale)), mv);
        s = _mm256_blendv_ps(minus_inf, s, keep);
        const float top = sa_hmax8(s);
        if (top > M) {  // a new maximum: what was summed so far is rescaled to it
            const float ms = expf(M - top);
            M = top;
            S *= ms;
            const __m256 msv = _mm256_set1_ps(ms);
            for (int c = 0; c < nv; ++c) acc[c] = _mm256_mul_ps(acc[c], msv);
        }
        const __m256 p = ggml_v_expf(_mm256_sub_ps(s, _mm256_set1_ps(M)));  // dead lanes: exp(-inf) = 0
        S += sa_hsum8(p);
        float pv[SA_BLOCK];
        _mm256_storeu_ps(pv, p);
        for (int t = 0; t < SA_BLOCK; ++t) {
            if (!((live >> t) & 1)) {
                continue;
            }
            const ggml_fp16_t * vr = (const ggml_fp16_t *) (at.v + (b0 + t) * v->nb[1]);
            const __m256 w = _mm256_set1_ps(pv[t]);
            for (int c = 0; c < nv; ++c) {
                acc[c] = _mm256_fmadd_ps(w, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (vr + SA_BLOCK * c))), acc[c]);
            }
        }
    }
    partial[0] = M;
    partial[1] = S;
    for (int c = 0; c < nv; ++c) _mm256_storeu_ps(partial + SA_HEAD + SA_BLOCK * c, acc[c]);
}

#endif

// A row and head's partials merged in chunk order (a chunk with nothing unmasked skipped), normalised into dst.
static void sa_merge(const struct sa_job * j, const int64_t iq1, const int64_t iq2, const int64_t iq3,
                     const float * partials, const int64_t chunks, const size_t stride) {
    const int64_t DV = j->v->ne[0];
    float top = -INFINITY;
    for (int64_t c = 0; c < chunks; ++c) top = fmaxf(top, partials[c * stride]);
    float acc[SA_MAX_D] = {0};
    float S = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) {
        const float * p = partials + c * stride;
        if (p[0] == -INFINITY) {
            continue;
        }
        const float w = expf(p[0] - top);  // 1 for the chunk that holds the maximum
        S += p[1] * w;
        for (int64_t i = 0; i < DV; ++i) acc[i] += p[SA_HEAD + i] * w;
    }
    // dst is permuted (0, 2, 1, 3): head iq2 of row iq1 of stream iq3
    const struct ggml_tensor * dst = j->dst;
    float * out = (float *) ((char *) dst->data + (iq3 * dst->ne[2] * dst->ne[1] + iq2 + iq1 * dst->ne[1]) * dst->nb[1]);
    const float inv = S == 0.0f ? 0.0f : 1.0f / S;
    for (int64_t i = 0; i < DV; ++i) out[i] = acc[i] * inv;
}

// The partials of a call: grown by thread 0 before the others read the pointer (one graph computes at a time).
static float * sa_scratch;
static size_t sa_scratch_floats;

static bool sa_takes(const struct ggml_tensor * dst) {
    const struct ggml_tensor * q = dst->src[0], * k = dst->src[1], * v = dst->src[2], * mask = dst->src[3];
    float max_bias = 0.0f, softcap = 0.0f;
    memcpy(&max_bias, (const float *) dst->op_params + 1, sizeof(float));
    memcpy(&softcap, (const float *) dst->op_params + 2, sizeof(float));
    const int64_t DK = k->ne[0], DV = v->ne[0];
    return specstack_verify_rowwise_attention()  // not turned off (SPECSTACK_VERIFY_KERNELS=0)
        && q->type == GGML_TYPE_F32 && k->type == GGML_TYPE_F16 && v->type == GGML_TYPE_F16
        && dst->type == GGML_TYPE_F32 && dst->src[4] == NULL
        && max_bias == 0.0f && softcap == 0.0f
        && q->ne[1] >= 1 && q->ne[1] <= SA_MAX_ROWS && q->ne[3] % k->ne[3] == 0 && q->ne[3] % v->ne[3] == 0
        && DK % 16 == 0 && DV % 16 == 0 && DK <= SA_MAX_D && DV <= SA_MAX_D && q->ne[0] == DK
        && q->ne[2] % k->ne[2] == 0 && q->ne[2] % v->ne[2] == 0 && k->ne[1] == v->ne[1]
        && q->nb[0] == sizeof(float) && k->nb[0] == sizeof(ggml_fp16_t) && v->nb[0] == sizeof(ggml_fp16_t)
        && dst->nb[0] == sizeof(float) && dst->ne[0] == DV
        && (mask == NULL || (mask->type == GGML_TYPE_F16 && mask->ne[1] >= q->ne[1] && mask->ne[0] >= k->ne[1]
                             && q->ne[3] % mask->ne[3] == 0));
}

bool specstack_verify_flash_attn(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    if (!sa_takes(dst)) {
        return false;
    }
    const struct ggml_tensor * q = dst->src[0];
    struct sa_job job = {q, dst->src[1], dst->src[2], dst->src[3], dst, 1.0f};
    memcpy(&job.scale, (const float *) dst->op_params + 0, sizeof(float));
    // units (row, head, stream, chunk): a pair's chunks, then a head's rows, then the heads that share its K and V,
    // then the streams (llama.cpp's non-unified KV cache: one per sequence)
    const int64_t rows = q->ne[1], heads = q->ne[2], pairs = rows * heads * q->ne[3];
    const int64_t n_kv = dst->src[1]->ne[1], chunks = (n_kv + SA_CHUNK - 1) / SA_CHUNK, units = pairs * chunks;
    const size_t stride = SA_HEAD + (size_t) dst->src[2]->ne[0];
    const int ith = params->ith, nth = params->nth;
    if (ith == 0 && (size_t) units * stride > sa_scratch_floats) {
        free(sa_scratch);
        void * p = NULL;
        sa_scratch = posix_memalign(&p, 64, (size_t) units * stride * sizeof(float)) == 0 ? (float *) p : NULL;
        sa_scratch_floats = sa_scratch ? (size_t) units * stride : 0;
        GGML_ASSERT(sa_scratch != NULL && "specstack-attn: no memory for the partials");
    }
    ggml_barrier(params->threadpool);
    for (int64_t u = units * ith / nth; u < units * (ith + 1) / nth; ++u) {
        const int64_t pair = u / chunks, c = u % chunks;
        sa_part(&job, sa_locate(&job, pair % rows, pair / rows % heads, pair / (rows * heads)), c * SA_CHUNK,
                SA_MIN(n_kv, (c + 1) * SA_CHUNK), sa_scratch + u * stride);
    }
    ggml_barrier(params->threadpool);
    for (int64_t pair = pairs * ith / nth; pair < pairs * (ith + 1) / nth; ++pair) {
        sa_merge(&job, pair % rows, pair / rows % heads, pair / (rows * heads), sa_scratch + pair * chunks * stride,
                 chunks, stride);
    }
    return true;
}

#else

bool specstack_verify_flash_attn(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    (void) params;
    (void) dst;
    return false;
}

#endif
