/* specstack's roofline probe: what a core (and T threads) can stream from memory and how many int8
 * multiply-adds it can issue, the two ceilings a quantized matmul kernel lives under.
 *
 *   cc -O3 -march=native -pthread roofline.c -o roofline && ./roofline 1 2
 *
 * Prints one JSON object: the int8 instruction it timed and, per thread count given, the streaming read
 * bandwidth (GB/s) and the int8 multiply-add peak (GMAC/s). specstack/host/roofline.py compiles and runs it
 * (`specstack doctor`); benchmarks/kernel_roofline.py puts its numbers beside the kernels'.
 *
 * The int8 instruction is the best the compiler targets (-march=native decides): AVX-512 VNNI `vpdpbusd`
 * on zmm, else AVX-VNNI `vpdpbusd` on ymm, else AVX2's `vpmaddubsw` + `vpmaddwd` pair (what ggml's AVX2
 * kernels use), else NEON `sdot`. -DROOFLINE_ISA_AVX2 forces the AVX2 pair on a VNNI machine, so that path
 * can be tested there. Each peak loop runs 12 independent accumulators, enough to hide the instruction's
 * latency on current cores; the multiply-adds are counted as the instruction does them (64 per zmm
 * vpdpbusd, 32 per ymm one and per AVX2 pair, 16 per sdot).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#if defined(ROOFLINE_ISA_AVX2) && defined(__AVX2__)
#define MAC_AVX2 1
#elif defined(__AVX512F__) && defined(__AVX512VNNI__)
#define MAC_AVX512_VNNI 1
#elif defined(__AVXVNNI__)
#define MAC_AVX_VNNI 1
#elif defined(__AVX2__)
#define MAC_AVX2 1
#elif defined(__ARM_FEATURE_DOTPROD)
#define MAC_NEON_DOT 1
#endif

#define ACCS 12
#define MAX_THREADS 256

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* ---- streaming read --------------------------------------------------------------------------------- */

/* Sums every 8 bytes of [p, p + n): the sum is returned, so no load can be dropped. n is a multiple of 256. */
static uint64_t read_all(const uint8_t * p, size_t n) {
#if defined(__AVX512F__)
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < n; i += 256) {
        a0 = _mm512_add_epi64(a0, _mm512_load_si512(p + i));
        a1 = _mm512_add_epi64(a1, _mm512_load_si512(p + i + 64));
        a2 = _mm512_add_epi64(a2, _mm512_load_si512(p + i + 128));
        a3 = _mm512_add_epi64(a3, _mm512_load_si512(p + i + 192));
    }
    return _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
