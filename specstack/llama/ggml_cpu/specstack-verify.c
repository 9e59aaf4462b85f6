// specstack's verification kernels for ggml-cpu: MUL_MAT for 1-32 activation rows that reads each
// weight block once and applies it to every row.
//
// Why: a speculative verification of n draft tokens is a matmul with n activation rows. llama.cpp's CPU
// paths were built for n = 1 (vec_dot) or for prompts (tinyBLAS, repacked gemm, tiled from 8 rows), so
// n = 2..16 costs 2.4-8.3x one row where the memory system allows ~1-3.6x, and each path orders its
// float operations differently, so a row's logits depend on how many rows the call has.
//
// What: for every (weight row, activation row) the float operations are exactly those of ggml's own
// x86 vec_dot for that type (ggml/src/ggml-cpu/arch/x86/quants.c), in the same order; only the integer
// work (exact) is reorganised, and the weight decoding is hoisted out of the loop over activation rows.
// So a row's result is bit-identical whatever n is, at any thread count (threads split weight rows,
// never a reduction), and equal to stock vec_dot's. Used for n = 1 too, so plain decoding and
// verification run the same arithmetic.
//
// Types: Q8_0 and Q5_0 (activations quantized to Q8_0), Q4_K, Q5_K and Q6_K (activations in Q8_K),
// on AVX2 (with AVX-512 VNNI's 256-bit dot products where the build has them, as vec_dot does); F16, BF16 and F32
// (vec_dot_f16/_bf16/_f32's accumulator chains, any number of rows: the float section below).

#define GGML_COMMON_IMPL_C
#include "ggml-common.h"
#include "ggml-quants.h"
#include "ggml-impl.h"
#include "ggml-cpu.h"
#include "ggml-cpu-impl.h"
#include "simd-mappings.h"
#include "vec.h"
#include "specstack-verify.h"

#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SV_ENABLED 1
#include <immintrin.h>
#else
#define SV_ENABLED 0
#endif

#define SV_MAX_ROWS 32

#if SV_ENABLED

// Activation rows a weight block is applied to in one pass: their accumulators stay in registers.
#if defined(__AVX512F__)
#define SV_GROUP 12
#define SV_PAIRS 8
#else
#define SV_GROUP 6
#define SV_PAIRS 1
#endif

#define SV_INLINE static inline __attribute__((always_inline))
#define SV_SET_M128I(a, b) _mm256_insertf128_si256(_mm256_castsi128_si256(b), (a), 1)

// ---- helpers identical to quants.c's -------------------------------------------------------------

SV_INLINE float sv_hsum_float_8(const __m256 x) {
    __m128 res = _mm256_extractf128_ps(x, 1);
    res = _mm_add_ps(res, _mm256_castps256_ps128(x));
    res = _mm_add_ps(res, _mm_movehl_ps(res, res));
    res = _mm_add_ss(res, _mm_movehdup_ps(res));
    return _mm_cvtss_f32(res);
}

// sum of 4 products per int32 lane of |x| (u8) and sign(y, x) (i8): quants.c's mul_sum_us8_pairs_float
SV_INLINE __m256 sv_mul_sum_us8_pairs_float(const __m256i ax, const __m256i sy) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sy));
#elif defined(__AVXVNNI__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), ax, sy));
#else
    const __m256i dot = _mm256_maddubs_epi16(ax, sy);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_set1_epi16(1), dot));
#endif
}

// int32 lanes += madd(scales, p16): an exact integer sum, fused where VNNI has it
SV_INLINE __m256i sv_madd_add(const __m256i acc, const __m256i scales, const __m256i p16) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, scales, p16);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, scales, p16);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(scales, p16));
#endif
}

static const uint8_t sv_shuffle_k4[256] = {
     0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
     2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3,
     4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5,
     6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7,
     8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9,
    10,11,10,11,10,11,10,11,10,11,10,11,10,11,10,11,10,11,10,11,10,11,10,11,10,11,10,11,10,11,10,11,
    12,13,12,13,12,13,12,13,12,13,12,13,12,13,12,13,12,13,12,13,12,13,12,13,12,13,12,13,12,13,12,13,
    14,15,14,15,14,15,14,15,14,15,14,15,14,15,14,15,14,15,14,15,14,15,14,15,14,15,14,15,14,15,14,15
};

static const uint8_t sv_shuffle_q6[128] = {
     0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
     2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
     4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5,
     6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7,
     8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9,
    10,10,10,10,10,10,10,10, 11,11,11,11,11,11,11,11,
    12,12,12,12,12,12,12,12, 13,13,13,13,13,13,13,13,
    14,14,14,14,14,14,14,14, 15,15,15,15,15,15,15,15
};

// Unpack 32 4-bit fields into 32 bytes in [0, 15]: quants.c's bytes_from_nibbles_32
SV_INLINE __m256i sv_bytes_from_nibbles_32(const uint8_t * rsi) {
    const __m128i tmp = _mm_loadu_si128((const __m128i *)rsi);
    const __m256i bytes = SV_SET_M128I(_mm_srli_epi16(tmp, 4), tmp);
    return _mm256_and_si256(_mm256_set1_epi8(0xF), bytes);
}

// spread 32 bits to 32 bytes { 0x00, 0xFF }: quants.c's bytes_from_bits_32
SV_INLINE __m256i sv_bytes_from_bits_32(const uint8_t * x) {
    uint32_t x32;
    memcpy(&x32, x, sizeof(uint32_t));
    const __m256i shuf_mask = _mm256_set_epi64x(
            0x0303030303030303, 0x0202020202020202,
            0x0101010101010101, 0x0000000000000000);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x32), shuf_mask);
    const __m256i bit_mask = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
    bytes = _mm256_or_si256(bytes, bit_mask);
    return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

// ---- per-call scratch (activation scales prepared once per call, per thread) -----------------------

static _Thread_local float * sv_scratch;
static _Thread_local size_t sv_scratch_floats;

static float * sv_scratch_get(size_t floats) {
    if (floats > sv_scratch_floats) {
        free(sv_scratch);
        // 64-byte aligned: a zmm load that straddles two cache lines costs two (Gemma's output at 8 rows: 25 -> 13 ms)
        void * p = NULL;
        sv_scratch = posix_memalign(&p, 64, floats * sizeof(float)) == 0 ? (float *) p : NULL;
        sv_scratch_floats = sv_scratch ? floats : 0;
    }
    return sv_scratch;
}

// A Q8_K activation block laid out so that its values start on a cache line: block_q8_K's start 4 bytes in, so
// that every 64-byte load of them would straddle two lines (the same values, d and bsums; only the layout differs).
struct sv_q8k {
    int8_t  qs[QK_K];
    int16_t bsums[QK_K / 16];
    float   d;
    char    pad[64 - sizeof(float)];
};

// What one thread computes: weight rows [r0, r1) against n activation rows.
struct sv_job {
    const char * w;        // weight row 0
    size_t       w_stride; // bytes between weight rows
    int64_t      r0, r1;
    int          nb;       // blocks per row (32- or 256-element)
    const char * act;      // quantized activation row 0
    size_t       a_stride; // bytes between activation rows
    int          n;        // activation rows
    float *      dst;      // dst[c * d_stride + r]
    size_t       d_stride; // floats between dst columns
    const float * ad;      // Q8_0 activations: their block scales as floats, [c * nb + b]
    const int8_t * ypairs; // Q8_0 activations, AVX-512: the values of a pair of rows, per pair and block
    const int32_t * acorr; // Q8_0 activations, AVX-512, one or two pairs: -128 x each int32 lane's sum, per pair and block
    const struct sv_q8k * k8; // Q8_K activations copied to 64-byte aligned blocks, [c * nb + i]
    const struct sv_q8k2 * k8p; // Q8_K activations in pairs of rows, AVX-512, [p * nb + i]
    int          i0, i1;   // the blocks of this pass: [i0, i1) of nb (a K-chunk that keeps activations in L1)
    int64_t      ne;       // F16/BF16/F32 weights: elements per row (nb whole blocks, then vec_dot's tail)
    const char * act_f;    // F16/BF16/F32 weights: the activations prepared (F32, or BF16 for dpbf16), a_stride apart
};

// Floats of state an activation row (or pair) carries from one K-chunk to the next: its accumulators.
#define SV_STATE 32

SV_INLINE __m256 sv_in8(const struct sv_job * job, const float * st) {
    return job->i0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(st);
}

SV_INLINE __m128 sv_in4(const struct sv_job * job, const float * st) {
    return job->i0 == 0 ? _mm_setzero_ps() : _mm_loadu_ps(st);
}

SV_INLINE bool sv_last(const struct sv_job * job) {
    return job->i1 == job->nb;
}

// ---- Q8_0 and Q5_0 (x Q8_0) ------------------------------------------------------------------------
//
// vec_dot: acc = fma(set1(xd * yd), cvt(dot4(|x|, sign(y, x))), acc) per block, then hsum_float_8(acc).
// The product xd * yd is the same float product whether a lane or a scalar computes it. With AVX-512
// VNNI two activation rows share a zmm register (lanes 0-7 one row's acc, 8-15 the other's), and the
// integer lanes come from dpbusd with one side offset to unsigned and the other's lane sums subtracted
// (sv_q8_pairs): the same exact integers as vec_dot's, with the per-row sign work done once per call.

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SV_Q8_ZMM 1
#else
#define SV_Q8_ZMM 0
#endif

SV_INLINE __m256i sv_q5_0_values(const block_q5_0 * x) {
    __m256i qx = sv_bytes_from_nibbles_32(x->qs);
    __m256i bxhi = sv_bytes_from_bits_32(x->qh);
    bxhi = _mm256_andnot_si256(bxhi, _mm256_set1_epi8((char)0xF0));
    return _mm256_or_si256(qx, bxhi);
}

#if SV_Q8_ZMM

// Activations prepared once per call, in pairs of rows p = (2p, 2p + 1), per block b: 64 bytes of values and 16
// floats of block scale (eight of each row's). The integer lanes are vec_dot's exact sums by either of two routes:
// - one or two pairs (WS = 0): dpbusd on x + 128 (unsigned) against the signed activations, started at -128 x the
//   activations' lane sums (prepared per pair and block: one more load per pair, nothing more per weight block);
// - three pairs or more (WS = 1): dpbusd on y + 128 (prepared unsigned) against the signed weights, started at -128 x
//   the weights' lane sums (two more operations per weight block, one load fewer per pair).
SV_INLINE void sv_q8_pairs(const int P, const int WS, const struct sv_job * job, const __m256i qx, const float xd,
                           const int p0, const int b, __m512 * acc) {
    const __m512i zero = _mm512_setzero_si512(), k128 = _mm512_set1_epi8((char) 0x80);
    const __m512i xs = _mm512_broadcast_i64x4(qx);
    const __m512i xu = WS ? zero : _mm512_xor_si512(xs, k128);
    const __m512i wcorr = WS ? _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, k128, xs)) : zero;
    const __m512 vxd = _mm512_set1_ps(xd);
    for (int p = 0; p < P; ++p) {
        const size_t at = (size_t)(p0 + p) * job->nb + b;
        const __m512i y = _mm512_load_si512((const __m512i *) job->ypairs + at);
        const __m512i dot = WS ? _mm512_dpbusd_epi32(wcorr, y, xs)
                               : _mm512_dpbusd_epi32(_mm512_load_si512((const __m512i *) job->acorr + at), xu, y);
        const __m512 d = _mm512_mul_ps(vxd, _mm512_load_ps(job->ad + 16 * at));
        acc[p] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(dot), acc[p]);
    }
}

