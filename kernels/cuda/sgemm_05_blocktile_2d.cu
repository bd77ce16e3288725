// Step 5: 2D block-tiling. Each thread computes a TM x TN = 8x8 patch of C. Per k it loads TM values
// of A and TN values of B from shared memory into registers and does TM * TN = 64 FMAs with them: 16
// shared loads for 64 FMAs instead of ~9 for 8. A block (256 threads) owns a 128x128 tile of C, so
// every value brought from global memory is reused 128 times. Requires tile-multiple sizes.
template <int BM, int BN, int BK, int TM, int TN>
__global__ void __launch_bounds__((BM * BN) / (TM * TN))
    sgemm_blocktile_2d_kernel(int M, int N, int K, const float* A, const float* B, float* C) {
  constexpr int NT = (BM * BN) / (TM * TN);
  __shared__ float As[BM * BK];
  __shared__ float Bs[BK * BN];
  const int block_row = blockIdx.y, block_col = blockIdx.x;
  const int t_col = threadIdx.x % (BN / TN), t_row = threadIdx.x / (BN / TN);
  A += block_row * BM * K;
  B += block_col * BN;
  C += block_row * BM * N + block_col * BN;
  // The tiles have more elements than threads: each thread loads every (NT / width)-th row.
  const int a_row = threadIdx.x / BK, a_col = threadIdx.x % BK;
  constexpr int A_STRIDE = NT / BK;
  const int b_row = threadIdx.x / BN, b_col = threadIdx.x % BN;
  constexpr int B_STRIDE = NT / BN;
  float acc[TM * TN] = {0.f};
  float reg_m[TM], reg_n[TN];
  for (int k0 = 0; k0 < K; k0 += BK) {
    for (int o = 0; o < BM; o += A_STRIDE) As[(a_row + o) * BK + a_col] = A[(a_row + o) * K + a_col];
    for (int o = 0; o < BK; o += B_STRIDE) Bs[(b_row + o) * BN + b_col] = B[(b_row + o) * N + b_col];
    __syncthreads();
    A += BK;
    B += BK * N;
#pragma unroll
    for (int k = 0; k < BK; ++k) {
#pragma unroll
      for (int i = 0; i < TM; ++i) reg_m[i] = As[(t_row * TM + i) * BK + k];
#pragma unroll
      for (int j = 0; j < TN; ++j) reg_n[j] = Bs[k * BN + t_col * TN + j];
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i * TN + j] += reg_m[i] * reg_n[j];
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) C[(t_row * TM + i) * N + t_col * TN + j] = acc[i * TN + j];
}

LaunchInfo sgemm_05(int M, int N, int K, const float* A, const float* B, float* C, cudaStream_t s) {
  constexpr int BM = 128, BN = 128, BK = 8, TM = 8, TN = 8;
  dim3 grid(N / BN, M / BM);
  sgemm_blocktile_2d_kernel<BM, BN, BK, TM, TN><<<grid, (BM * BN) / (TM * TN), 0, s>>>(M, N, K, A, B, C);
  return {(int)grid.x, (int)grid.y, (BM * BN) / (TM * TN)};
}
