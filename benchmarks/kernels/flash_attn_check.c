/* flash_attn_check: checks and times ggml's FLASH_ATTN_EXT on the CPU backend for the calls a speculative decoder
 * makes: n query rows at the end of a context `depth` positions deep, F32 queries, F16 K and V, a causal mask.
 *
 * Why: every row of a verification attends over the whole context, so what a row costs there grows with the
 * depth (docs/kernels.md), and a lossless decoder needs a row's attention to be the same bits whether it was
 * computed alone (a plain step) or beside the rows drafted after it (a verification).
 *
 * identity: the n-row call against each row computed alone, each alone over the KV length its own call would
 * have (the context padded to 256 cells, as llama.cpp pads it for flash attention), at each thread count, and
 * every output against a double-precision softmax attention over the same F16 K and V. bench: one call of n rows,
 * the fastest of as many as fit in --min-time. Linked by soname as mul_mat_bench is (LD_LIBRARY_PATH picks the
 * libggml-cpu that runs); every mode prints one JSON object on stdout, naming the library it ran.
 *
 *   flash_attn_check identity --dk 32 --heads 64 --kv-heads 32 --depth 900 --n 4 [--window 0] [--threads 1,2,3]
 *   flash_attn_check bench    --dk 32 --heads 64 --kv-heads 32 --depth 900 --n 1,2,4,8 [--threads 1]
 *                             [--min-time 0.2]
 *
 * --window W masks positions W or more behind each row (Gemma 3's sliding-window layers). bench's K and V were
 * just written, so they come from the caches where they fit: it times the kernel's arithmetic, not the memory.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

#define MAX_LIST 32
#define KV_PAD 256

typedef struct {
    const char * mode;
    int64_t dk, heads, kv_heads, depth, window;
    int ns[MAX_LIST], n_ns, threads[MAX_LIST], n_threads;
    double min_time;
    uint64_t seed;
} opts_t;

static void die(const char * msg, const char * arg) {
    fprintf(stderr, "flash_attn_check: %s%s\n", msg, arg ? arg : "");
    exit(2);
}

static int parse_list(const char * s, int * out) {
    int n = 0;
    for (const char * p = s; *p && n < MAX_LIST;) {
        char * end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 1) die("bad list: ", s);
        out[n++] = (int) v;
        p = *end == ',' ? end + 1 : end;
    }
    return n;
}

static opts_t parse_args(int argc, char ** argv) {
    opts_t o = {0};
    if (argc < 2) die("usage: flash_attn_check identity|bench [options] (see the source's header)", NULL);
    o.mode = argv[1];
    o.dk = 32, o.heads = 8, o.kv_heads = 8, o.depth = 256, o.min_time = 0.2, o.seed = 1;
    o.n_ns = parse_list("1", o.ns);
    o.n_threads = parse_list("1", o.threads);
    for (int i = 2; i < argc; i += 2) {
        const char * a = argv[i], * v = i + 1 < argc ? argv[i + 1] : NULL;
        if (v == NULL) die("missing value for ", a);
        if (!strcmp(a, "--dk")) o.dk = atoll(v);
        else if (!strcmp(a, "--heads")) o.heads = atoll(v);
        else if (!strcmp(a, "--kv-heads")) o.kv_heads = atoll(v);
        else if (!strcmp(a, "--depth")) o.depth = atoll(v);
        else if (!strcmp(a, "--window")) o.window = atoll(v);
        else if (!strcmp(a, "--n")) o.n_ns = parse_list(v, o.ns);
        else if (!strcmp(a, "--threads")) o.n_threads = parse_list(v, o.threads);
        else if (!strcmp(a, "--min-time")) o.min_time = atof(v);
        else if (!strcmp(a, "--seed")) o.seed = strtoull(v, NULL, 10);
        else die("unknown option ", a);
    }
    if (o.dk < 1 || o.heads < 1 || o.kv_heads < 1 || o.heads % o.kv_heads || o.depth < 0) {
        die("need --dk, --heads, --kv-heads >= 1 with heads a multiple of kv-heads, --depth >= 0", NULL);
    }
    return o;
}

static uint64_t rng_state;
static float frand(void) {  /* uniform in [-1, 1): xorshift64* */
    rng_state ^= rng_state >> 12, rng_state ^= rng_state << 25, rng_state ^= rng_state >> 27;
    return (float) ((rng_state * 2685821657736338717ull) >> 40) / (float) (1ull << 23) - 1.0f;
}

static int64_t pad_kv(int64_t n) { return (n + KV_PAD - 1) / KV_PAD * KV_PAD; }

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* The data of one attention: K and V for kv_len cells (F16, [dk, cell, kv_head]), n query rows (F32). */
typedef struct {
    int64_t dk, heads, kv_heads, kv_len, depth, window;
    ggml_fp16_t * k, * v;
    float * q;  /* [dk, row, head] */
    int n;
} data_t;