// Where the weights' lane sums pay (see sv_q8_pairs).
SV_INLINE int sv_q8_wside(const int n) {
    return (n + 1) / 2 >= 3;
}

SV_INLINE void sv_q8_pairs_finish(const int P, const struct sv_job * job, const __m512 * acc, const int64_t r, const int p0,
                                  float * st) {
    if (!sv_last(job)) {
        for (int p = 0; p < P; ++p) _mm512_storeu_ps(st + p * SV_STATE, acc[p]);
        return;
    }
    for (int p = 0; p < P; ++p) {
        const int c = 2 * (p0 + p);
        job->dst[(size_t) c * job->d_stride + r] = sv_hsum_float_8(_mm512_castps512_ps256(acc[p]));
        if (c + 1 < job->n) {  // an odd row count's last pair is half empty
            job->dst[(size_t)(c + 1) * job->d_stride + r] = sv_hsum_float_8(_mm512_extractf32x8_ps(acc[p], 1));
        }
    }
}

// One activation row alone (n = 1), in a ymm register: the first half of its pair (prepared with WS = 0).
SV_INLINE void sv_q8_single(const struct sv_job * job, const __m256i qx, const float xd, const int p0, const int b, __m256 * acc) {
    const __m256i xu = _mm256_xor_si256(qx, _mm256_set1_epi8((char) 0x80));
    const size_t at = (size_t) p0 * job->nb + b;
    const __m256i corr = _mm256_load_si256((const __m256i *)(job->acorr + 16 * at));
    const __m256i dot = _mm256_dpbusd_epi32(corr, xu, _mm256_load_si256((const __m256i *)(job->ypairs + 64 * at)));
    const __m256 d = _mm256_mul_ps(_mm256_set1_ps(xd), _mm256_load_ps(job->ad + 16 * at));
    *acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot), *acc);
}

static void sv_q8_0_single(const struct sv_job * job, const char * wrow, const int64_t r, const int p0, float * st) {
    __m256 acc = sv_in8(job, st);
    const block_q8_0 * x = (const block_q8_0 *) wrow;
    for (int b = job->i0; b < job->i1; ++b) {
        sv_q8_single(job, _mm256_loadu_si256((const __m256i *) x[b].qs), GGML_CPU_FP16_TO_FP32(x[b].d), p0, b, &acc);
    }
    if (sv_last(job)) job->dst[(size_t)(2 * p0) * job->d_stride + r] = sv_hsum_float_8(acc);
    else _mm256_storeu_ps(st, acc);
}

static void sv_q5_0_single(const struct sv_job * job, const char * wrow, const int64_t r, const int p0, float * st) {
    __m256 acc = sv_in8(job, st);
    const block_q5_0 * x = (const block_q5_0 *) wrow;
    for (int b = job->i0; b < job->i1; ++b) {
        sv_q8_single(job, sv_q5_0_values(x + b), GGML_CPU_FP16_TO_FP32(x[b].d), p0, b, &acc);
    }
    if (sv_last(job)) job->dst[(size_t)(2 * p0) * job->d_stride + r] = sv_hsum_float_8(acc);
    else _mm256_storeu_ps(st, acc);
}

// G counts pairs of activation rows here.
SV_INLINE void sv_q8_0_group(const int G, const struct sv_job * job, const char * wrow, const int64_t r, const int p0,
                            float * st) {
    __m512 acc[SV_GROUP];
    for (int p = 0; p < G; ++p) acc[p] = job->i0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(st + p * SV_STATE);
    const block_q8_0 * x = (const block_q8_0 *) wrow;
    if (sv_q8_wside(job->n)) {
        for (int b = job->i0; b < job->i1; ++b) {
            sv_q8_pairs(G, 1, job, _mm256_loadu_si256((const __m256i *) x[b].qs), GGML_CPU_FP16_TO_FP32(x[b].d), p0, b, acc);
        }
    } else {
        for (int b = job->i0; b < job->i1; ++b) {
            sv_q8_pairs(G, 0, job, _mm256_loadu_si256((const __m256i *) x[b].qs), GGML_CPU_FP16_TO_FP32(x[b].d), p0, b, acc);
        }
    }
    sv_q8_pairs_finish(G, job, acc, r, p0, st);
}

SV_INLINE void sv_q5_0_group(const int G, const struct sv_job * job, const char * wrow, const int64_t r, const int p0,
                            float * st) {
    __m512 acc[SV_GROUP];
    for (int p = 0; p < G; ++p) acc[p] = job->i0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(st + p * SV_STATE);
    const block_q5_0 * x = (const block_q5_0 *) wrow;
    if (sv_q8_wside(job->n)) {
        for (int b = job->i0; b < job->i1; ++b) {
            sv_q8_pairs(G, 1, job, sv_q5_0_values(x + b), GGML_CPU_FP16_TO_FP32(x[b].d), p0, b, acc);
        }
    } else {
        for (int b = job->i0; b < job->i1; ++b) {
            sv_q8_pairs(G, 0, job, sv_q5_0_values(x + b), GGML_CPU_FP16_TO_FP32(x[b].d), p0, b, acc);
        }
    }
    sv_q8_pairs_finish(G, job, acc, r, p0, st);
}

// Per call and thread: the pairs' values, lane corrections (WS = 0) and block scales (see sv_q8_pairs).
static void sv_prepare_q8_0(struct sv_job * job) {
    const int n = job->n, nb = job->nb, P = (n + 1) / 2, ws = sv_q8_wside(n);
    const size_t blocks = (size_t) P * nb;
    float * scratch = sv_scratch_get(blocks * (16 + 16 + (ws ? 0 : 16)) + 16);
    GGML_ASSERT(scratch != NULL);
    float * ad = scratch;
    int8_t * ypairs = (int8_t *)(ad + blocks * 16);
    int32_t * acorr = ws ? NULL : (int32_t *)(ypairs + blocks * 64);
    const __m256i k128 = _mm256_set1_epi8((char) 0x80);
    for (int c = 0; c < 2 * P; ++c) {
        const int p = c / 2, half = c % 2;
        for (int b = 0; b < nb; ++b) {
            const size_t at = (size_t) p * nb + b;
            __m256i qy = _mm256_setzero_si256();  // a missing row's zeros give integer sums of 0
            float yd = 0.0f;
            if (c < n) {
                const block_q8_0 * y = (const block_q8_0 *)(job->act + (size_t) c * job->a_stride) + b;
                qy = _mm256_loadu_si256((const __m256i *) y->qs);
                yd = GGML_CPU_FP16_TO_FP32(y->d);
            }
            _mm256_store_si256((__m256i *)(ypairs + 64 * at + 32 * half), ws ? _mm256_xor_si256(qy, k128) : qy);
            _mm256_store_ps(ad + 16 * at + 8 * half, _mm256_set1_ps(yd));
            if (!ws) {
                const __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), k128, qy);
                _mm256_store_si256((__m256i *)(acorr + 16 * at + 8 * half), _mm256_sub_epi32(_mm256_setzero_si256(), sums));
            }
        }
    }
    job->ad = ad;
    job->ypairs = ypairs;
    job->acorr = acorr;
}

#else  // AVX2: one activation row per ymm accumulator, vec_dot's sign trick

SV_INLINE void sv_q8_block(const int G, __m256 * acc, const __m256i qx, const float xd,
                           const struct sv_job * job, const int c0, const int b) {
    const __m256i ax = _mm256_sign_epi8(qx, qx);
    for (int g = 0; g < G; ++g) {
        const block_q8_0 * y = (const block_q8_0 *)(job->act + (size_t)(c0 + g) * job->a_stride) + b;
        const __m256i qy = _mm256_loadu_si256((const __m256i *) y->qs);
        const __m256 q = sv_mul_sum_us8_pairs_float(ax, _mm256_sign_epi8(qy, qx));
        const __m256 d = _mm256_set1_ps(xd * job->ad[(size_t)(c0 + g) * job->nb + b]);
        acc[g] = _mm256_fmadd_ps(d, q, acc[g]);
    }
}

SV_INLINE void sv_q8_finish(const int G, const struct sv_job * job, const __m256 * acc, const int64_t r, const int c0,
                            float * st) {
    for (int g = 0; g < G; ++g) {
        if (sv_last(job)) job->dst[(size_t)(c0 + g) * job->d_stride + r] = sv_hsum_float_8(acc[g]);
        else _mm256_storeu_ps(st + g * SV_STATE, acc[g]);
    }
}

SV_INLINE void sv_q8_0_group(const int G, const struct sv_job * job, const char * wrow, const int64_t r, const int c0,
                            float * st) {
    __m256 acc[SV_GROUP];
    for (int g = 0; g < G; ++g) acc[g] = sv_in8(job, st + g * SV_STATE);
    const block_q8_0 * x = (const block_q8_0 *) wrow;
    for (int b = job->i0; b < job->i1; ++b) {
        sv_q8_block(G, acc, _mm256_loadu_si256((const __m256i *) x[b].qs), GGML_CPU_FP16_TO_FP32(x[b].d), job, c0, b);
    }
    sv_q8_finish(G, job, acc, r, c0, st);
}

SV_INLINE void sv_q5_0_group(const int G, const struct sv_job * job, const char * wrow, const int64_t r, const int c0,
                            float * st) {
    __m256 acc[SV_GROUP];
    for (int g = 0; g < G; ++g) acc[g] = sv_in8(job, st + g * SV_STATE);
    const block_q5_0 * x = (const block_q5_0 *) wrow;
    for (int b = job->i0; b < job->i1; ++b) {
        sv_q8_block(G, acc, sv_q5_0_values(x + b), GGML_CPU_FP16_TO_FP32(x[b].d), job, c0, b);
    }
    sv_q8_finish(G, job, acc, r, c0, st);
}

