/* mul_mat_bench: times ggml's MUL_MAT on the CPU backend for one weight shape, and checks whether its output
 * rows are bit-identical whatever the number of activation rows a call carries.
 *
 * Why: a verification call of n rows is n MUL_MATs' worth of weights read once; what it costs next to one row
 * is the kernels' doing (docs/kernels.md). And a lossless speculative decoder needs the logits of a row to be
 * the same bits whether the row was verified alone or with others, which stock ggml does not promise (tinyBLAS
 * takes Q8_0 from 2 rows and sums in another order).
 *
 * Built against a vendored llama.cpp tree's ggml/include and linked by soname to libggml-base.so.0 and
 * libggml-cpu.so.0: LD_LIBRARY_PATH decides which libggml-cpu runs (benchmarks/kernel_roofline.py points it
 * at a folder of links per library). Every mode prints one JSON object on stdout, naming the library it ran.
 *
 *   mul_mat_bench info
 *   mul_mat_bench bench    --type q4_K --k 2048 --m 640 --n 1,2,4,8 [--threads 1] [--buft plain|extra]
 *                          [--working-set-mib 256] [--min-time 0.1] [--min-calls 3] [--distinct-rows 256]
 *   mul_mat_bench identity --type q8_0 --k 640 --m 256 --n 4 [--threads 1,2,3] [--buft plain|extra]
 *
 * --buft plain puts the weights in a plain CPU buffer; extra offers them first to the CPU device's extra buffer
 * types (ggml_backend_dev_get_extra_bufts: repack, AMX...), each taking them where its supports_op says so, as
 * llama.cpp's model loader does by default. Weights are random floats quantized with ggml_quantize_chunk;
 * bench quantizes --distinct-rows rows and repeats them (the kernels' speed does not depend on the values), and
 * cycles through enough copies of the matrix to span --working-set-mib, so that every call reads its weights
 * from memory as a model's forward pass does, not from a cache that one small matrix would fit.
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
#include <strings.h>
#include <time.h>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

#define MAX_LIST 64
#define MAX_COPIES 4096
#define MAX_CALLS 5000

typedef struct {
    const char *   mode;
    enum ggml_type type;
    int64_t        k, m;
    int            ns[MAX_LIST], n_ns;
    int            threads[MAX_LIST], n_threads;
    bool           extra;
    double         ws_mib, min_time;
    int            min_calls;
    int64_t        distinct_rows;
    uint64_t       seed;
} opts_t;

typedef struct {
    ggml_backend_t             backend;
    ggml_backend_buffer_type_t wbuft;
    struct ggml_context *      wctx, *xctx;
    ggml_backend_buffer_t      wbuf, xbuf, obuf;
    struct ggml_tensor *       w[MAX_COPIES];
    struct ggml_tensor *       x;
    int                        copies, nmax;
    int64_t                    k, m;
    enum ggml_type             type;
    void *                     wq;  /* the quantized weights in ggml's plain layout, for vec_dot */
    size_t                     wbytes;
} rig_t;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void die(const char * msg, const char * arg) {
    fprintf(stderr, "mul_mat_bench: %s%s\n", msg, arg ? arg : "");
    exit(2);
}

/* ---- arguments --------------------------------------------------------------------------------------- */

static enum ggml_type parse_type(const char * s) {
    for (int t = 0; t < GGML_TYPE_COUNT; t++) {
        const char * name = ggml_type_name((enum ggml_type) t);
        if (name && ggml_type_size((enum ggml_type) t) > 0 && strcasecmp(name, s) == 0) {
            return (enum ggml_type) t;
        }
    }
    die("unknown ggml type: ", s);
    return GGML_TYPE_COUNT;
}

static int parse_list(const char * s, int * out) {
    int n = 0;
    char * buf = strdup(s);
    for (char * tok = strtok(buf, ","); tok && n < MAX_LIST; tok = strtok(NULL, ",")) {
        out[n] = atoi(tok);
        if (out[n] < 1) die("list items are positive integers: ", s);
        n++;
    }
    free(buf);
    return n;
}

