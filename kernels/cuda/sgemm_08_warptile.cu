// Step 8: warp-tiling. Between the block tile (shared memory) and the thread patch (registers) we add
// a warp tile: each warp owns a WM x WN region of the block tile and iterates over it in
// WMITER x WNITER sub-tiles of (WM / WMITER) x (WN / WNITER). Within a sub-tile the 32 lanes form a
// grid of TM x TN patches. Two effects: the threads of one warp read neighbouring shared-memory
// addresses (fewer bank conflicts, more broadcasts), and each warp's working set maps onto one of
// the SM's four schedulers with its own registers, which improves instruction-level parallelism.
// Loads stay float4 with A transposed, as in step 6.
template <int BM, int BN, int BK, int WM, int WN, int WNITER, int TM, int TN, int NT>
__global__ void __launch_bounds__(NT)
    sgemm_warptile_kernel(int M, int N, int K, const float* A, const float* B, float* C) {
  constexpr int WMITER = (WM * WN) / (32 * TM * TN * WNITER);
  constexpr int WSUBM = WM / WMITER, WSUBN = WN / WNITER;
  static_assert((BM / WM) * (BN / WN) * 32 == NT, "one warp per warp tile");
  static_assert(WMITER * WSUBM == WM && (WSUBM / TM) * (WSUBN / TN) == 32, "32 lanes per sub-tile");
  __shared__ float As[BK * BM];  // transposed
  __shared__ float Bs[BK * BN];
  const int block_row = blockIdx.y, block_col = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_col = warp % (BN / WN), warp_row = warp / (BN / WN);
  const int t_col = lane % (WSUBN / TN), t_row = lane / (WSUBN / TN);
  A += block_row * BM * K;
  B += block_col * BN;
  C += (block_row * BM + warp_row * WM) * N + block_col * BN + warp_col * WN;
  const int a_row = threadIdx.x / (BK / 4), a_col4 = threadIdx.x % (BK / 4);
  constexpr int A_STRIDE = NT / (BK / 4);
  const int b_row = threadIdx.x / (BN / 4), b_col4 = threadIdx.x % (BN / 4);
  constexpr int B_STRIDE = NT / (BN / 4);
  float acc[WMITER * TM * WNITER * TN] = {0.f};
  float reg_m[WMITER * TM], reg_n[WNITER * TN];
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
      for (int wm = 0; wm < WMITER; ++wm)
#pragma unroll
        for (int i = 0; i < TM; ++i)
          reg_m[wm * TM + i] = As[k * BM + warp_row * WM + wm * WSUBM + t_row * TM + i];
#pragma unroll
      for (int wn = 0; wn < WNITER; ++wn)
#pragma unroll
        for (int j = 0; j < TN; ++j)
          reg_n[wn * TN + j] = Bs[k * BN + warp_col * WN + wn * WSUBN + t_col * TN + j];
#pragma unroll
      for (int wm = 0; wm < WMITER; ++wm)
#pragma unroll
        for (int wn = 0; wn < WNITER; ++wn)
#pragma unroll
          for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int j = 0; j < TN; ++j)
              acc[(wm * TM + i) * (WNITER * TN) + wn * TN + j] += reg_m[wm * TM + i] * reg_n[wn * TN + j];
    }
    __syncthreads();
  }
#pragma unroll
  for (int wm = 0; wm < WMITER; ++wm)
#pragma unroll
    for (int wn = 0; wn < WNITER; ++wn) {
      float* c = C + (wm * WSUBM) * N + wn * WSUBN;
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; j += 4) {
          const float* a = &acc[(wm * TM + i) * (WNITER * TN) + wn * TN + j];
          *reinterpret_cast<float4*>(&c[(t_row * TM + i) * N + t_col * TN + j]) =
              make_float4(a[0], a[1], a[2], a[3]);
        }
    }
}

LaunchInfo sgemm_08(int M, int N, int K, const float* A, const float* B, float* C, cudaStream_t s) {
  constexpr int BM = 128, BN = 128, BK = 16, WM = 64, WN = 64, WNITER = 4, TM = 8, TN = 4, NT = 128;
  dim3 grid(N / BN, M / BM);
  sgemm_warptile_kernel<BM, BN, BK, WM, WN, WNITER, TM, TN, NT><<<grid, NT, 0, s>>>(M, N, K, A, B, C);
  return {(int)grid.x, (int)grid.y, NT};
}