// Per call and thread: the activations' block scales as floats.
static void sv_prepare_q8_0(struct sv_job * job) {
    const int n = job->n, nb = job->nb;
    float * ad = sv_scratch_get((size_t) n * nb + 16);
    GGML_ASSERT(ad != NULL);
    for (int c = 0; c < n; ++c) {
        const block_q8_0 * y = (const block_q8_0 *)(job->act + (size_t) c * job->a_stride);
        for (int b = 0; b < nb; ++b) ad[(size_t) c * nb + b] = GGML_CPU_FP16_TO_FP32(y[b].d);
    }
    job->ad = ad;
}

#endif

// ---- Q4_K, Q5_K and Q6_K (x Q8_K)
//
// vec_dot's float operations per super-block (acc = fma(d, cvt(sumi), acc), the mins' acc_m, hsum at the end) on
// integer lanes summed as vec_dot sums them: lane k of sumi holds bytes 4k..4k+3 of every 32-byte chunk times its
// scale. With AVX-512 two activation rows share a zmm register (lanes 0-7 one row's, 8-15 the other's), the weight
// chunk broadcast to both halves: a pair costs the integer and float work of one row (sv_q4_K_pairs).

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SV_K_ZMM 1
#else
#define SV_K_ZMM 0
#endif

// ---- Q4_K and Q5_K (x Q8_K) ------------------------------------------------------------------------

// The 8 scales and 8 mins of a Q4_K/Q5_K super-block as int16: vec_dot's utmp unpacking.
SV_INLINE __m256i sv_k4_mins_and_scales(const uint8_t * scales) {
    static const uint32_t kmask1 = 0x3f3f3f3f;
    static const uint32_t kmask2 = 0x0f0f0f0f;
    static const uint32_t kmask3 = 0x03030303;
    uint32_t utmp[4];
    memcpy(utmp, scales, 12);
    utmp[3] = ((utmp[2] >> 4) & kmask2) | (((utmp[1] >> 6) & kmask3) << 4);
    const uint32_t uaux = utmp[1] & kmask1;
    utmp[1] = (utmp[2] & kmask2) | (((utmp[0] >> 6) & kmask3) << 4);
    utmp[2] = uaux;
    utmp[0] &= kmask1;
    return _mm256_cvtepu8_epi16(_mm_set_epi32(utmp[3], utmp[2], utmp[1], utmp[0]));
}

// A decoded Q4_K/Q5_K super-block: eight 32-byte chunks of unsigned weights and their scales.
struct sv_k4 {
    __m256i q[8];
    __m256i s[8];
    __m128i mins;
};

SV_INLINE void sv_k4_scales(struct sv_k4 * k, const __m256i mins_and_scales) {
    const __m128i sc128 = _mm256_extracti128_si256(mins_and_scales, 0);
    const __m256i scales = SV_SET_M128I(sc128, sc128);
    for (int j = 0; j < 8; ++j) {
        k->s[j] = _mm256_shuffle_epi8(scales, _mm256_loadu_si256((const __m256i *) sv_shuffle_k4 + j));
    }
    k->mins = _mm256_extracti128_si256(mins_and_scales, 1);
}

SV_INLINE void sv_q4_K_decode(struct sv_k4 * k, const block_q4_K * x) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    sv_k4_scales(k, sv_k4_mins_and_scales(x->scales));
    const uint8_t * q4 = x->qs;
    for (int j = 0; j < 4; ++j) {
        const __m256i q4bits = _mm256_loadu_si256((const __m256i *)(q4 + 32 * j));
        k->q[2 * j + 0] = _mm256_and_si256(q4bits, m4);
        k->q[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(q4bits, 4), m4);
    }
}

SV_INLINE void sv_q5_K_decode(struct sv_k4 * k, const block_q5_K * x) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    sv_k4_scales(k, sv_k4_mins_and_scales(x->scales));
    const uint8_t * q5 = x->qs;
    const __m256i hbits = _mm256_loadu_si256((const __m256i *) x->qh);
    __m256i hmask = _mm256_set1_epi8(1);
    int bit = 0;
    for (int j = 0; j < 4; ++j) {
        const __m256i q5bits = _mm256_loadu_si256((const __m256i *)(q5 + 32 * j));
        const __m256i q5l_0 = _mm256_and_si256(q5bits, m4);
        const __m256i q5h_0 = _mm256_slli_epi16(_mm256_srli_epi16(_mm256_and_si256(hbits, hmask), bit++), 4);
        k->q[2 * j + 0] = _mm256_add_epi8(q5l_0, q5h_0);
        hmask = _mm256_slli_epi16(hmask, 1);
        const __m256i q5l_1 = _mm256_and_si256(_mm256_srli_epi16(q5bits, 4), m4);
        const __m256i q5h_1 = _mm256_slli_epi16(_mm256_srli_epi16(_mm256_and_si256(hbits, hmask), bit++), 4);
        k->q[2 * j + 1] = _mm256_add_epi8(q5l_1, q5h_1);
        hmask = _mm256_slli_epi16(hmask, 1);
    }
}

// The super-block's integer sum for one activation row: vec_dot's sumi, lane for lane.
SV_INLINE __m256i sv_k4_sumi(const struct sv_k4 * k, const int8_t * q8) {
    __m256i sumi = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
        const __m256i q8j = _mm256_loadu_si256((const __m256i *)(q8 + 32 * j));
        sumi = sv_madd_add(sumi, k->s[j], _mm256_maddubs_epi16(k->q[j], q8j));
    }
    return sumi;
}

// the mins' product with the activation's block sums: vec_dot's prod
SV_INLINE __m128i sv_k4_prod(const struct sv_k4 * k, const struct sv_q8k * y) {
    const __m256i q8sums = _mm256_loadu_si256((const __m256i *) y->bsums);
    const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
    return _mm_madd_epi16(k->mins, q8s);
}

SV_INLINE void sv_q4_K_row_group(const int G, const struct sv_job * job, const char * wrow, const int64_t r, const int c0,
                             float * st) {
    __m256 acc[SV_GROUP];
    __m128 acc_m[SV_GROUP];
    for (int g = 0; g < G; ++g) { acc[g] = sv_in8(job, st + g * SV_STATE); acc_m[g] = sv_in4(job, st + g * SV_STATE + 8); }
    const block_q4_K * x = (const block_q4_K *) wrow;
    for (int i = job->i0; i < job->i1; ++i) {
        struct sv_k4 k;
        sv_q4_K_decode(&k, x + i);
        const float xd = GGML_CPU_FP16_TO_FP32(x[i].d);
        const float xdmin = GGML_CPU_FP16_TO_FP32(x[i].dmin);
        for (int g = 0; g < G; ++g) {
            const struct sv_q8k * y = job->k8 + (size_t)(c0 + g) * job->nb + i;
            const float d = y->d * xd;
            const float dmin = -y->d * xdmin;
            const __m128i prod = sv_k4_prod(&k, y);
            acc_m[g] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m[g]);
            const __m256i sumi = sv_k4_sumi(&k, y->qs);
            acc[g] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[g]);
        }
    }
    for (int g = 0; g < G; ++g) {
        if (!sv_last(job)) {
            _mm256_storeu_ps(st + g * SV_STATE, acc[g]);
            _mm_storeu_ps(st + g * SV_STATE + 8, acc_m[g]);
            continue;
        }
        __m128 m = acc_m[g];
        m = _mm_add_ps(m, _mm_movehl_ps(m, m));
        m = _mm_add_ss(m, _mm_movehdup_ps(m));
        job->dst[(size_t)(c0 + g) * job->d_stride + r] = sv_hsum_float_8(acc[g]) + _mm_cvtss_f32(m);
    }
}

SV_INLINE void sv_q5_K_row_group(const int G, const struct sv_job * job, const char * wrow, const int64_t r, const int c0,
                             float * st) {
    __m256 acc[SV_GROUP];
    float summs[SV_GROUP];
    for (int g = 0; g < G; ++g) { acc[g] = sv_in8(job, st + g * SV_STATE); summs[g] = job->i0 == 0 ? 0.f : st[g * SV_STATE + 8]; }
    const __m128i mzero = _mm_setzero_si128();
    const block_q5_K * x = (const block_q5_K *) wrow;
    for (int i = job->i0; i < job->i1; ++i) {
        struct sv_k4 k;
        sv_q5_K_decode(&k, x + i);
        const float xd = GGML_CPU_FP16_TO_FP32(x[i].d);
        const float xdmin = GGML_CPU_FP16_TO_FP32(x[i].dmin);
        for (int g = 0; g < G; ++g) {
            const struct sv_q8k * y = job->k8 + (size_t)(c0 + g) * job->nb + i;
            const float d = y->d * xd;
            const float dmin = -y->d * xdmin;
            const __m128i prod = sv_k4_prod(&k, y);
            const __m128i hsum = _mm_hadd_epi32(_mm_hadd_epi32(prod, mzero), mzero);
            summs[g] += dmin * _mm_extract_epi32(hsum, 0);
            const __m256i sumi = sv_k4_sumi(&k, y->qs);
            acc[g] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[g]);
        }
    }
    for (int g = 0; g < G; ++g) {
        if (sv_last(job)) {
            job->dst[(size_t)(c0 + g) * job->d_stride + r] = sv_hsum_float_8(acc[g]) + summs[g];
        } else {
            _mm256_storeu_ps(st + g * SV_STATE, acc[g]);
            st[g * SV_STATE + 8] = summs[g];
        }
    }
}

// ---- Q6_K (x Q8_K) ---------------------------------------------------------------------------------

struct sv_k6 {
    __m256i q[8];    // 6-bit weights, unsigned
    __m256i s[8];    // their int16 scales, per 16 weights
    __m256i scales_16;
};

SV_INLINE void sv_q6_K_decode(struct sv_k6 * k, const block_q6_K * x) {
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m256i m15 = _mm256_set1_epi8(15);
    const __m128i scales = _mm_loadu_si128((const __m128i *) x->scales);
    k->scales_16 = _mm256_cvtepi8_epi16(scales);
    const uint8_t * q4 = x->ql;
    const uint8_t * qh = x->qh;
    for (int j = 0; j < 2; ++j) {
        const __m256i q4bits1 = _mm256_loadu_si256((const __m256i *)(q4 + 64 * j));
        const __m256i q4bits2 = _mm256_loadu_si256((const __m256i *)(q4 + 64 * j + 32));
        const __m256i q4bitsH = _mm256_loadu_si256((const __m256i *)(qh + 32 * j));
        const __m256i q4h_0 = _mm256_slli_epi16(_mm256_and_si256(q4bitsH, m3), 4);
        const __m256i q4h_1 = _mm256_slli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(12)), 2);
        const __m256i q4h_2 = _mm256_and_si256(q4bitsH, _mm256_set1_epi8(48));
        const __m256i q4h_3 = _mm256_srli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(-64)), 2);
        k->q[4 * j + 0] = _mm256_or_si256(_mm256_and_si256(q4bits1, m15), q4h_0);
        k->q[4 * j + 1] = _mm256_or_si256(_mm256_and_si256(q4bits2, m15), q4h_1);
        k->q[4 * j + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits1, 4), m15), q4h_2);
        k->q[4 * j + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits2, 4), m15), q4h_3);
        for (int t = 0; t < 4; ++t) {
            const __m128i sh = _mm_loadu_si128((const __m128i *) sv_shuffle_q6 + 4 * j + t);
            k->s[4 * j + t] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, sh));
        }
    }
}

