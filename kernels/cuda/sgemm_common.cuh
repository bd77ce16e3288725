// Shared by every step of the SGEMM ladder: C[M, N] = A[M, K] @ B[K, N], fp32, row-major.
// Each sgemm_0N.cu defines its kernel(s) and a host launcher `sgemm_0N(M, N, K, A, B, C, stream)`
// (the searched steps 7 and 8 take a `config` index first);
// kernels/cuda/__init__.py concatenates the files in order and builds them with load_inline.
#pragma once
#include <cuda_runtime.h>

#define CEIL_DIV(a, b) (((a) + (b) - 1) / (b))

// Each launcher returns the launch configuration it used, so the Python side can report it.
struct LaunchInfo {
  int grid_x, grid_y, block;
};
