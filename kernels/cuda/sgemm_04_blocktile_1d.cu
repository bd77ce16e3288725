// Step 4: 1D block-tiling. Each thread now computes TM = 8 results down a column of C, keeping them
// in registers. In the inner loop one value of B (from shared memory) is reused for TM multiply-adds,
// so shared-memory loads per FMA fall from 2 to about 1 + 1/TM. A block computes a BM x BN = 64x64
// tile with 512 threads, stepping K by BK = 8. Requires M % BM == N % BN == K % BK == 0 (the Python
// launcher zero-pads other shapes).
template <int BM, int BN, int BK, int TM>
__global__ void __launch_bounds__((BM * BN) / TM)
    sgemm_blocktile_1d_kernel(int M, int N, int K, const float* A, const float* B, float* C) {
  __shared__ float As[BM * BK];
  __shared__ float Bs[BK * BN];
  // blockIdx.x walks columns of C: consecutive blocks share a row-panel of A in L2.
  const int block_row = blockIdx.y, block_col = blockIdx.x;
  const int t_col = threadIdx.x % BN, t_row = threadIdx.x / BN;  // t_row in [0, BM / TM)
  A += block_row * BM * K;
  B += block_col * BN;
  C += block_row * BM * N + block_col * BN;
  // BM * BK == BK * BN == thread count: one element of each tile per thread.
  const int a_row = threadIdx.x / BK, a_col = threadIdx.x % BK;
  const int b_row = threadIdx.x / BN, b_col = threadIdx.x % BN;
  float acc[TM] = {0.f};
  for (int k0 = 0; k0 < K; k0 += BK) {
    As[a_row * BK + a_col] = A[a_row * K + a_col];
    Bs[b_row * BN + b_col] = B[b_row * N + b_col];
    __syncthreads();
    A += BK;
    B += BK * N;
    for (int k = 0; k < BK; ++k) {
      const float b = Bs[k * BN + t_col];
#pragma unroll
      for (int i = 0; i < TM; ++i) acc[i] += As[(t_row * TM + i) * BK + k] * b;
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < TM; ++i) C[(t_row * TM + i) * N + t_col] = acc[i];
}

LaunchInfo sgemm_04(int M, int N, int K, const float* A, const float* B, float* C, cudaStream_t s) {
  constexpr int BM = 64, BN = 64, BK = 8, TM = 8;
  static_assert(BM * BK == (BM * BN) / TM && BK * BN == (BM * BN) / TM, "one load per thread");
  dim3 grid(N / BN, M / BM);
  sgemm_blocktile_1d_kernel<BM, BN, BK, TM><<<grid, (BM * BN) / TM, 0, s>>>(M, N, K, A, B, C);
  return {(int)grid.x, (int)grid.y, (BM * BN) / TM};
}