SV_INLINE void sv_q6_K_row_group(const int G, const struct sv_job * job, const char * wrow, const int64_t r, const int c0,
                             float * st) {
    __m256 acc[SV_GROUP];
    for (int g = 0; g < G; ++g) acc[g] = sv_in8(job, st + g * SV_STATE);
    const block_q6_K * x = (const block_q6_K *) wrow;
    for (int i = job->i0; i < job->i1; ++i) {
        struct sv_k6 k;
        sv_q6_K_decode(&k, x + i);
        const float xd = GGML_CPU_FP16_TO_FP32(x[i].d);
        for (int g = 0; g < G; ++g) {
            const struct sv_q8k * y = job->k8 + (size_t)(c0 + g) * job->nb + i;
            const float d = y->d * xd;
            const __m256i q8sums = _mm256_loadu_si256((const __m256i *) y->bsums);
            const __m256i q8sclsub = _mm256_slli_epi32(_mm256_madd_epi16(q8sums, k.scales_16), 5);
            __m256i sumi = _mm256_setzero_si256();
            for (int t = 0; t < 8; ++t) {
                const __m256i q8t = _mm256_loadu_si256((const __m256i *)(y->qs + 32 * t));
                sumi = sv_madd_add(sumi, k.s[t], _mm256_maddubs_epi16(k.q[t], q8t));
            }
            sumi = _mm256_sub_epi32(sumi, q8sclsub);
            acc[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(&d), _mm256_cvtepi32_ps(sumi), acc[g]);
        }
    }
    for (int g = 0; g < G; ++g) {
        if (sv_last(job)) job->dst[(size_t)(c0 + g) * job->d_stride + r] = sv_hsum_float_8(acc[g]);
        else _mm256_storeu_ps(st + g * SV_STATE, acc[g]);
    }
}

#if SV_K_ZMM
// ---- K-quants in pairs of activation rows (AVX-512) -----------------------------------------------
//
// A pair's activations per super-block, prepared once per call: chunk c (32 values) of both rows side by side, so a
// weight chunk broadcast to both halves of a zmm register meets both rows at once; each row's d (eight lanes each),
// -d (four lanes each, for the mins), bsums (Q6_K) and vec_dot's q8s (its bsums summed pairwise: Q4_K, Q5_K).
struct sv_q8k2 {
    int8_t  qs[8][64];  // chunk c: the first row's 32 values, then the second's
    float   d[16];      // the first row's d x 8, the second's x 8
    int16_t bsums[32];  // the first row's 16, the second's
    int16_t q8s[16];    // _mm_hadd_epi16 of each row's bsums' halves: the first row's 8, the second's
    float   nd[8];      // -d: the first row's x 4, the second's x 4
    char    pad[64];
};

#define SV_KPAIRS 6

SV_INLINE __m512i sv_bcast(const __m256i x) {
    return _mm512_broadcast_i64x4(x);
}

// The pair's integer sums: vec_dot's sumi for each row in its half (exact: the same int32 terms, summed in another order).
SV_INLINE __m512i sv_k_sumi2(const __m512i * qb, const __m512i * sb, const struct sv_q8k2 * y) {
    __m512i sumi = _mm512_setzero_si512();
    for (int c = 0; c < 8; ++c) {
        sumi = _mm512_dpwssd_epi32(sumi, sb[c], _mm512_maddubs_epi16(qb[c], _mm512_load_si512((const __m512i *) y->qs[c])));
    }
    return sumi;
}

SV_INLINE void sv_k_bcast(__m512i * qb, __m512i * sb, const __m256i * q, const __m256i * sc) {
    for (int c = 0; c < 8; ++c) {
        qb[c] = sv_bcast(q[c]);
        sb[c] = sv_bcast(sc[c]);
    }
}

// The accumulator lanes of row h (0 or 1) of a pair.
SV_INLINE __m256 sv_half(const __m512 acc, const int h) {
    return h ? _mm512_extractf32x8_ps(acc, 1) : _mm512_castps512_ps256(acc);
}

SV_INLINE const struct sv_q8k2 * sv_k8p(const struct sv_job * job, const int p, const int i) {
    return job->k8p + (size_t) p * job->nb + i;
}

// Where a row of the pair goes: its result, or the state carried to the next K-chunk.
SV_INLINE int sv_pair_row(const struct sv_job * job, const int p, const int h) {
    return 2 * p + h < job->n;
}

// Q4_K: vec_dot's acc (eight lanes per row) and acc_m (four lanes per row: a ymm register holds the pair's).
SV_INLINE void sv_q4_K_group(const int G, const struct sv_job * job, const char * wrow, const int64_t r, const int p0,
                             float * st) {
    __m512 acc[SV_KPAIRS];
    __m256 acc_m[SV_KPAIRS];
    for (int p = 0; p < G; ++p) {
        acc[p] = job->i0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(st + p * SV_STATE);
        acc_m[p] = job->i0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(st + p * SV_STATE + 16);
    }
    const block_q4_K * x = (const block_q4_K *) wrow;
    for (int i = job->i0; i < job->i1; ++i) {
        struct sv_k4 k;
        sv_q4_K_decode(&k, x + i);
        __m512i qb[8], sb[8];
        sv_k_bcast(qb, sb, k.q, k.s);
        const __m256i mins2 = _mm256_broadcastsi128_si256(k.mins);
        const __m512 vxd = _mm512_set1_ps(GGML_CPU_FP16_TO_FP32(x[i].d));
        const __m256 vxdmin = _mm256_set1_ps(GGML_CPU_FP16_TO_FP32(x[i].dmin));
        for (int p = 0; p < G; ++p) {
            const struct sv_q8k2 * y = sv_k8p(job, p0 + p, i);
            const __m256i prod = _mm256_madd_epi16(mins2, _mm256_load_si256((const __m256i *) y->q8s));
            const __m256 dmin = _mm256_mul_ps(_mm256_load_ps(y->nd), vxdmin);  // vec_dot's -y.d * dmin
            acc_m[p] = _mm256_fmadd_ps(dmin, _mm256_cvtepi32_ps(prod), acc_m[p]);
            const __m512 d = _mm512_mul_ps(_mm512_load_ps(y->d), vxd);         // vec_dot's y.d * d
            acc[p] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sv_k_sumi2(qb, sb, y)), acc[p]);
        }
    }
    for (int p = 0; p < G; ++p) {
        if (!sv_last(job)) {
            _mm512_storeu_ps(st + p * SV_STATE, acc[p]);
            _mm256_storeu_ps(st + p * SV_STATE + 16, acc_m[p]);
            continue;
        }
        for (int h = 0; h < 2; ++h) {
            if (!sv_pair_row(job, p0 + p, h)) continue;
            const __m256 a = sv_half(acc[p], h);
            __m128 m = h ? _mm256_extractf128_ps(acc_m[p], 1) : _mm256_castps256_ps128(acc_m[p]);
            m = _mm_add_ps(m, _mm_movehl_ps(m, m));
            m = _mm_add_ss(m, _mm_movehdup_ps(m));
            job->dst[(size_t)(2 * (p0 + p) + h) * job->d_stride + r] = sv_hsum_float_8(a) + _mm_cvtss_f32(m);
        }
    }
}

// Q5_K: as Q4_K, with vec_dot's scalar sum of the mins per row (summs).
SV_INLINE void sv_q5_K_group(const int G, const struct sv_job * job, const char * wrow, const int64_t r, const int p0,
                             float * st) {
    __m512 acc[SV_KPAIRS];
    float summs[SV_KPAIRS][2];
    for (int p = 0; p < G; ++p) {
        acc[p] = job->i0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(st + p * SV_STATE);
        summs[p][0] = job->i0 == 0 ? 0.f : st[p * SV_STATE + 16];
        summs[p][1] = job->i0 == 0 ? 0.f : st[p * SV_STATE + 17];
    }
    const __m128i mzero = _mm_setzero_si128();
    const block_q5_K * x = (const block_q5_K *) wrow;
    for (int i = job->i0; i < job->i1; ++i) {
        struct sv_k4 k;
        sv_q5_K_decode(&k, x + i);
        __m512i qb[8], sb[8];
        sv_k_bcast(qb, sb, k.q, k.s);
        const __m256i mins2 = _mm256_broadcastsi128_si256(k.mins);
        const float xd = GGML_CPU_FP16_TO_FP32(x[i].d);
        const float xdmin = GGML_CPU_FP16_TO_FP32(x[i].dmin);
        const __m512 vxd = _mm512_set1_ps(xd);
        for (int p = 0; p < G; ++p) {
            const struct sv_q8k2 * y = sv_k8p(job, p0 + p, i);
            const __m256i prod = _mm256_madd_epi16(mins2, _mm256_load_si256((const __m256i *) y->q8s));
            for (int h = 0; h < 2; ++h) {
                const __m128i ph = h ? _mm256_extracti128_si256(prod, 1) : _mm256_castsi256_si128(prod);
                const __m128i hsum = _mm_hadd_epi32(_mm_hadd_epi32(ph, mzero), mzero);
                const float dmin = -y->d[8 * h] * xdmin;
                summs[p][h] += dmin * _mm_extract_epi32(hsum, 0);
            }
            const __m512 d = _mm512_mul_ps(_mm512_load_ps(y->d), vxd);
            acc[p] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sv_k_sumi2(qb, sb, y)), acc[p]);
        }
    }
    for (int p = 0; p < G; ++p) {
        if (!sv_last(job)) {
            _mm512_storeu_ps(st + p * SV_STATE, acc[p]);
            st[p * SV_STATE + 16] = summs[p][0];
            st[p * SV_STATE + 17] = summs[p][1];
            continue;
        }
        for (int h = 0; h < 2; ++h) {
            if (!sv_pair_row(job, p0 + p, h)) continue;
            const __m256 a = sv_half(acc[p], h);
            job->dst[(size_t)(2 * (p0 + p) + h) * job->d_stride + r] = sv_hsum_float_8(a) + summs[p][h];
        }
    }
}

