/* lanesum.h: the order of the library's long fp32 sums (numerics.md 6.4),
 * one order for every device so that a GPU reproduces the CPU bit for bit
 * while summing in parallel.
 *
 * S(t_0 .. t_{n-1}) is a warp's tree: lane l = i mod 32 adds its terms t_l,
 * t_{l+32}, ... left to right from 0.0f, then the 32 lane sums fold in
 * halves (lane i += lane i+16 for i < 16, then i+8, i+4, i+2, i+1) and lane
 * 0 holds the sum. A CUDA warp computes it with one sequential sum per lane
 * and __shfl_down_sync by 16, 8, 4, 2, 1.
 *
 * Sums along a row (a norm's statistics, the cross-entropy's sum of
 * exponentials) take i = the column; column sums over the rows of a matrix
 * (dgamma, dbeta, dbias) take i = the row, one S per column. The fold keeps
 * a sequential fp32 sum's error from growing with n (32 sums of n/32 terms),
 * and no bit depends on how the work is split across threads. */
#ifndef OPFUSE_BACKEND_LANESUM_H
#define OPFUSE_BACKEND_LANESUM_H

#include <stdint.h>

enum { OPF_SUM_LANES = 32 };

/* Folds p[0 .. 31] in halves into p[0] and returns it. */
static inline float opf_lane_fold(float *p)
{
    for (int off = OPF_SUM_LANES / 2; off; off >>= 1)
        for (int l = 0; l < off; l++) p[l] += p[l + off];
    return p[0];
}

/* The same fold in double (the sum of squares of gradient clipping). */
static inline double opf_lane_fold_d(double *p)
{
    for (int off = OPF_SUM_LANES / 2; off; off >>= 1)
        for (int l = 0; l < off; l++) p[l] += p[l + off];
    return p[0];
}

/* S(t_0 .. t_{n-1}). */
static inline float opf_lane_sum(const float *t, int64_t n)
{
    float p[OPF_SUM_LANES] = {0};
    int64_t i0 = 0;
    for (; i0 + OPF_SUM_LANES <= n; i0 += OPF_SUM_LANES)
        for (int l = 0; l < OPF_SUM_LANES; l++) p[l] += t[i0 + l];
    for (int64_t l = 0; i0 + l < n; l++) p[l] += t[i0 + l];
    return opf_lane_fold(p);
}

/* Column sums: acc holds 32 lane rows of w partial sums, lane l at
 * acc + l * stride; folds them in halves into the first row. */
static inline void opf_lane_fold_cols(float *acc, int64_t stride, int64_t w)
{
    for (int off = OPF_SUM_LANES / 2; off; off >>= 1)
        for (int l = 0; l < off; l++)
            for (int64_t j = 0; j < w; j++) acc[l * stride + j] += acc[(l + off) * stride + j];
}

#endif