static opts_t parse_args(int argc, char ** argv) {
    opts_t o = { 0 };
    if (argc < 2) die("usage: mul_mat_bench info|bench|identity [options] (see the source's header)", NULL);
    o.mode = argv[1];
    o.type = GGML_TYPE_Q4_K;
    o.k = 2048, o.m = 640;
    o.ns[0] = 1, o.n_ns = 1;
    o.threads[0] = 1, o.n_threads = 1;
    o.ws_mib = 256, o.min_time = 0.1, o.min_calls = 3, o.distinct_rows = 256, o.seed = 1234;
    for (int i = 2; i < argc; i++) {
        const char * a = argv[i];
        const char * v = i + 1 < argc ? argv[i + 1] : NULL;
        if (v == NULL) die("missing value for ", a);
        if (!strcmp(a, "--type")) o.type = parse_type(v);
        else if (!strcmp(a, "--k")) o.k = atoll(v);
        else if (!strcmp(a, "--m")) o.m = atoll(v);
        else if (!strcmp(a, "--n")) o.n_ns = parse_list(v, o.ns);
        else if (!strcmp(a, "--threads")) o.n_threads = parse_list(v, o.threads);
        else if (!strcmp(a, "--buft")) o.extra = !strcmp(v, "extra");
        else if (!strcmp(a, "--working-set-mib")) o.ws_mib = atof(v);
        else if (!strcmp(a, "--min-time")) o.min_time = atof(v);
        else if (!strcmp(a, "--min-calls")) o.min_calls = atoi(v);
        else if (!strcmp(a, "--distinct-rows")) o.distinct_rows = atoll(v);
        else if (!strcmp(a, "--seed")) o.seed = strtoull(v, NULL, 10);
        else die("unknown option ", a);
        i++;
    }
    if (o.k % ggml_blck_size(o.type) != 0) die("--k must be a multiple of the type's block size", NULL);
    return o;
}

/* ---- data -------------------------------------------------------------------------------------------- */

static uint64_t rng_next(uint64_t * s) { /* splitmix64 */
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void fill_uniform(float * f, size_t n, uint64_t * s) {
    for (size_t i = 0; i < n; i++) f[i] = (float) ((rng_next(s) >> 11) * 0x1.0p-53 * 2.0 - 1.0);
}

/* The weights in the type's plain layout: `distinct` rows of random floats quantized, repeated to m rows. */
static void * quantized_weights(enum ggml_type type, int64_t k, int64_t m, int64_t distinct, uint64_t seed,
                                size_t * bytes) {
    if (distinct <= 0 || distinct > m) distinct = m;
    const size_t row = ggml_row_size(type, k);
    *bytes = row * (size_t) m;
    char * q = malloc(*bytes);
    float * f = malloc(sizeof(float) * (size_t) (k * distinct));
    if (!q || !f) die("out of memory for the weights", NULL);
    fill_uniform(f, (size_t) (k * distinct), &seed);
    ggml_quantize_chunk(type, f, q, 0, distinct, k, NULL);
    for (int64_t r = distinct; r < m; r++) memcpy(q + (size_t) r * row, q + (size_t) (r % distinct) * row, row);
    free(f);
    return q;
}

/* ---- where the weights go ---------------------------------------------------------------------------- */

/* Whether `buft` takes a (type, k x m) weight for MUL_MAT: the question llama.cpp's loader asks
 * (weight_buft_supported), with the weight in a zero-sized buffer of that type. */
static bool buft_takes(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft, enum ggml_type type, int64_t k,
                       int64_t m) {
    struct ggml_init_params p = { 4 * ggml_tensor_overhead(), NULL, true };
    struct ggml_context * ctx = ggml_init(p);
    struct ggml_tensor * w = ggml_new_tensor_2d(ctx, type, k, m);
    struct ggml_tensor * b = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, 512);
    struct ggml_tensor * op = ggml_mul_mat(ctx, w, b);
    ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(buft, 0);
    w->buffer = buf;
    bool ok = ggml_backend_dev_supports_op(dev, op);
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    return ok;
}