// Q6_K: vec_dot's sumi - (bsums x scales) << 5, then acc = fma(d, cvt(sumi), acc).
SV_INLINE void sv_q6_K_group(const int G, const struct sv_job * job, const char * wrow, const int64_t r, const int p0,
                             float * st) {
    __m512 acc[SV_KPAIRS];
    for (int p = 0; p < G; ++p) acc[p] = job->i0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(st + p * SV_STATE);
    const block_q6_K * x = (const block_q6_K *) wrow;
    for (int i = job->i0; i < job->i1; ++i) {
        struct sv_k6 k;
        sv_q6_K_decode(&k, x + i);
        __m512i qb[8], sb[8];
        sv_k_bcast(qb, sb, k.q, k.s);
        const __m512i sc16 = sv_bcast(k.scales_16);
        const __m512 vxd = _mm512_set1_ps(GGML_CPU_FP16_TO_FP32(x[i].d));
        for (int p = 0; p < G; ++p) {
            const struct sv_q8k2 * y = sv_k8p(job, p0 + p, i);
            const __m512i q8sclsub = _mm512_slli_epi32(_mm512_madd_epi16(_mm512_load_si512((const __m512i *) y->bsums), sc16), 5);
            const __m512i sumi = _mm512_sub_epi32(sv_k_sumi2(qb, sb, y), q8sclsub);
            const __m512 d = _mm512_mul_ps(_mm512_load_ps(y->d), vxd);
            acc[p] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sumi), acc[p]);
        }
    }
    for (int p = 0; p < G; ++p) {
        if (!sv_last(job)) { _mm512_storeu_ps(st + p * SV_STATE, acc[p]); continue; }
        for (int h = 0; h < 2; ++h) {
            if (!sv_pair_row(job, p0 + p, h)) continue;
            const __m256 a = sv_half(acc[p], h);
            job->dst[(size_t)(2 * (p0 + p) + h) * job->d_stride + r] = sv_hsum_float_8(a);
        }
    }
}

// Per call and thread, two rows or more: the Q8_K activations in pairs (see struct sv_q8k2; an odd count's last
// row pairs with zeros, whose results are never written).
static void sv_prepare_q8_K_pairs(struct sv_job * job) {
    const int P = (job->n + 1) / 2;
    const size_t blocks = (size_t) P * job->nb;
    struct sv_q8k2 * k8p = (struct sv_q8k2 *) sv_scratch_get(blocks * sizeof(struct sv_q8k2) / sizeof(float));
    GGML_ASSERT(k8p != NULL);
    memset(k8p, 0, blocks * sizeof(struct sv_q8k2));
    for (int c = 0; c < job->n; ++c) {
        const int p = c / 2, h = c % 2;
        const block_q8_K * y = (const block_q8_K *)(job->act + (size_t) c * job->a_stride);
        for (int i = 0; i < job->nb; ++i) {
            struct sv_q8k2 * out = k8p + (size_t) p * job->nb + i;
            for (int t = 0; t < 8; ++t) memcpy(out->qs[t] + 32 * h, y[i].qs + 32 * t, 32);
            for (int l = 0; l < 8; ++l) out->d[8 * h + l] = y[i].d;
            for (int l = 0; l < 4; ++l) out->nd[4 * h + l] = -y[i].d;
            memcpy(out->bsums + 16 * h, y[i].bsums, sizeof(y[i].bsums));
            const __m256i q8sums = _mm256_loadu_si256((const __m256i *) y[i].bsums);
            const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
            _mm_storeu_si128((__m128i *)(out->q8s + 8 * h), q8s);
        }
    }
    job->k8p = k8p;
}

#define sv_q4_K_odd(job, wrow, r, p0, st) sv_q4_K_row_group(1, job, wrow, r, 2 * (p0), st)
#define sv_q5_K_odd(job, wrow, r, p0, st) sv_q5_K_row_group(1, job, wrow, r, 2 * (p0), st)
#define sv_q6_K_odd(job, wrow, r, p0, st) sv_q6_K_row_group(1, job, wrow, r, 2 * (p0), st)
#define SV_K_UNIT sizeof(struct sv_q8k2)
#define SV_K_MAXG SV_KPAIRS
#else
#define sv_q4_K_group sv_q4_K_row_group
#define sv_q5_K_group sv_q5_K_row_group
#define sv_q6_K_group sv_q6_K_row_group
#define sv_q4_K_odd(job, wrow, r, p0, st) GGML_ABORT("specstack-verify: K-quants are not paired without AVX-512")
#define sv_q5_K_odd(job, wrow, r, p0, st) GGML_ABORT("specstack-verify: K-quants are not paired without AVX-512")
#define sv_q6_K_odd(job, wrow, r, p0, st) GGML_ABORT("specstack-verify: K-quants are not paired without AVX-512")
#define SV_K_UNIT sizeof(struct sv_q8k)
#define SV_K_MAXG SV_GROUP
#endif

// ---- dispatch: a pass per group of activation rows, the group size a compile-time constant ---------

#define SV_MIN(a, b) ((a) < (b) ? (a) : (b))

// Weight rows a pass walks together over one K-chunk, so that the chunk's activations stay in L1 for all of them.
#define SV_ROW_TILE 16
// Bytes of activations a K-chunk may hold for the rows of one pass: half of a Zen 4 core's L1 (32 KiB; Zen 5's is 48),
// since the weights stream through it too.
#define SV_CHUNK_BYTES 16384
// ... where a pass's whole rows would hold more than this: below it, whole rows ran faster than chunks (a 7B's
// 4096-wide Q4_K matrix at 3 rows: 1.8 ms whole, 3.0 ms in 16 KiB chunks; at 8 rows 5.6 ms whole, 4.0 chunked).
#define SV_WHOLE_BYTES 40960

// Per call and thread: the Q8_K activations copied to aligned blocks (see struct sv_q8k).
static void sv_prepare_q8_K(struct sv_job * job) {
    const size_t blocks = (size_t) job->n * job->nb;
    struct sv_q8k * k8 = (struct sv_q8k *) sv_scratch_get(blocks * sizeof(struct sv_q8k) / sizeof(float));
    GGML_ASSERT(k8 != NULL);
    for (int c = 0; c < job->n; ++c) {
        const block_q8_K * y = (const block_q8_K *)(job->act + (size_t) c * job->a_stride);
        for (int i = 0; i < job->nb; ++i) {
            struct sv_q8k * out = k8 + (size_t) c * job->nb + i;
            memcpy(out->qs, y[i].qs, sizeof(out->qs));
            memcpy(out->bsums, y[i].bsums, sizeof(out->bsums));
            out->d = y[i].d;
        }
    }
    job->k8 = k8;
}

// Blocks per K-chunk: a long row (a 7B's 14336-wide down matrix) would otherwise stream every activation row's
// whole width from L2 once per weight row. The chunks run in order, so each row's float operations are still
// vec_dot's, in vec_dot's order (the accumulators wait in ``state`` between chunks).
static int sv_chunk(const int units_in, const int maxg, const size_t unit_bytes, const int nb) {
    const int units = SV_MIN(maxg, units_in < 1 ? 1 : units_in);
    if ((size_t) units * unit_bytes * nb <= SV_WHOLE_BYTES) {
        return nb;
    }
    const int span = (int)(SV_CHUNK_BYTES / ((size_t) units * unit_bytes));
    return span < 1 ? 1 : span;
}

// A row tile's results go out one column at a time: dst's columns are whole weight-row counts apart (1 MiB for
// Gemma's output matrix), so writing every column at each weight row keeps n lines in one cache set, and from
// ~10 rows on they evict each other (Gemma's output matrix, -t 1: 10 rows 25.7 ms and 16 rows 41.5 ms written
// in place, 16.5 and 29.6 ms through the tile).
static void sv_flush(const struct sv_job * job, const float * tile, const int64_t rt, const int64_t re) {
    for (int c = 0; c < job->n; ++c) {
        memcpy(job->dst + (size_t) c * job->d_stride + rt, tile + (size_t) c * SV_ROW_TILE, (size_t)(re - rt) * sizeof(float));
    }
}

// Units are activation rows, or pairs of rows where PAIRED (a single row runs alone in a ymm register); MAXG per pass.
#define SV_DEFINE_ROWS(NAME, PAIRED, MAXG, UNIT_BYTES)                                              \
    static void NAME##_rows(const struct sv_job * job_in) {                                         \
        struct sv_job job = *job_in;                                                                \
        float tile[SV_MAX_ROWS * SV_ROW_TILE];  /* a row tile's results, written out a column at a time */ \
        job.dst = tile;                                                                             \
        job.d_stride = SV_ROW_TILE;                                                                 \
        const int odd = (PAIRED) && job.n == 1;  /* one row alone; an odd row among others pairs with zeros */ \
        const int units = (PAIRED) ? (job.n + 1) / 2 - odd : job.n;                                 \
        const int span = sv_chunk(units + odd, (MAXG), (UNIT_BYTES), job.nb);                                      \
        float state[SV_ROW_TILE * ((MAXG) + 1) * SV_STATE];                                         \
        for (int64_t rt = job_in->r0; rt < job_in->r1; rt += SV_ROW_TILE) {                         \
            const int64_t re = SV_MIN(rt + SV_ROW_TILE, job_in->r1);                                \
            for (int u0 = 0; u0 < units + odd; u0 += (MAXG)) {                                      \
                const int g = SV_MIN(units - u0, (MAXG));                                           \
                for (job.i0 = 0; job.i0 < job.nb; job.i0 += span) {                                 \
                    job.i1 = SV_MIN(job.i0 + span, job.nb);                                         \
                    for (int64_t r = rt; r < re; ++r) {                                             \
                        const char * w = job.w + (size_t) r * job.w_stride;                         \
                        float * st = state + (r - rt) * ((MAXG) + 1) * SV_STATE;                    \
                        if (g <= 0) { NAME##_odd(&job, w, r - rt, units, st); continue; }           \
                        switch (g) {                                                                \
                        case 1: NAME##_group(SV_MIN(1, MAXG), &job, w, r - rt, u0, st); break;                            \
                        case 2: NAME##_group(SV_MIN(2, MAXG), &job, w, r - rt, u0, st); break;                            \
                        case 3: NAME##_group(SV_MIN(3, MAXG), &job, w, r - rt, u0, st); break;                            \
                        case 4: NAME##_group(SV_MIN(4, MAXG), &job, w, r - rt, u0, st); break;                            \
                        case 5: NAME##_group(SV_MIN(5, MAXG), &job, w, r - rt, u0, st); break;                            \
                        case 6: NAME##_group(SV_MIN(6, MAXG), &job, w, r - rt, u0, st); break;                            \
                        case 7: NAME##_group(SV_MIN(7, MAXG), &job, w, r - rt, u0, st); break;                            \
                        case 8: NAME##_group(SV_MIN(8, MAXG), &job, w, r - rt, u0, st); break;                            \
                        case 9: NAME##_group(SV_MIN(9, MAXG), &job, w, r - rt, u0, st); break;                            \
                        case 10: NAME##_group(SV_MIN(10, MAXG), &job, w, r - rt, u0, st); break;                          \
                        case 11: NAME##_group(SV_MIN(11, MAXG), &job, w, r - rt, u0, st); break;                          \
                        case 12: NAME##_group(SV_MIN(12, MAXG), &job, w, r - rt, u0, st); break;                          \
                        case 13: NAME##_group(SV_MIN(13, MAXG), &job, w, r - rt, u0, st); break;                          \
                        case 14: NAME##_group(SV_MIN(14, MAXG), &job, w, r - rt, u0, st); break;                          \
                        case 15: NAME##_group(SV_MIN(15, MAXG), &job, w, r - rt, u0, st); break;                          \
                        case 16: NAME##_group(SV_MIN(16, MAXG), &job, w, r - rt, u0, st); break;                          \
                        default: GGML_ABORT("specstack-verify: a group of %d", g);                 \
                        }                                                                           \
                        if (odd && u0 + g == units) NAME##_odd(&job, w, r - rt, units, st + g * SV_STATE); \
                    }                                                                               \
                }                                                                                   \
                if (odd && u0 + g == units) break;                                                  \
            }                                                                                       \
            sv_flush(job_in, tile, rt, re);                                                         \
        }                                                                                           \
    }

