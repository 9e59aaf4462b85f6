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
#ifdef __cplusplus
}
#endif
