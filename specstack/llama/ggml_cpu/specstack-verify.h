// specstack's verification kernels for ggml-cpu (see specstack-verify.c).
#pragma once
#include "ggml.h"
#include <stdbool.h>
#ifdef __cplusplus
extern "C" {
#endif
struct ggml_compute_params;
// Computes dst = MUL_MAT(src0, src1) and returns true where specstack's kernels take the op.
bool specstack_verify_mul_mat(const struct ggml_compute_params * params, struct ggml_tensor * dst);
// True where the weight tensor's MUL_MAT would be taken (the repack buffer then leaves it alone).
bool specstack_verify_takes(const struct ggml_tensor * weight);
// True where flash attention must compute each query row alone (not split over the KV for one row), so that
// a row's attention is the same in a one-row call as in a verification.
bool specstack_verify_rowwise_attention(void);
// Computes dst = FLASH_ATTN_EXT(...) and returns true where specstack's attention kernel takes the op
// (specstack-attn.c): 1-63 query rows, F16 K and V, AVX-512.
bool specstack_verify_flash_attn(const struct ggml_compute_params * params, struct ggml_tensor * dst);
#ifdef __cplusplus
}
#endif