#if SV_Q8_ZMM
#define sv_q8_0_odd sv_q8_0_single
#define sv_q5_0_odd sv_q5_0_single
#else
#define sv_q8_0_odd(job, wrow, r, p0, st) GGML_ABORT("specstack-verify: no pairs without AVX-512")
#define sv_q5_0_odd(job, wrow, r, p0, st) GGML_ABORT("specstack-verify: no pairs without AVX-512")
#endif

SV_DEFINE_ROWS(sv_q8_0, SV_Q8_ZMM, (SV_Q8_ZMM ? SV_PAIRS : SV_GROUP), (SV_Q8_ZMM ? 192 : sizeof(block_q8_0)))
SV_DEFINE_ROWS(sv_q5_0, SV_Q8_ZMM, (SV_Q8_ZMM ? SV_PAIRS : SV_GROUP), (SV_Q8_ZMM ? 192 : sizeof(block_q8_0)))
SV_DEFINE_ROWS(sv_q4_K, SV_K_ZMM, SV_K_MAXG, SV_K_UNIT)
SV_DEFINE_ROWS(sv_q5_K, SV_K_ZMM, SV_K_MAXG, SV_K_UNIT)
SV_DEFINE_ROWS(sv_q6_K, SV_K_ZMM, SV_K_MAXG, SV_K_UNIT)

// ---- F16, BF16 and F32 weights ---------------------------------------------------------------------
//
// vec_dot_f16 and vec_dot_f32 (vec.cpp) keep ARR accumulators of EPR lanes: accumulator j takes, block after block of
// STEP elements, acc[j] = fma(x, y, acc[j]) on the block's j-th vector (F16 widened to F32 as it is loaded); then
// ggml's REDUCE of the accumulators and the tail element by element (in double for F16, in float for F32).
// vec_dot_bf16: with AVX512-BF16 two dpbf16 accumulators over blocks of 64, on AVX2 four mul-then-add accumulators
// over blocks of 32, then the tail in double. The accumulators never meet before the reduction, so each one's chain
// may run on its own; two walks use that, both giving every (weight row, activation row) vec_dot's chains in vec_dot's
// order, so that which walk runs (it depends on n) never changes a bit:
// - up to SV_FSMALL activation rows: each weight row read once, in place, its blocks met by every row's accumulators
//   (all of a row's ARR accumulators in registers);
// - the rest: a block of SV_FRM weight rows, in cache after the in-place walk and read where they are, meets SV_FRN
//   activation rows one accumulator at a time: SV_FRM x SV_FRN chains in registers, SV_FRM + SV_FRN loads for
//   SV_FRM x SV_FRN products.
// The activations are prepared once per call and thread as the stock path converts them (the vec_dot_type's
// from_float) and laid out accumulator-major (the j-th vector of every block together); everything stays in the
// stored precision and is widened where vec_dot widens it, as it is loaded. BF16 on AVX-512 without AVX512-BF16 (vec_dot's third loop, which no build here runs) is left
// to the stock paths.

#if defined(__AVX512F__)
#define SV_FRM 4   // weight rows x activation rows per block: 4 x 6 accumulators + 4 weight vectors + 1 in 32 zmm
#define SV_FRN 6
#else
#define SV_FRM 2   // 2 x 5 + 2 + 1 in 16 ymm
#define SV_FRN 5
#endif
// Activation rows the in-place walk takes: their 4 accumulators each, a weight vector and an activation in registers.
#define SV_FSMALL 3
// Elements per K-chunk of the blocked walk: one accumulator's share of a chunk of SV_FRN activation rows and SV_FRM
// weight rows stays in L1 while it is met (the accumulators wait in memory between chunks).
#define SV_FKC 4096
// Bytes ahead that the in-place walk prefetches its weights: the blocked walk's strided reads of the rows before
// (from cache) leave the hardware prefetchers untrained for the next rows (4 activation rows ran at 0.78 ms where 3,
// with no blocked walk, took 0.28: a 2048 x 2048 F16 matrix, -t 1).
#define SV_FAHEAD 4096

#if defined(__AVX512BF16__)
#define SV_BF16 1
#define SV_BF16_RAW 1   // dpbf16 takes BF16 as it is stored
#define SV_BF16_STEP 64
#define SV_BF16_ARR  2
#elif !defined(__AVX512F__)
#define SV_BF16 1
#define SV_BF16_RAW 0
#define SV_BF16_STEP 32
#define SV_BF16_ARR  4
#else
#define SV_BF16 0
#define SV_BF16_RAW 0
#define SV_BF16_STEP 32
#define SV_BF16_ARR  4
#endif

// The accumulators stay in registers only where these loops are unrolled whole.
#define SV_UNROLL _Pragma("GCC unroll 16")

_Static_assert(GGML_F16_DOT_STEP == GGML_F32_STEP && GGML_F16_DOT_EPR == GGML_F32_EPR,
               "F16 dot products accumulate in F32 vectors, block for block as F32's");
_Static_assert(SV_FKC % GGML_F32_STEP == 0 && SV_FKC % SV_BF16_STEP == 0, "a K-chunk holds whole blocks");

// vec_dot's loop for one float type: its block, accumulators, lanes per accumulator, and bytes per stored element.
struct sv_float_kind {
    int step, arr, epr, elem;
};

SV_INLINE struct sv_float_kind sv_float_kind_of(const enum ggml_type type) {
    struct sv_float_kind k = { GGML_F32_STEP, GGML_F32_ARR, GGML_F32_EPR, type == GGML_TYPE_F32 ? 4 : 2 };
    if (type == GGML_TYPE_BF16) {
        k.step = SV_BF16_STEP, k.arr = SV_BF16_ARR, k.epr = SV_BF16_STEP / SV_BF16_ARR;
    }
    return k;
}

// One accumulator vector's lanes as vec_dot loads them, and its product-accumulate, per type.
#define SV_F16_LOAD(p) GGML_F16_DOT_VEC_LOAD((const ggml_fp16_t *)(p), 0)
#define SV_F16_OP(acc, w, a) (acc) = GGML_F16_DOT_VEC_FMA((acc), (w), (a))
#define SV_F32_LOAD(p) GGML_F32_VEC_LOAD((const float *)(p))
#define SV_F32_OP(acc, w, a) (acc) = GGML_F32_VEC_FMA((acc), (w), (a))
#if SV_BF16_RAW
#define SV_BF16_LOAD(p) _mm512_castsi512_ps(_mm512_loadu_si512(p))
#define SV_BF16_OP(acc, w, a) (acc) = _mm512_dpbf16_ps((acc), m512bh(_mm512_castps_si512(w)), m512bh(_mm512_castps_si512(a)))
#else
#define SV_BF16_LOAD(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define SV_BF16_OP(acc, w, a) (acc) = _mm256_add_ps(_mm256_mul_ps((w), (a)), (acc))
#endif

// Where accumulator j of block b sits in an accumulator-major row of prepared activations, in bytes.
SV_INLINE size_t sv_amajor(const struct sv_float_kind k, const int nb, const int b, const int j) {
    return (((size_t) j * nb + b) * k.epr) * k.elem;
}

