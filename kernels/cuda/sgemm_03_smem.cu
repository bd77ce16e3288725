// Step 3: shared-memory tiling. A block of 32x32 threads computes a 32x32 tile of C. It walks K in
// steps of 32, each time staging a 32x32 tile of A and of B in shared memory (each thread loads one
// element of each), then every thread reads its row/column from shared memory. Each value fetched
// from global memory is now used 32 times: global traffic falls 32x, and the reads come from
// on-chip SRAM instead. Still one result per thread, so the inner loop is two shared-memory loads
// per fused multiply-add: the next bottleneck.
template <int BS>
__global__ void sgemm_smem_kernel(int M, int N, int K, const float* A, const float* B, float* C) {
  __shared__ float As[BS * BS];
  __shared__ float Bs[BS * BS];
  const int tr = threadIdx.x / BS, tc = threadIdx.x % BS;
  const int row = blockIdx.x * BS + tr, col = blockIdx.y * BS + tc;
  float acc = 0.f;
  for (int k0 = 0; k0 < K; k0 += BS) {
    // Zero-fill outside the matrix so odd sizes need no special inner loop.
    As[tr * BS + tc] = (row < M && k0 + tc < K) ? A[row * K + k0 + tc] : 0.f;
    Bs[tr * BS + tc] = (k0 + tr < K && col < N) ? B[(k0 + tr) * N + col] : 0.f;
    __syncthreads();  // the tile is complete before anyone reads it
    for (int k = 0; k < BS; ++k) acc += As[tr * BS + k] * Bs[k * BS + tc];
    __syncthreads();  // everyone is done reading before the next tile overwrites it
  }
  if (row < M && col < N) C[row * N + col] = acc;
}

LaunchInfo sgemm_03(int M, int N, int K, const float* A, const float* B, float* C, cudaStream_t s) {
  constexpr int BS = 32;
  dim3 grid(CEIL_DIV(M, BS), CEIL_DIV(N, BS));
  sgemm_smem_kernel<BS><<<grid, BS * BS, 0, s>>>(M, N, K, A, B, C);
  return {(int)grid.x, (int)grid.y, BS * BS};
}