#elif defined(__AVX2__)
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < n; i += 128) {
        a0 = _mm256_add_epi64(a0, _mm256_load_si256((const __m256i *) (p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_load_si256((const __m256i *) (p + i + 32)));
        a2 = _mm256_add_epi64(a2, _mm256_load_si256((const __m256i *) (p + i + 64)));
        a3 = _mm256_add_epi64(a3, _mm256_load_si256((const __m256i *) (p + i + 96)));
    }
    uint64_t out[4];
    _mm256_storeu_si256((__m256i *) out, _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
    return out[0] + out[1] + out[2] + out[3];
#else
    const uint64_t * w = (const uint64_t *) p;
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    for (size_t i = 0; i < n / 8; i += 4) {
        a0 += w[i];
        a1 += w[i + 1];
        a2 += w[i + 2];
        a3 += w[i + 3];
    }
    return a0 + a1 + a2 + a3;
#endif
}

/* ---- int8 multiply-add peak ----------------------------------------------------------------------- */

static const char * mac_isa(void) {
#if defined(MAC_AVX512_VNNI)
    return "AVX-512 VNNI";
#elif defined(MAC_AVX_VNNI)
    return "AVX-VNNI";
#elif defined(MAC_AVX2)
    return "AVX2";
#elif defined(MAC_NEON_DOT)
    return "NEON dotprod";
#else
    return "none";
#endif
}

static const char * mac_instruction(void) {
#if defined(MAC_AVX512_VNNI)
    return "vpdpbusd zmm";
#elif defined(MAC_AVX_VNNI)
    return "vpdpbusd ymm";
#elif defined(MAC_AVX2)
    return "vpmaddubsw+vpmaddwd ymm";
#elif defined(MAC_NEON_DOT)
    return "sdot";
#else
    return "";
#endif
}

/* Runs `iters` rounds of ACCS independent int8 multiply-adds; returns the multiply-adds done (0: no int8 SIMD). */
static double mac_loop(long iters) {
#if defined(MAC_AVX512_VNNI)
    __m512i a = _mm512_set1_epi8(1), w = _mm512_set1_epi8(2), c[ACCS];
    for (int j = 0; j < ACCS; j++) c[j] = _mm512_setzero_si512();
    for (long i = 0; i < iters; i++) {
#pragma GCC unroll 12
        for (int j = 0; j < ACCS; j++) c[j] = _mm512_dpbusd_epi32(c[j], a, w);
        __asm__ volatile("" : "+v"(c[0]), "+v"(c[1]), "+v"(c[2]), "+v"(c[3]), "+v"(c[4]), "+v"(c[5]),
                         "+v"(c[6]), "+v"(c[7]), "+v"(c[8]), "+v"(c[9]), "+v"(c[10]), "+v"(c[11]));
    }
    return (double) iters * ACCS * 64;
#elif defined(MAC_AVX_VNNI)
    __m256i a = _mm256_set1_epi8(1), w = _mm256_set1_epi8(2), c[ACCS];
    for (int j = 0; j < ACCS; j++) c[j] = _mm256_setzero_si256();
    for (long i = 0; i < iters; i++) {
#pragma GCC unroll 12
        for (int j = 0; j < ACCS; j++) c[j] = _mm256_dpbusd_avx_epi32(c[j], a, w);
        __asm__ volatile("" : "+x"(c[0]), "+x"(c[1]), "+x"(c[2]), "+x"(c[3]), "+x"(c[4]), "+x"(c[5]),
                         "+x"(c[6]), "+x"(c[7]), "+x"(c[8]), "+x"(c[9]), "+x"(c[10]), "+x"(c[11]));
    }
    return (double) iters * ACCS * 32;
#elif defined(MAC_AVX2)
    /* a and w are loop-invariant, so in C the compiler would compute vpmaddubsw once: the pairs are written in
     * asm, six chains a statement, two statements a round (ymm0-15 without AVX-512: 6 temporaries, 6
     * accumulators and 3 inputs). */
    __m256i a = _mm256_set1_epi8(1), w = _mm256_set1_epi8(2), ones = _mm256_set1_epi16(1);
    __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0;
    __m256i t0, t1, t2, t3, t4, t5;
#define PAIR(t, c) "vpmaddubsw %[w], %[a], %[" #t "]\n\tvpmaddwd %[ones], %[" #t "], %[" #t "]\n\t" \
                   "vpaddd %[" #t "], %[" #c "], %[" #c "]\n\t"
    for (long i = 0; i < iters; i++) {
        for (int h = 0; h < 2; h++) {
            __asm__ volatile(PAIR(t0, c0) PAIR(t1, c1) PAIR(t2, c2) PAIR(t3, c3) PAIR(t4, c4) PAIR(t5, c5)
                             : [c0] "+x"(c0), [c1] "+x"(c1), [c2] "+x"(c2), [c3] "+x"(c3), [c4] "+x"(c4),
                               [c5] "+x"(c5), [t0] "=&x"(t0), [t1] "=&x"(t1), [t2] "=&x"(t2), [t3] "=&x"(t3),
                               [t4] "=&x"(t4), [t5] "=&x"(t5)
                             : [a] "x"(a), [w] "x"(w), [ones] "x"(ones));
        }
    }
#undef PAIR
    return (double) iters * ACCS * 32;
#elif defined(MAC_NEON_DOT)
    int8x16_t a = vdupq_n_s8(1), w = vdupq_n_s8(2);
    int32x4_t c[ACCS];
    for (int j = 0; j < ACCS; j++) c[j] = vdupq_n_s32(0);
    for (long i = 0; i < iters; i++) {
        for (int j = 0; j < ACCS; j++) c[j] = vdotq_s32(c[j], a, w);
        __asm__ volatile("" : "+w"(c[0]), "+w"(c[1]), "+w"(c[2]), "+w"(c[3]), "+w"(c[4]), "+w"(c[5]),
                         "+w"(c[6]), "+w"(c[7]), "+w"(c[8]), "+w"(c[9]), "+w"(c[10]), "+w"(c[11]));
    }
    return (double) iters * ACCS * 16;
#else
    (void) iters;
    return 0.0;
#endif
}

/* ---- threads -------------------------------------------------------------------------------------- */

typedef struct {
    pthread_barrier_t * start;
    const uint8_t *     buf;   /* this thread's slice, for the read test */
    size_t              bytes;
    long                iters; /* for the multiply-add test */
    double              work;  /* bytes read or multiply-adds done */
    double              t0, t1; /* when this thread started and ended its work */
    uint64_t            sink;
} job_t;

static void * run_read(void * arg) {
    job_t * j = arg;
    pthread_barrier_wait(j->start);
    j->t0 = now();
    j->sink = read_all(j->buf, j->bytes);
    j->work = (double) j->bytes;
    j->t1 = now();
    return NULL;
}

static void * run_mac(void * arg) {
    job_t * j = arg;
    pthread_barrier_wait(j->start);
    j->t0 = now();
    j->work = mac_loop(j->iters);
    j->t1 = now();
    return NULL;
}

/* Runs fn on T threads at once; returns the work they did a second, from the first thread's start to the last
 * one's end. The threads time themselves: with as many threads as cores, the caller may get a core back only
 * after they are done. */
static double rate(int T, void * (*fn)(void *), job_t * jobs) {
    pthread_t th[MAX_THREADS];
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, (unsigned) T + 1);
    for (int i = 0; i < T; i++) {
        jobs[i].start = &start;
        pthread_create(&th[i], NULL, fn, &jobs[i]);
    }
    pthread_barrier_wait(&start);
    double t0 = 0, t1 = 0, work = 0;
    for (int i = 0; i < T; i++) {
        pthread_join(th[i], NULL);
        work += jobs[i].work;
        t0 = (i == 0 || jobs[i].t0 < t0) ? jobs[i].t0 : t0;
        t1 = jobs[i].t1 > t1 ? jobs[i].t1 : t1;
    }
    pthread_barrier_destroy(&start);
    return work / (t1 - t0);
}

/* Each thread writes its own slice first, so its pages sit on its node. */
static void * touch(void * arg) {
    job_t * j = arg;
    pthread_barrier_wait(j->start);
    memset((void *) j->buf, 1, j->bytes);
    j->t0 = j->t1 = now();
    j->work = 0;
    return NULL;
}

static double best_read(int T, uint8_t * buf, size_t bytes, int reps) {
    job_t jobs[MAX_THREADS];
    size_t slice = (bytes / (size_t) T) & ~(size_t) 255;
    for (int i = 0; i < T; i++) {
        memset(&jobs[i], 0, sizeof jobs[i]);
        jobs[i].buf = buf + (size_t) i * slice;
        jobs[i].bytes = slice;
    }
    rate(T, touch, jobs);
    double best = 0;
    for (int r = 0; r < reps; r++) {
        double x = rate(T, run_read, jobs);
        if (x > best) best = x;
    }
    return best;
}

static double best_mac(int T, double seconds, int reps) {
    job_t jobs[MAX_THREADS];
    long iters = 1L << 16;
    /* size the loop so that one repeat runs about `seconds` */
    double t0 = now();
    double done = mac_loop(iters);
    if (done == 0) return 0;
    double t = now() - t0;
    iters = (long) (iters * seconds / (t > 1e-6 ? t : 1e-6));
    if (iters < 1) iters = 1;
    for (int i = 0; i < T; i++) {
        memset(&jobs[i], 0, sizeof jobs[i]);
        jobs[i].iters = iters;
    }
    double best = 0;
    for (int r = 0; r < reps; r++) {
        double x = rate(T, run_mac, jobs);
        if (x > best) best = x;
    }
    return best;
}

int main(int argc, char ** argv) {
    size_t mib = 256;
    int threads[64], nt = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "-m") == 0 && i + 1 < argc) {
            mib = (size_t) atol(argv[++i]);
        } else if (nt < 64) {
            int t = atoi(argv[i]);
            if (t < 1 || t > MAX_THREADS) {
                fprintf(stderr, "roofline: thread counts are 1-%d, not %s\n", MAX_THREADS, argv[i]);
                return 2;
            }
            threads[nt++] = t;
        }
    }
    if (nt == 0) threads[nt++] = 1;
    size_t bytes = mib << 20;
    uint8_t * buf = aligned_alloc(64, bytes);
    if (buf == NULL) {
        fprintf(stderr, "roofline: cannot allocate %zu MiB\n", mib);
        return 1;
    }
    printf("{\"isa\": \"%s\", \"instruction\": \"%s\", \"buffer_mib\": %zu, \"results\": [", mac_isa(),
           mac_instruction(), mib);
    for (int i = 0; i < nt; i++) {
        double bw = best_read(threads[i], buf, bytes, 5);
        double mac = best_mac(threads[i], 0.04, 3);
        printf("%s{\"threads\": %d, \"read_gbps\": %.2f, \"int8_gmacs\": %.2f}", i ? ", " : "", threads[i],
               bw / 1e9, mac / 1e9);
    }
    printf("]}\n");
    free(buf);
    return 0;
}