// The in-place walk: weight row r (as stored) against activation rows [u0, u0 + G), all their accumulators in
// registers; part gets each row's ARR accumulators.
#define SV_DEFINE_FLOAT_SMALL(NAME, ARRC, LOAD, OP)                                                            \
    SV_INLINE void NAME(const int G, const struct sv_job * job, const struct sv_float_kind k, const int64_t r,  \
                        const int u0, GGML_F32_VEC * part) {                                                   \
        GGML_F32_VEC acc[SV_FSMALL][ARRC];                                                                     \
        SV_UNROLL for (int g = 0; g < G; ++g) { SV_UNROLL for (int j = 0; j < ARRC; ++j) acc[g][j] = GGML_F32_VEC_ZERO; } \
        const char * x = job->w + (size_t) r * job->w_stride;                                                  \
        const size_t wb = (size_t) k.step * k.elem;  /* bytes per block of a weight row */                     \
        for (int b = 0; b < job->nb; ++b) {                                                                    \
            for (size_t o = 0; o < wb; o += 64) _mm_prefetch(x + b * wb + o + SV_FAHEAD, _MM_HINT_T0);        \
            SV_UNROLL for (int j = 0; j < ARRC; ++j) {                                                         \
                const GGML_F32_VEC w = LOAD(x + ((size_t) b * k.step + (size_t) j * k.epr) * k.elem);          \
                SV_UNROLL for (int g = 0; g < G; ++g) {                                                        \
                    const GGML_F32_VEC a = LOAD(job->act_f + (size_t)(u0 + g) * job->a_stride + sv_amajor(k, job->nb, b, j)); \
                    OP(acc[g][j], w, a);                                                                       \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        for (int g = 0; g < G; ++g) for (int j = 0; j < ARRC; ++j) part[(size_t)(u0 + g) * 4 + j] = acc[g][j]; \
    }

// The blocked walk: RM weight rows from r (as stored, in cache after the in-place walk) against activation rows
// [u0, u0 + RN), blocks [b0, b1), one accumulator at a time; part holds every (weight row, activation row)'s
// accumulators between chunks.
#define SV_DEFINE_FLOAT_BLOCK(NAME, LOAD, OP)                                                                  \
    SV_INLINE void NAME(const int RM, const int RN, const struct sv_job * job, const struct sv_float_kind k,   \
                        const int64_t r, const int b0, const int b1, const int u0, GGML_F32_VEC * part) {      \
        for (int j = 0; j < k.arr; ++j) {                                                                      \
            GGML_F32_VEC acc[SV_FRM][SV_FRN];                                                                  \
            SV_UNROLL for (int m = 0; m < RM; ++m) {                                                           \
                SV_UNROLL for (int c = 0; c < RN; ++c) {                                                       \
                    acc[m][c] = b0 == 0 ? GGML_F32_VEC_ZERO : part[((size_t) m * SV_MAX_ROWS + u0 + c) * 4 + j]; \
                }                                                                                              \
            }                                                                                                  \
            const char * wj = job->w + (size_t) r * job->w_stride + (size_t) j * k.epr * k.elem;               \
            const char * aj = job->act_f + (size_t) u0 * job->a_stride + sv_amajor(k, job->nb, 0, j);          \
            const size_t vb = (size_t) k.epr * k.elem;  /* bytes per vector as stored */                       \
            const size_t wb = (size_t) k.step * k.elem;  /* bytes per block of a weight row */                 \
            for (int b = b0; b < b1; ++b) {                                                                    \
                GGML_F32_VEC wv[SV_FRM];                                                                       \
                SV_UNROLL for (int m = 0; m < RM; ++m) wv[m] = LOAD(wj + (size_t) m * job->w_stride + b * wb); \
                SV_UNROLL for (int c = 0; c < RN; ++c) {                                                       \
                    const GGML_F32_VEC a = LOAD(aj + (size_t) c * job->a_stride + b * vb);                     \
                    SV_UNROLL for (int m = 0; m < RM; ++m) OP(acc[m][c], wv[m], a);                            \
                }                                                                                              \
            }                                                                                                  \
            for (int m = 0; m < RM; ++m) {                                                                     \
                for (int c = 0; c < RN; ++c) part[((size_t) m * SV_MAX_ROWS + u0 + c) * 4 + j] = acc[m][c];   \
            }                                                                                                  \
        }                                                                                                      \
    }

SV_DEFINE_FLOAT_SMALL(sv_f16_small, GGML_F32_ARR, SV_F16_LOAD, SV_F16_OP)
SV_DEFINE_FLOAT_SMALL(sv_f32_small, GGML_F32_ARR, SV_F32_LOAD, SV_F32_OP)
SV_DEFINE_FLOAT_BLOCK(sv_f16_block, SV_F16_LOAD, SV_F16_OP)
SV_DEFINE_FLOAT_BLOCK(sv_f32_block, SV_F32_LOAD, SV_F32_OP)
#if SV_BF16
SV_DEFINE_FLOAT_SMALL(sv_bf16_small, SV_BF16_ARR, SV_BF16_LOAD, SV_BF16_OP)
SV_DEFINE_FLOAT_BLOCK(sv_bf16_block, SV_BF16_LOAD, SV_BF16_OP)
#else
#define sv_bf16_small(...) GGML_ABORT("specstack-verify: BF16 is left to the stock paths here")
#define sv_bf16_block(...) GGML_ABORT("specstack-verify: BF16 is left to the stock paths here")
#endif

// G activation rows (and RM weight rows), compile-time constants for the walks above.
#define SV_FLOAT_SMALL(NAME, G, ...)                                                                  \
    switch (G) {                                                                                    \
    case 1: NAME(1, __VA_ARGS__); break;                                                            \
    case 2: NAME(2, __VA_ARGS__); break;                                                            \
    case 3: NAME(3, __VA_ARGS__); break;                                                            \
    default: GGML_ABORT("specstack-verify: %d rows in place", G);                                   \
    }
#define SV_FLOAT_BLOCK(NAME, RM, G, ...)                                                              \
    switch (G) {                                                                                    \
    case 1: NAME(RM, 1, __VA_ARGS__); break;                                                        \
    case 2: NAME(RM, SV_MIN(2, SV_FRN), __VA_ARGS__); break;                                        \
    case 3: NAME(RM, SV_MIN(3, SV_FRN), __VA_ARGS__); break;                                        \
    case 4: NAME(RM, SV_MIN(4, SV_FRN), __VA_ARGS__); break;                                        \
    case 5: NAME(RM, SV_MIN(5, SV_FRN), __VA_ARGS__); break;                                        \
    case 6: NAME(RM, SV_MIN(6, SV_FRN), __VA_ARGS__); break;                                        \
    default: GGML_ABORT("specstack-verify: a float block of %d rows", G);                           \
    }

// A row's nb whole blocks, accumulator-major (as sv_amajor places them), in the stored precision; its tail after them
// in place.
static void sv_layout_row(const struct sv_float_kind k, const int nb, const int64_t ne, const char * in, char * out) {
    const size_t vb = (size_t) k.epr * k.elem;  // 16, 32 or 64 bytes
    for (int b = 0; b < nb; ++b) {
        for (int j = 0; j < k.arr; ++j) {
            const char * src = in + ((size_t) b * k.step + (size_t) j * k.epr) * k.elem;
            char * dst = out + sv_amajor(k, nb, b, j);
            if (vb == 64) {
                _mm256_storeu_si256((__m256i *) dst, _mm256_loadu_si256((const __m256i *) src));
                _mm256_storeu_si256((__m256i *) dst + 1, _mm256_loadu_si256((const __m256i *) src + 1));
            } else if (vb == 32) {
                _mm256_storeu_si256((__m256i *) dst, _mm256_loadu_si256((const __m256i *) src));
            } else {
                _mm_storeu_si128((__m128i *) dst, _mm_loadu_si128((const __m128i *) src));
            }
        }
    }
    const size_t tail0 = (size_t) nb * k.step * k.elem;
    memcpy(out + tail0, in + tail0, (size_t) ne * k.elem - tail0);
}

// vec_dot's reduction of one (weight row, activation row)'s accumulators and its tail, as vec_dot computes them.
static float sv_float_finish(const struct sv_job * job, const enum ggml_type type, const int64_t r, const int c,
                             GGML_F32_VEC * acc) {
    const char * row = job->w + (size_t) r * job->w_stride;
    const char * yrow = job->act_f + (size_t) c * job->a_stride;  // the tail is in place
    const int64_t tail = (int64_t) job->nb * sv_float_kind_of(type).step;
    if (type == GGML_TYPE_F32) {
        const float * x = (const float *) row, * y = (const float *) yrow;
        float sumf = 0.0f;
        GGML_F32_VEC_REDUCE(sumf, acc);
        for (int64_t i = tail; i < job->ne; ++i) {
            sumf += x[i]*y[i];
        }
        return sumf;
    }
    if (type == GGML_TYPE_F16) {
        const ggml_fp16_t * x = (const ggml_fp16_t *) row, * y = (const ggml_fp16_t *) yrow;
        ggml_float sumf = 0.0;
        GGML_F16_DOT_VEC_REDUCE(sumf, acc);
        for (int64_t i = tail; i < job->ne; ++i) {
            sumf += (ggml_float)(GGML_CPU_FP16_TO_FP32(x[i])*GGML_CPU_FP16_TO_FP32(y[i]));
        }
        return sumf;
    }
    const ggml_bf16_t * x = (const ggml_bf16_t *) row, * y = (const ggml_bf16_t *) yrow;
    ggml_float sumf = 0;
#if SV_BF16_RAW
    sumf += (ggml_float)_mm512_reduce_add_ps(acc[0]);
    sumf += (ggml_float)_mm512_reduce_add_ps(acc[1]);
#elif SV_BF16
    const __m256 s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]));
    __m128 h = _mm_add_ps(_mm256_extractf128_ps(s, 1), _mm256_castps256_ps128(s));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    sumf += (ggml_float)_mm_cvtss_f32(h);
#else
    (void) acc;
    GGML_ABORT("specstack-verify: BF16 is left to the stock paths here");
#endif
    for (int64_t i = tail; i < job->ne; ++i) {
        sumf += (ggml_float)(GGML_BF16_TO_FP32(x[i]) * GGML_BF16_TO_FP32(y[i]));
    }
    return sumf;
}

// Weight rows [r, r + rm): the in-place walk per row for the first activation rows, the blocked walk for the rest.
static void sv_float_block_rows(const struct sv_job * job, const enum ggml_type type, const int64_t r, const int rm,
                                GGML_F32_VEC * part) {
    const struct sv_float_kind k = sv_float_kind_of(type);
    // the first activation rows in place: this reads the weights from memory in order, and leaves them in cache
    const int head = SV_MIN(job->n, SV_FSMALL);
    for (int m = 0; m < rm; ++m) {
        GGML_F32_VEC * pm = part + (size_t) m * SV_MAX_ROWS * 4;
        if (type == GGML_TYPE_F16) { SV_FLOAT_SMALL(sv_f16_small, head, job, k, r + m, 0, pm) }
        else if (type == GGML_TYPE_F32) { SV_FLOAT_SMALL(sv_f32_small, head, job, k, r + m, 0, pm) }
        else { SV_FLOAT_SMALL(sv_bf16_small, head, job, k, r + m, 0, pm) }
    }
    if (job->n == head) {
        return;
    }
    const int kc = SV_FKC / k.step;
    for (int b0 = 0; b0 < job->nb; b0 += kc) {
        const int b1 = SV_MIN(b0 + kc, job->nb);
        // the rest in groups as even as SV_FRN allows (13 rows as 5 + 4 + 4, not 6 + 6 + 1)
        const int rest = job->n - head, groups = (rest + SV_FRN - 1) / SV_FRN;
        for (int u0 = head, gi = 0; gi < groups; ++gi) {
            const int g = rest / groups + (gi < rest % groups);
            if (rm == SV_FRM) {
                if (type == GGML_TYPE_F16) { SV_FLOAT_BLOCK(sv_f16_block, SV_FRM, g, job, k, r, b0, b1, u0, part) }
                else if (type == GGML_TYPE_F32) { SV_FLOAT_BLOCK(sv_f32_block, SV_FRM, g, job, k, r, b0, b1, u0, part) }
                else { SV_FLOAT_BLOCK(sv_bf16_block, SV_FRM, g, job, k, r, b0, b1, u0, part) }
            } else {
                if (type == GGML_TYPE_F16) { SV_FLOAT_BLOCK(sv_f16_block, 1, g, job, k, r, b0, b1, u0, part) }
                else if (type == GGML_TYPE_F32) { SV_FLOAT_BLOCK(sv_f32_block, 1, g, job, k, r, b0, b1, u0, part) }
                else { SV_FLOAT_BLOCK(sv_bf16_block, 1, g, job, k, r, b0, b1, u0, part) }
            }
            u0 += g;
        }
    }
}