static bool masked(const data_t * d, int64_t row_pos, int64_t cell) {
    return cell > row_pos || (d->window > 0 && cell <= row_pos - d->window);
}

/* FLASH_ATTN_EXT of rows [r0, r0 + n) over the first kv cells; out is [dk, head, row] (ggml's permuted layout). */
static double attend(ggml_backend_t backend, const data_t * d, int r0, int n, int64_t kv, float * out) {
    struct ggml_init_params ip = {ggml_tensor_overhead() * 16 + ggml_graph_overhead() + 1024, NULL, true};
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, d->dk, n, d->heads, 1);
    struct ggml_tensor * k = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, d->dk, kv, d->kv_heads, 1);
    struct ggml_tensor * v = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, d->dk, kv, d->kv_heads, 1);
    struct ggml_tensor * m = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, kv, n, 1, 1);
    struct ggml_tensor * y = ggml_flash_attn_ext(ctx, q, k, v, m, 1.0f / sqrtf((float) d->dk), 0.0f, 0.0f);
    ggml_flash_attn_ext_set_prec(y, GGML_PREC_F32);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
    float * qs = malloc(sizeof(float) * d->dk * n * d->heads);
    for (int64_t h = 0; h < d->heads; h++)
        for (int r = 0; r < n; r++)
            memcpy(qs + (h * n + r) * d->dk, d->q + (h * d->n + r0 + r) * d->dk, sizeof(float) * d->dk);
    ggml_backend_tensor_set(q, qs, 0, ggml_nbytes(q));
    ggml_fp16_t * ks = malloc(ggml_nbytes(k)), * vs = malloc(ggml_nbytes(v)), * ms = malloc(ggml_nbytes(m));
    for (int64_t h = 0; h < d->kv_heads; h++) {
        memcpy(ks + h * kv * d->dk, d->k + h * d->kv_len * d->dk, sizeof(ggml_fp16_t) * kv * d->dk);
        memcpy(vs + h * kv * d->dk, d->v + h * d->kv_len * d->dk, sizeof(ggml_fp16_t) * kv * d->dk);
    }
    for (int r = 0; r < n; r++)
        for (int64_t c = 0; c < kv; c++)
            ms[r * kv + c] = ggml_fp32_to_fp16(masked(d, d->depth + r0 + r, c) ? -INFINITY : 0.0f);
    ggml_backend_tensor_set(k, ks, 0, ggml_nbytes(k));
    ggml_backend_tensor_set(v, vs, 0, ggml_nbytes(v));
    ggml_backend_tensor_set(m, ms, 0, ggml_nbytes(m));
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    ggml_gallocr_t alloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend));
    if (!ggml_gallocr_alloc_graph(alloc, gf)) die("graph allocation failed", NULL);
    const double t0 = now_s();
    if (ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) die("graph compute failed", NULL);
    const double spent = now_s() - t0;
    if (out) ggml_backend_tensor_get(y, out, 0, ggml_nbytes(y));
    ggml_gallocr_free(alloc);
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    free(qs), free(ks), free(vs), free(ms);
    return spent;
}

static data_t make_data(const opts_t * o, int n) {
    data_t d = {o->dk, o->heads, o->kv_heads, pad_kv(o->depth + n), o->depth, o->window, NULL, NULL, NULL, n};
    rng_state = o->seed * 0x9E3779B97F4A7C15ull + 1;
    d.k = malloc(sizeof(ggml_fp16_t) * d.kv_len * d.dk * d.kv_heads);
    d.v = malloc(sizeof(ggml_fp16_t) * d.kv_len * d.dk * d.kv_heads);
    d.q = malloc(sizeof(float) * d.dk * n * d.heads);
    for (int64_t i = 0; i < d.kv_len * d.dk * d.kv_heads; i++) {
        d.k[i] = ggml_fp32_to_fp16(frand());
        d.v[i] = ggml_fp32_to_fp16(frand());
    }
    for (int64_t i = 0; i < d.dk * n * d.heads; i++) d.q[i] = 3.0f * frand();  /* peaked enough to matter */
    return d;
}

static void print_lib(void) {
    Dl_info info;
    char path[PATH_MAX] = "?";
    if (dladdr((void *) ggml_backend_cpu_init, &info) && info.dli_fname) {
        if (!realpath(info.dli_fname, path)) snprintf(path, sizeof path, "%s", info.dli_fname);
    }
    printf("\"lib\": \"%s\"", path);
}

