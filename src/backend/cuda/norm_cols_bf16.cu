/* norm_cols_bf16.cu: the norms' dgamma and dbeta column sums for bf16 x and dz
 * (norm.cuh's norm_cols_plain), a translation unit of their own so that nvcc
 * builds each dtype's in parallel with the rest. */
#include "backend/cuda/norm.cuh"

NORM_COLS_INSTANTIATE(OPF_BF16)