// This thread's weight rows in tiles of SV_ROW_TILE (results written out a column at a time, as sv_flush says), each
// tile in blocks of SV_FRM rows.
static void sv_float_rows(const struct sv_job * job, const enum ggml_type type) {
    float tile[SV_MAX_ROWS * SV_ROW_TILE];
    GGML_F32_VEC part[SV_FRM * SV_MAX_ROWS * 4];  // [weight row of the block][activation row][accumulator]
    for (int64_t rt = job->r0; rt < job->r1; rt += SV_ROW_TILE) {
        const int64_t re = SV_MIN(rt + SV_ROW_TILE, job->r1);
        for (int64_t r = rt; r < re;) {
            const int rm = re - r >= SV_FRM ? SV_FRM : 1;
            sv_float_block_rows(job, type, r, rm, part);
            for (int m = 0; m < rm; ++m) {
                for (int c = 0; c < job->n; ++c) {
                    tile[(size_t) c * SV_ROW_TILE + (r - rt) + m] =
                        sv_float_finish(job, type, r + m, c, part + ((size_t) m * SV_MAX_ROWS + c) * 4);
                }
            }
            r += rm;
        }
        sv_flush(job, tile, rt, re);
    }
}

static void sv_f16_rows(const struct sv_job * job) { sv_float_rows(job, GGML_TYPE_F16); }
static void sv_f32_rows(const struct sv_job * job) { sv_float_rows(job, GGML_TYPE_F32); }
static void sv_bf16_rows(const struct sv_job * job) { sv_float_rows(job, GGML_TYPE_BF16); }

// Elements per block of each float type's vec_dot loop, 0 where the type is not ours.
static int sv_float_step(const enum ggml_type type) {
    switch (type) {
        case GGML_TYPE_F16:  return GGML_F32_STEP;
        case GGML_TYPE_F32:  return GGML_F32_STEP;
        case GGML_TYPE_BF16: return SV_BF16 ? SV_BF16_STEP : 0;
        default: return 0;
    }
}

// Per call and thread: every activation row as the stock path converts it (the vec_dot_type's from_float: F16, BF16,
// or F32 as it is), laid out accumulator-major, rows on 64-byte boundaries.
static void sv_prepare_float(struct sv_job * job, const struct ggml_tensor * src1, const enum ggml_type type) {
    const struct sv_float_kind k = sv_float_kind_of(type);
    const int64_t ne = job->ne;
    // rows a line more than a multiple of 4 KiB apart: at 4 KiB multiples every row's block falls in the same L1 sets
    const size_t bytes = (size_t)((ne * k.elem + 63) / 64 * 64);
    job->a_stride = bytes + (bytes % 4096 == 0 ? 64 : 0);
    const size_t rows_floats = job->n * job->a_stride / sizeof(float);
    float * buf = sv_scratch_get(rows_floats + (size_t) ne + 16);  // the rows, then one row's conversion
    GGML_ASSERT(buf != NULL);
    char * tmp = (char *)(buf + rows_floats);
    ggml_from_float_t const from_float = ggml_get_type_traits_cpu(type)->from_float;  // vec_dot_type is type here
    for (int c = 0; c < job->n; ++c) {
        from_float((const float *)((const char *) src1->data + (size_t) c * src1->nb[1]), tmp, ne);
        sv_layout_row(k, job->nb, ne, tmp, (char *) buf + (size_t) c * job->a_stride);
    }
    job->act_f = (const char *) buf;
}

typedef void (*sv_rows_fn)(const struct sv_job * job);

static sv_rows_fn sv_rows_for(enum ggml_type type) {
    switch (type) {
        case GGML_TYPE_Q8_0: return sv_q8_0_rows;
        case GGML_TYPE_Q5_0: return sv_q5_0_rows;
        case GGML_TYPE_Q4_K: return sv_q4_K_rows;
        case GGML_TYPE_Q5_K: return sv_q5_K_rows;
        case GGML_TYPE_Q6_K: return sv_q6_K_rows;
        case GGML_TYPE_F16:  return sv_f16_rows;
        case GGML_TYPE_F32:  return sv_f32_rows;
        case GGML_TYPE_BF16: return SV_BF16 ? sv_bf16_rows : NULL;
        default: return NULL;
    }
}

static bool sv_disabled(void) {
    static int disabled = -1;
    if (disabled < 0) {
        const char * env = getenv("SPECSTACK_VERIFY_KERNELS");
        disabled = env != NULL && strcmp(env, "0") == 0;
    }
    return disabled;
}

bool specstack_verify_takes(const struct ggml_tensor * weight) {
    if (sv_disabled() || sv_rows_for(weight->type) == NULL) {
        return false;
    }
    // float rows shorter than one of vec_dot's blocks are all tail: nothing for a block kernel to do
    const int step = sv_float_step(weight->type);
    return weight->ne[0] % ggml_blck_size(weight->type) == 0 && weight->ne[0] >= step
        && weight->ne[2] == 1 && weight->ne[3] == 1;
}

bool specstack_verify_rowwise_attention(void) {
    return !sv_disabled();
}

static bool sv_shape_fits(const struct ggml_tensor * dst) {
    const struct ggml_tensor * src0 = dst->src[0];
    const struct ggml_tensor * src1 = dst->src[1];
    return specstack_verify_takes(src0)
        && src1->type == GGML_TYPE_F32
        && src1->ne[1] >= 1 && (src1->ne[1] <= SV_MAX_ROWS || sv_float_step(src0->type) > 0)
        && src1->ne[2] == 1 && src1->ne[3] == 1
        && src1->nb[0] == sizeof(float)
        && src0->nb[0] == ggml_type_size(src0->type)
        && src0->nb[1] >= ggml_row_size(src0->type, src0->ne[0])
        && dst->type == GGML_TYPE_F32 && dst->nb[0] == sizeof(float)
        && dst->ne[0] == src0->ne[1] && dst->ne[1] == src1->ne[1];
}

// Quantize this thread's share of every activation row into the work buffer, as the stock path does.
static void sv_quantize(const struct ggml_compute_params * params, const struct ggml_tensor * src1,
                        enum ggml_type vec_dot_type, char * wdata, size_t a_stride) {
    ggml_from_float_t const from_float = ggml_get_type_traits_cpu(vec_dot_type)->from_float;
    const int64_t bs = ggml_blck_size(vec_dot_type);
    const int64_t ne10 = src1->ne[0];
    const int64_t start = (params->ith * ne10 / bs) / params->nth;
    const int64_t end = ((params->ith + 1) * ne10 / bs) / params->nth;
    for (int64_t i11 = 0; i11 < src1->ne[1]; ++i11) {
        const float * row = (const float *)((const char *) src1->data + i11 * src1->nb[1]) + start * bs;
        from_float(row, wdata + i11 * a_stride + start * ggml_type_size(vec_dot_type), (end - start) * bs);
    }
}

// The job common to every type: this thread's weight rows (threads split weight rows, never a row's reduction, so
// a row's result is the same at any thread count) against all n activation rows; false where the thread has none.
static bool sv_job_init(struct sv_job * job, const struct ggml_compute_params * params, const struct ggml_tensor * dst) {
    const struct ggml_tensor * src0 = dst->src[0];
    memset(job, 0, sizeof(*job));
    job->w = (const char *) src0->data;
    job->w_stride = src0->nb[1];
    job->n = (int) dst->src[1]->ne[1];
    job->dst = (float *) dst->data;
    job->d_stride = dst->nb[1] / sizeof(float);
    const int64_t nr = src0->ne[1];
    job->r0 = (nr * params->ith) / params->nth;
    job->r1 = (nr * (params->ith + 1)) / params->nth;
    return job->r0 < job->r1;
}

// F16, BF16 and F32 weights: each thread prepares the activations itself (no work buffer, no barrier). Any number
// of activation rows, SV_MAX_ROWS at a time: a prompt's calls then compute every row as decoding does too, so an F16
// model's KV is the same bits however its prompt was split (a cached prefix is reused whole: prompt_cache.reusable).
static void sv_float_mul_mat(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * src0 = dst->src[0];
    const struct ggml_tensor * src1 = dst->src[1];
    struct sv_job job;
    if (!sv_job_init(&job, params, dst)) {
        return;
    }
    job.ne = src0->ne[0];
    job.nb = (int)(job.ne / sv_float_step(src0->type));
    float * const dst0 = job.dst;
    for (int64_t c0 = 0; c0 < src1->ne[1]; c0 += SV_MAX_ROWS) {
        struct ggml_tensor part = *src1;  // these rows of the activations
        part.data = (char *) src1->data + (size_t) c0 * src1->nb[1];
        part.ne[1] = SV_MIN(SV_MAX_ROWS, src1->ne[1] - c0);
        job.n = (int) part.ne[1];
        job.dst = dst0 + (size_t) c0 * job.d_stride;
        sv_prepare_float(&job, &part, src0->type);
        sv_rows_for(src0->type)(&job);
    }
}

bool specstack_verify_mul_mat(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    if (params->use_ref || !sv_shape_fits(dst)) {
        return false;
    }
    const struct ggml_tensor * src0 = dst->src[0];
    const struct ggml_tensor * src1 = dst->src[1];
    if (sv_float_step(src0->type) > 0) {
        sv_float_mul_mat(params, dst);
        return true;
    }
    const enum ggml_type vec_dot_type = ggml_get_type_traits_cpu(src0->type)->vec_dot_type;
    const size_t a_stride = ggml_row_size(vec_dot_type, src1->ne[0]);
    const int n = (int) src1->ne[1];
    if (params->wsize < a_stride * n) {
        return false;  // a graph planned for another path: every thread sees the same and runs stock
    }
    char * wdata = (char *) params->wdata;

    sv_quantize(params, src1, vec_dot_type, wdata, a_stride);
    ggml_barrier(params->threadpool);

    struct sv_job job;
    if (!sv_job_init(&job, params, dst)) {
        return true;
    }
    job.nb = (int)(src0->ne[0] / ggml_blck_size(src0->type));
    job.act = wdata;
    job.a_stride = a_stride;
    if (vec_dot_type == GGML_TYPE_Q8_0) {
        sv_prepare_q8_0(&job);
    } else {
#if SV_K_ZMM
        if (n > 1) sv_prepare_q8_K_pairs(&job); else
#endif
        sv_prepare_q8_K(&job);
    }
    sv_rows_for(src0->type)(&job);
    return true;
}

#else  // no AVX2 + FMA + F16C: the stock paths run everything

bool specstack_verify_takes(const struct ggml_tensor * weight) {
    (void) weight;
    return false;
}

bool specstack_verify_mul_mat(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    (void) params;
    (void) dst;
    return false;
}

bool specstack_verify_rowwise_attention(void) {
    return false;
}

#endif