/* rows differing and the largest difference between two outputs of n rows ([dk, head, row]) */
static void compare(const float * a, const float * b, int64_t per_row, int n, const char * name, bool last) {
    int differ = 0;
    double worst = 0;
    for (int r = 0; r < n; r++) {
        if (memcmp(a + r * per_row, b + r * per_row, sizeof(float) * per_row)) differ++;
        for (int64_t i = 0; i < per_row; i++) worst = fmax(worst, fabs((double) a[r * per_row + i] - b[r * per_row + i]));
    }
    printf("\"%s\": {\"identical\": %s, \"rows_differing\": %d, \"max_abs_diff\": %.9g}%s", name,
           differ ? "false" : "true", differ, worst, last ? "" : ", ");
}

static void identity(const opts_t * o) {
    const int n = o->ns[0];
    data_t d = make_data(o, n);
    const int64_t per_row = d.dk * d.heads;
    float * batch = malloc(sizeof(float) * per_row * n), * single = malloc(sizeof(float) * per_row * n);
    float * first = malloc(sizeof(float) * per_row * n);
    /* the double-precision reference, over the same F16 K and V */
    double ref_diff = 0, ref_max = 0;
    ggml_backend_t backend = ggml_backend_cpu_init();
    printf("{");
    print_lib();
    printf(", \"n\": %d, \"depth\": %lld, \"kv\": %lld, \"checks\": [", n, (long long) o->depth, (long long) d.kv_len);
    for (int t = 0; t < o->n_threads; t++) {
        ggml_backend_cpu_set_n_threads(backend, o->threads[t]);
        attend(backend, &d, 0, n, d.kv_len, batch);
        for (int r = 0; r < n; r++) attend(backend, &d, r, 1, pad_kv(o->depth + r + 1), single + r * per_row);
        if (t == 0) memcpy(first, batch, sizeof(float) * per_row * n);
        printf("%s{\"threads\": %d, ", t ? ", " : "", o->threads[t]);
        compare(batch, single, per_row, n, "batch_vs_single", false);
        compare(batch, first, per_row, n, "batch_vs_first_threads", true);
        printf("}");
    }
    double * w = malloc(sizeof(double) * d.kv_len);
    for (int r = 0; r < n; r++) {
        const int64_t pos = o->depth + r;
        for (int64_t h = 0; h < d.heads; h++) {
            const int64_t kh = h / (d.heads / d.kv_heads);
            const float * qr = d.q + (h * n + r) * d.dk;
            double top = -INFINITY, sum = 0;
            for (int64_t c = 0; c < d.kv_len; c++) {
                w[c] = -INFINITY;
                if (masked(&d, pos, c)) continue;
                double s = 0;
                for (int64_t i = 0; i < d.dk; i++) s += (double) qr[i] * ggml_fp16_to_fp32(d.k[(kh * d.kv_len + c) * d.dk + i]);
                w[c] = s / sqrt((double) d.dk);
                top = fmax(top, w[c]);
            }
            for (int64_t c = 0; c < d.kv_len; c++) sum += w[c] == -INFINITY ? 0 : (w[c] = exp(w[c] - top));
            for (int64_t i = 0; i < d.dk; i++) {
                double acc = 0;
                for (int64_t c = 0; c < d.kv_len; c++)
                    if (w[c] != -INFINITY) acc += w[c] * ggml_fp16_to_fp32(d.v[(kh * d.kv_len + c) * d.dk + i]);
                const double want = acc / sum, got = first[(r * d.heads + h) * d.dk + i];
                ref_diff = fmax(ref_diff, fabs(want - got));
                ref_max = fmax(ref_max, fabs(want));
            }
        }
    }
    printf("], \"ref_max_abs_diff\": %.9g, \"ref_max_abs\": %.9g}\n", ref_diff, ref_max);
    ggml_backend_free(backend);
}

static void bench(const opts_t * o) {
    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(backend, o->threads[0]);
    printf("{");
    print_lib();
    printf(", \"depth\": %lld, \"threads\": %d, \"ms\": {", (long long) o->depth, o->threads[0]);
    for (int i = 0; i < o->n_ns; i++) {
        const int n = o->ns[i];
        data_t d = make_data(o, n);
        double best = INFINITY, spent = 0;
        attend(backend, &d, 0, n, d.kv_len, NULL);  /* first call: untimed */
        for (int c = 0; spent < o->min_time || c < 3; c++) {
            const double t = attend(backend, &d, 0, n, d.kv_len, NULL);
            best = fmin(best, t);
            spent += t;
        }
        printf("%s\"%d\": %.6f", i ? ", " : "", n, 1e3 * best);
        free(d.k), free(d.v), free(d.q);
    }
    printf("}}\n");
    ggml_backend_free(backend);
}

int main(int argc, char ** argv) {
    const opts_t o = parse_args(argc, argv);
    if (!strcmp(o.mode, "identity")) identity(&o);
    else if (!strcmp(o.mode, "bench")) bench(&o);
    else die("unknown mode ", o.mode);
    return 0;
}
