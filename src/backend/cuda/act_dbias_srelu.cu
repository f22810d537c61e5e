/* act_dbias_srelu.cu: dact + dbias's column sums for act-math.h's srelu pair
 * (act.cuh's act_dbias_*), a translation unit of their own so that nvcc
 * builds each element function's in parallel with the rest. */
#include "backend/cuda/act.cuh"

ACT_DBIAS_INSTANTIATE(OPF_ACT_FN_SRELU)
