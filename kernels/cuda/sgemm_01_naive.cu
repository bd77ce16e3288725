// Step 1: naive. One thread per element of C, reading its row of A and column of B straight from
// global memory: 2K loads for 2K FLOPs, an arithmetic intensity of 1/4 FLOP/byte before caches.
// Worse, threadIdx.x indexes *rows*: the 32 threads of a warp read 32 different rows of A, K floats
// apart, so no two of their loads share a memory transaction (uncoalesced), and the same holds for
// the stores to C.
__global__ void sgemm_naive_kernel(int M, int N, int K, const float* A, const float* B, float* C) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  const int col = blockIdx.y * blockDim.y + threadIdx.y;
  if (row < M && col < N) {
    float acc = 0.f;
    for (int k = 0; k < K; ++k) acc += A[row * K + k] * B[k * N + col];
    C[row * N + col] = acc;
  }
}

LaunchInfo sgemm_01(int M, int N, int K, const float* A, const float* B, float* C, cudaStream_t s) {
  dim3 block(32, 32);
  dim3 grid(CEIL_DIV(M, 32), CEIL_DIV(N, 32));
  sgemm_naive_kernel<<<grid, block, 0, s>>>(M, N, K, A, B, C);
  return {(int)grid.x, (int)grid.y, 1024};
}