static ggml_backend_buffer_type_t weight_buft(ggml_backend_dev_t dev, const opts_t * o) {
    if (o->extra) {
        ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
        ggml_backend_dev_get_extra_bufts_t get =
            (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
        for (ggml_backend_buffer_type_t * b = get ? get(dev) : NULL; b && *b; b++) {
            if (buft_takes(dev, *b, o->type, o->k, o->m)) return *b;
        }
    }
    return ggml_backend_dev_buffer_type(dev);
}

/* ---- the rig: backend, weights, activations, output ---------------------------------------------------- */

static void rig_init(rig_t * r, const opts_t * o, int copies, int nmax, int64_t distinct) {
    memset(r, 0, sizeof *r);
    r->k = o->k, r->m = o->m, r->type = o->type, r->copies = copies, r->nmax = nmax;
    r->backend = ggml_backend_cpu_init();
    ggml_backend_dev_t dev = ggml_backend_get_device(r->backend);
    r->wbuft = weight_buft(dev, o);
    r->wq = quantized_weights(o->type, o->k, o->m, distinct, o->seed, &r->wbytes);

    struct ggml_init_params wp = { (size_t) (copies + 1) * ggml_tensor_overhead(), NULL, true };
    r->wctx = ggml_init(wp);
    for (int c = 0; c < copies; c++) r->w[c] = ggml_new_tensor_2d(r->wctx, o->type, o->k, o->m);
    r->wbuf = ggml_backend_alloc_ctx_tensors_from_buft(r->wctx, r->wbuft);
    if (!r->wbuf) die("cannot allocate the weights", NULL);
    for (int c = 0; c < copies; c++) ggml_backend_tensor_set(r->w[c], r->wq, 0, r->wbytes); /* repacks if extra */

    struct ggml_init_params xp = { 2 * ggml_tensor_overhead(), NULL, true };
    r->xctx = ggml_init(xp);
    r->x = ggml_new_tensor_2d(r->xctx, GGML_TYPE_F32, o->k, nmax);
    ggml_backend_buffer_type_t cpu = ggml_backend_dev_buffer_type(dev);
    r->xbuf = ggml_backend_alloc_ctx_tensors_from_buft(r->xctx, cpu);
    size_t xn = (size_t) (o->k * nmax);
    float * xf = malloc(sizeof(float) * xn);
    uint64_t seed = o->seed ^ 0x5eedull;
    fill_uniform(xf, xn, &seed);
    ggml_backend_tensor_set(r->x, xf, 0, sizeof(float) * xn);
    free(xf);
    r->obuf = ggml_backend_buft_alloc_buffer(cpu, sizeof(float) * (size_t) (o->m * nmax) + 256);
}

static void rig_free(rig_t * r) {
    ggml_backend_buffer_free(r->obuf);
    ggml_backend_buffer_free(r->xbuf);
    ggml_backend_buffer_free(r->wbuf);
    ggml_free(r->xctx);
    ggml_free(r->wctx);
    ggml_backend_free(r->backend);
    free(r->wq);
}

static bool rig_repacked(const rig_t * r) { return r->w[0]->extra != NULL; }

/* y = MUL_MAT(w[copy], activation rows row0 .. row0+n-1), into the output buffer ([n][m] floats);
 * returns the seconds ggml_backend_graph_compute took (the graph is built outside the timing). */
static double mul_mat(rig_t * r, int copy, int row0, int n) {
    static char mem[64 * 1024];
    struct ggml_init_params p = { sizeof mem, mem, true };
    struct ggml_context * ctx = ggml_init(p);
    struct ggml_tensor * xv = ggml_view_2d(ctx, r->x, r->k, n, r->x->nb[1], (size_t) row0 * r->x->nb[1]);
    ggml_backend_view_init(xv);
    struct ggml_tensor * y = ggml_mul_mat(ctx, r->w[copy], xv);
    ggml_backend_tensor_alloc(r->obuf, y, ggml_backend_buffer_get_base(r->obuf));
    struct ggml_cgraph * gf = ggml_new_graph_custom(ctx, 8, false);
    ggml_build_forward_expand(gf, y);
    double t0 = now();
    enum ggml_status st = ggml_backend_graph_compute(r->backend, gf);
    double t = now() - t0;
    ggml_free(ctx);
    if (st != GGML_STATUS_SUCCESS) die("ggml_backend_graph_compute failed", NULL);
    return t;
}

static const float * output(const rig_t * r) { return ggml_backend_buffer_get_base(r->obuf); }

/* ---- reporting what ran -------------------------------------------------------------------------------- */

static void print_lib(void) {
    Dl_info info;
    char path[PATH_MAX] = "?", base[PATH_MAX] = "?";
    if (dladdr((void *) ggml_backend_cpu_init, &info) && info.dli_fname) {
        if (!realpath(info.dli_fname, path)) snprintf(path, sizeof path, "%s", info.dli_fname);
    }
    if (dladdr((void *) ggml_init, &info) && info.dli_fname) {
        if (!realpath(info.dli_fname, base)) snprintf(base, sizeof base, "%s", info.dli_fname);
    }
    const char * force = getenv("GGML_CPU_TILED_MM_FORCE");
    const char * tiled = getenv("GGML_CPU_TILED_MM");
    printf("\"lib\": \"%s\", \"base\": \"%s\", \"llamafile\": %s, \"avx512_vnni\": %s, \"avx_vnni\": %s, "
           "\"tiled_mm\": \"%s\", \"tiled_mm_force\": \"%s\"",
           path, base, ggml_cpu_has_llamafile() ? "true" : "false", ggml_cpu_has_avx512_vnni() ? "true" : "false",
           ggml_cpu_has_avx_vnni() ? "true" : "false", tiled ? tiled : "", force ? force : "");
}

static void print_shape(const rig_t * r, const opts_t * o) {
    printf(", \"type\": \"%s\", \"k\": %lld, \"m\": %lld, \"buft\": \"%s\", \"weight_buft\": \"%s\", "
           "\"repacked\": %s, \"weight_bytes\": %zu",
           ggml_type_name(o->type), (long long) o->k, (long long) o->m, o->extra ? "extra" : "plain",
           ggml_backend_buft_name(r->wbuft), rig_repacked(r) ? "true" : "false", r->wbytes);
}

/* ---- modes ------------------------------------------------------------------------------------------- */

static int run_info(void) {
    ggml_backend_t be = ggml_backend_cpu_init();
    ggml_backend_dev_t dev = ggml_backend_get_device(be);
    ggml_backend_dev_get_extra_bufts_t get = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(
        ggml_backend_dev_backend_reg(dev), "ggml_backend_dev_get_extra_bufts");
    printf("{");
    print_lib();
    printf(", \"extra_bufts\": [");
    int i = 0;
    for (ggml_backend_buffer_type_t * b = get ? get(dev) : NULL; b && *b; b++, i++) {
        printf("%s\"%s\"", i ? ", " : "", ggml_backend_buft_name(*b));
    }
    printf("]}\n");
    ggml_backend_free(be);
    return 0;
}

static int run_bench(const opts_t * o) {
    int nmax = 1;
    for (int i = 0; i < o->n_ns; i++) nmax = o->ns[i] > nmax ? o->ns[i] : nmax;
    const double wbytes = (double) ggml_row_size(o->type, o->k) * (double) o->m;
    int copies = (int) ceil(o->ws_mib * 1048576.0 / wbytes);
    copies = copies < 1 ? 1 : copies > MAX_COPIES ? MAX_COPIES : copies;
    rig_t r;
    rig_init(&r, o, copies, nmax, o->distinct_rows);
    ggml_backend_cpu_set_n_threads(r.backend, o->threads[0]);
    printf("{");
    print_lib();
    print_shape(&r, o);
    printf(", \"threads\": %d, \"copies\": %d, \"results\": [", o->threads[0], copies);
    int c = 0;
    for (int i = 0; i < o->n_ns; i++) {
        const int n = o->ns[i];
        for (int w = 0; w < 2; w++) mul_mat(&r, c++ % copies, 0, n); /* warm: threads, work buffer */
        double best = INFINITY, total = 0;
        int calls = 0;
        while ((calls < o->min_calls || total < o->min_time) && calls < MAX_CALLS) {
            double t = mul_mat(&r, c++ % copies, 0, n);
            best = t < best ? t : best;
            total += t;
            calls++;
        }
        printf("%s{\"n\": %d, \"ms\": %.6f, \"mean_ms\": %.6f, \"calls\": %d}", i ? ", " : "", n, best * 1e3,
               total / calls * 1e3, calls);
        fflush(stdout);
    }
    printf("]}\n");
    rig_free(&r);
    return 0;
}

typedef struct {
    bool   identical;
    int    rows_differing;
    double max_abs_diff;
} cmp_t;

static cmp_t compare(const float * a, const float * b, int n, int64_t m) {
    cmp_t c = { true, 0, 0.0 };
    for (int i = 0; i < n; i++) {
        const float * x = a + (size_t) i * m;
        const float * y = b + (size_t) i * m;
        if (memcmp(x, y, sizeof(float) * (size_t) m) != 0) {
            c.identical = false;
            c.rows_differing++;
        }
        for (int64_t j = 0; j < m; j++) {
            double d = fabs((double) x[j] - (double) y[j]);
            if (d > c.max_abs_diff || isnan(d)) c.max_abs_diff = d;
        }
    }
    return c;
}

static void print_cmp(const char * name, cmp_t c) {
    printf("\"%s\": {\"identical\": %s, \"rows_differing\": %d, \"max_abs_diff\": %.9g}", name,
           c.identical ? "true" : "false", c.rows_differing, c.max_abs_diff);
}

/* Row i as ggml's vec_dot loop would compute it with no other rows about: the activation row quantized alone
 * with the vec_dot_type's from_float, then the type's vec_dot against each weight row. */
static void vec_dot_reference(const rig_t * r, int n, float * out) {
    const struct ggml_type_traits_cpu * tt = ggml_get_type_traits_cpu(r->type);
    const enum ggml_type vt = tt->vec_dot_type;
    const ggml_from_float_t from_float = ggml_get_type_traits_cpu(vt)->from_float;
    const size_t wrow = ggml_row_size(r->type, r->k);
    void * q = malloc(ggml_row_size(vt, r->k) + 64);
    float * xf = malloc(sizeof(float) * (size_t) r->k);
    for (int i = 0; i < n; i++) {
        ggml_backend_tensor_get(r->x, xf, (size_t) i * r->x->nb[1], sizeof(float) * (size_t) r->k);
        if (vt == GGML_TYPE_F32 || from_float == NULL) memcpy(q, xf, sizeof(float) * (size_t) r->k);
        else from_float(xf, q, r->k);
        for (int64_t j = 0; j < r->m; j++) {
            tt->vec_dot((int) r->k, &out[(size_t) i * r->m + j], 0, (const char *) r->wq + (size_t) j * wrow, 0, q, 0, 1);
        }
    }
    free(q);
    free(xf);
}

/* The largest |y| of the float reference (weights dequantized, activations as given) and the largest distance from
 * it: a check that the outputs compared are the matmul at all, not zeros that would compare equal. */
static void float_reference(const rig_t * r, int n, const float * y, double * scale, double * diff) {
    const ggml_to_float_t to_float = ggml_get_type_traits(r->type)->to_float;
    const size_t wrow = ggml_row_size(r->type, r->k);
    float * wf = malloc(sizeof(float) * (size_t) r->k), * xf = malloc(sizeof(float) * (size_t) (r->k * n));
    ggml_backend_tensor_get(r->x, xf, 0, sizeof(float) * (size_t) (r->k * n));
    *scale = 0, *diff = 0;
    for (int64_t j = 0; j < r->m; j++) {
        if (to_float) to_float((const char *) r->wq + (size_t) j * wrow, wf, r->k);
        else memcpy(wf, (const char *) r->wq + (size_t) j * wrow, wrow);  /* F32 weights have no to_float */
        for (int i = 0; i < n; i++) {
            const float * x = xf + (size_t) i * r->k;
            double acc = 0;
            for (int64_t l = 0; l < r->k; l++) acc += (double) wf[l] * x[l];
            double d = fabs(acc - y[(size_t) i * r->m + j]);
            *scale = fabs(acc) > *scale ? fabs(acc) : *scale;
            *diff = d > *diff || isnan(d) ? d : *diff;
        }
    }
    free(wf), free(xf);
}

static int run_identity(const opts_t * o) {
    const int n = o->ns[0];
    rig_t r;
    rig_init(&r, o, 1, n, 0); /* every weight row its own */
    const size_t sz = sizeof(float) * (size_t) (n * o->m);
    float * batch = malloc(sz), * single = malloc(sz), * ref = malloc(sz), * first = malloc(sz);
    vec_dot_reference(&r, n, ref);
    double scale, diff;
    float_reference(&r, n, ref, &scale, &diff);
    printf("{");
    print_lib();
    print_shape(&r, o);
    printf(", \"n\": %d, \"vec_dot_type\": \"%s\", \"float_max_abs\": %.9g, \"vec_dot_vs_float_max_abs_diff\": %.9g, "
           "\"checks\": [", n, ggml_type_name(ggml_get_type_traits_cpu(o->type)->vec_dot_type), scale, diff);
    for (int t = 0; t < o->n_threads; t++) {
        ggml_backend_cpu_set_n_threads(r.backend, o->threads[t]);
        mul_mat(&r, 0, 0, n);
        memcpy(batch, output(&r), sz);
        if (t == 0) memcpy(first, batch, sz); /* the other thread counts are held to the first's n-row result */
        for (int i = 0; i < n; i++) {
            mul_mat(&r, 0, i, 1);
            memcpy(single + (size_t) i * o->m, output(&r), sizeof(float) * (size_t) o->m);
        }
        printf("%s{\"threads\": %d, ", t ? ", " : "", o->threads[t]);
        print_cmp("batch_vs_single", compare(batch, single, n, o->m));
        printf(", ");
        print_cmp("batch_vs_vec_dot", compare(batch, ref, n, o->m));
        printf(", ");
        print_cmp("single_vs_vec_dot", compare(single, ref, n, o->m));
        printf(", ");
        print_cmp("batch_vs_first_threads", compare(batch, first, n, o->m));
        printf("}");
    }
    printf("]}\n");
    free(batch), free(single), free(ref), free(first);
    rig_free(&r);
    return 0;
}

/* ggml's info lines (one per repacked tensor) would bury the JSON's neighbours on stderr: warnings and errors only. */
static void quiet_log(enum ggml_log_level level, const char * text, void * user) {
    (void) user;
    if (level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

int main(int argc, char ** argv) {
    opts_t o = parse_args(argc, argv);
    ggml_log_set(quiet_log, NULL);
    ggml_cpu_init();
    if (!strcmp(o.mode, "info")) return run_info();
    if (!strcmp(o.mode, "bench")) return run_bench(&o);
    if (!strcmp(o.mode, "identity")) return run_identity(&o);
    die("unknown mode: ", o.mode);
    return 2;
}
