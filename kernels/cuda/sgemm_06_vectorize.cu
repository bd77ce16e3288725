// Step 6: vectorised memory access. Step 5's tiles, but every global load and store moves a float4
// (16 bytes, one LDG.E.128 instead of four 32-bit loads), and the A tile is stored *transposed* in
// shared memory (As[k][m]), so the TM values a thread needs for one k are contiguous and are read with
// 128-bit shared loads (LDS.128) too. Fewer, wider instructions for the same bytes. Requires K and N
// to be multiples of 4 (16-byte alignment) on top of the tile multiples.
template <int BM, int BN, int BK, int TM, int TN>
__global__ void __launch_bounds__((BM * BN) / (TM * TN))
    sgemm_vectorize_kernel(int M, int N, int K, const float* A, const float* B, float* C) {
  constexpr int NT = (BM * BN) / (TM * TN);
  __shared__ float As[BK * BM];  // transposed: As[k * BM + m]
  __shared__ float Bs[BK * BN];
  const int block_row = blockIdx.y, block_col = blockIdx.x;
  const int t_col = threadIdx.x % (BN / TN), t_row = threadIdx.x / (BN / TN);
  A += block_row * BM * K;
  B += block_col * BN;
  C += block_row * BM * N + block_col * BN;
  const int a_row = threadIdx.x / (BK / 4), a_col4 = threadIdx.x % (BK / 4);
  constexpr int A_STRIDE = NT / (BK / 4);
  const int b_row = threadIdx.x / (BN / 4), b_col4 = threadIdx.x % (BN / 4);
  constexpr int B_STRIDE = NT / (BN / 4);
  float acc[TM * TN] = {0.f};
  float reg_m[TM], reg_n[TN];
  for (int k0 = 0; k0 < K; k0 += BK) {
#pragma unroll
    for (int o = 0; o < BM; o += A_STRIDE) {
      const float4 t = *reinterpret_cast<const float4*>(&A[(a_row + o) * K + a_col4 * 4]);
      As[(a_col4 * 4 + 0) * BM + a_row + o] = t.x;
      As[(a_col4 * 4 + 1) * BM + a_row + o] = t.y;
      As[(a_col4 * 4 + 2) * BM + a_row + o] = t.z;
      As[(a_col4 * 4 + 3) * BM + a_row + o] = t.w;
    }
#pragma unroll
    for (int o = 0; o < BK; o += B_STRIDE)
      *reinterpret_cast<float4*>(&Bs[(b_row + o) * BN + b_col4 * 4]) =
          *reinterpret_cast<const float4*>(&B[(b_row + o) * N + b_col4 * 4]);
    __syncthreads();
    A += BK;
    B += BK * N;
#pragma unroll
    for (int k = 0; k < BK; ++k) {
#pragma unroll
      for (int i = 0; i < TM; ++i) reg_m[i] = As[k * BM + t_row * TM + i];
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
    for (int j = 0; j < TN; j += 4)
      *reinterpret_cast<float4*>(&C[(t_row * TM + i) * N + t_col * TN + j]) =
          make_float4(acc[i * TN + j], acc[i * TN + j + 1], acc[i * TN + j + 2], acc[i * TN + j + 3]);
}

template <int BM, int BN, int BK, int TM, int TN>
LaunchInfo launch_vectorize(int M, int N, int K, const float* A, const float* B, float* C, cudaStream_t s) {
  constexpr int NT = (BM * BN) / (TM * TN);
  // Launch-configuration checks (also enforced by the Python config list): whole float4 rows per
  // load pass, and passes that tile the block exactly.
  static_assert(TN % 4 == 0 && BK % 4 == 0 && BN % 4 == 0, "float4 access");
  static_assert(NT % (BK / 4) == 0 && BM % (NT / (BK / 4)) == 0, "A tile load passes");
  static_assert(NT % (BN / 4) == 0 && BK % (NT / (BN / 4)) == 0, "B tile load passes");
  static_assert(NT >= 32 && NT <= 1024, "threads per block");
  dim3 grid(N / BN, M / BM);
  sgemm_vectorize_kernel<BM, BN, BK, TM, TN><<<grid, NT, 0, s>>>(M, N, K, A, B, C);
  return {(int)grid.x, (int)grid.y, NT};
}

LaunchInfo sgemm_06(int M, int N, int K, const float* A, const float* B, float* C, cudaStream_t s) {
  return launch_vectorize<128, 128, 8, 8, 8>(M, N, K, A, B, C, s);
}
