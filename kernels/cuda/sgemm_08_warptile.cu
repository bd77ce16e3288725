// Step 8: warp-tiling. Between the block tile (shared memory) and the thread patch (registers) we add
// a warp tile: each warp owns a WM x WN region of the block tile and iterates over it in
// WMITER x WNITER sub-tiles of (WM / WMITER) x (WN / WNITER). Within a sub-tile the 32 lanes form a
// grid of TM x TN patches. Two effects: the threads of one warp read neighbouring shared-memory
// addresses (fewer bank conflicts, more broadcasts), and each warp's working set maps onto one of
// the SM's four schedulers with its own registers, which improves instruction-level parallelism.
// Loads stay float4 with A transposed, as in step 6.
//
// DB = 1 adds double buffering: two shared-memory stages, and the next tile's global loads are
// issued into registers *before* the FMAs on the current tile, so their latency hides behind the
// arithmetic; one __syncthreads per K step instead of two. Like step 7, the shape is searched
// (kernels.cuda.tune(8)) over the list below: the winner per GPU is stored in sgemm_tuned.json.
// Fields: BM, BN, BK, WM, WN, WNITER, TM, TN, DB; threads per block NT = (BM/WM)*(BN/WN)*32.
// clang-format off
#define SGEMM_WARPTILE_CONFIGS(X) \
  X(128, 128, 16, 64, 64, 4, 8, 4, 0) \
  X(128, 128, 16, 64, 64, 4, 8, 4, 1) \
  X(128, 128, 16, 64, 64, 2, 8, 4, 0) \
  X(128, 128, 16, 64, 64, 2, 8, 4, 1) \
  X(128, 128, 16, 64, 64, 1, 8, 8, 1) \
  X(128, 128, 8, 64, 64, 4, 8, 4, 1) \
  X(128, 128, 16, 64, 32, 1, 8, 4, 0) \
  X(128, 128, 16, 64, 32, 1, 8, 4, 1) \
  X(128, 128, 16, 32, 64, 2, 8, 4, 1) \
  X(128, 128, 16, 64, 32, 2, 8, 4, 1) \
  X(128, 128, 8, 64, 32, 1, 8, 4, 1) \
  X(128, 256, 16, 64, 64, 4, 8, 4, 0) \
  X(128, 256, 16, 64, 64, 4, 8, 4, 1) \
  X(128, 256, 16, 64, 64, 2, 8, 4, 1) \
  X(128, 256, 8, 64, 64, 4, 8, 4, 1) \
  X(256, 128, 16, 64, 64, 4, 8, 4, 0) \
  X(256, 128, 16, 64, 64, 4, 8, 4, 1) \
  X(256, 128, 16, 64, 64, 2, 8, 4, 1) \
  X(256, 128, 8, 64, 64, 4, 8, 4, 1) \
  X(64, 128, 16, 32, 64, 2, 8, 4, 1) \
  X(128, 64, 16, 64, 32, 1, 8, 4, 1) \
  X(64, 256, 16, 32, 64, 2, 8, 4, 1) \
  X(256, 64, 16, 64, 32, 1, 8, 4, 1) \
  X(128, 128, 16, 32, 128, 4, 8, 4, 1)
// clang-format on

template <int BM, int BN, int BK, int WM, int WN, int WNITER, int TM, int TN, int NT, bool DB>
__global__ void __launch_bounds__(NT)
    sgemm_warptile_kernel(int M, int N, int K, const float* A, const float* B, float* C) {
  constexpr int WMITER = (WM * WN) / (32 * TM * TN * WNITER);
  constexpr int WSUBM = WM / WMITER, WSUBN = WN / WNITER;
  static_assert((BM / WM) * (BN / WN) * 32 == NT, "one warp per warp tile");
  static_assert(WMITER >= 1 && WMITER * WSUBM == WM && WNITER * WSUBN == WN, "whole sub-tiles");
  static_assert((WSUBM / TM) * (WSUBN / TN) == 32, "32 lanes per sub-tile");
  static_assert(TN % 4 == 0 && BK % 4 == 0 && BN % 4 == 0, "float4 access");
  static_assert(NT % (BK / 4) == 0 && BM % (NT / (BK / 4)) == 0, "A tile load passes");
  static_assert(NT % (BN / 4) == 0 && BK % (NT / (BN / 4)) == 0, "B tile load passes");
  constexpr int STAGES = DB ? 2 : 1;
  static_assert(STAGES * BK * (BM + BN) * 4 <= 48 * 1024, "static shared memory");
  __shared__ float As[STAGES][BK * BM];  // transposed: As[k * BM + m]
  __shared__ float Bs[STAGES][BK * BN];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_col = warp % (BN / WN), warp_row = warp / (BN / WN);
  const int t_col = lane % (WSUBN / TN), t_row = lane / (WSUBN / TN);
  A += blockIdx.y * BM * K;
  B += blockIdx.x * BN;
  C += (blockIdx.y * BM + warp_row * WM) * N + blockIdx.x * BN + warp_col * WN;
  // Which float4s of the A and B tiles this thread copies, in A_LOADS / B_LOADS passes.
  const int a_row = threadIdx.x / (BK / 4), a_col4 = threadIdx.x % (BK / 4);
  constexpr int A_STRIDE = NT / (BK / 4), A_LOADS = BM / A_STRIDE;
  const int b_row = threadIdx.x / (BN / 4), b_col4 = threadIdx.x % (BN / 4);
  constexpr int B_STRIDE = NT / (BN / 4), B_LOADS = BK / B_STRIDE;
  float4 a_reg[A_LOADS], b_reg[B_LOADS];  // a tile in flight from global memory
  float acc[WMITER * TM * WNITER * TN] = {0.f};
  float reg_m[WMITER * TM], reg_n[WNITER * TN];

  auto load_global = [&](int k0) {
#pragma unroll
    for (int l = 0; l < A_LOADS; ++l)
      a_reg[l] = *reinterpret_cast<const float4*>(&A[(a_row + l * A_STRIDE) * K + k0 + a_col4 * 4]);
#pragma unroll
    for (int l = 0; l < B_LOADS; ++l)
      b_reg[l] = *reinterpret_cast<const float4*>(&B[(k0 + b_row + l * B_STRIDE) * N + b_col4 * 4]);
  };
  auto store_shared = [&](int s) {
#pragma unroll
    for (int l = 0; l < A_LOADS; ++l) {
      const int m = a_row + l * A_STRIDE;
      As[s][(a_col4 * 4 + 0) * BM + m] = a_reg[l].x;
      As[s][(a_col4 * 4 + 1) * BM + m] = a_reg[l].y;
      As[s][(a_col4 * 4 + 2) * BM + m] = a_reg[l].z;
      As[s][(a_col4 * 4 + 3) * BM + m] = a_reg[l].w;
    }
#pragma unroll
    for (int l = 0; l < B_LOADS; ++l)
      *reinterpret_cast<float4*>(&Bs[s][(b_row + l * B_STRIDE) * BN + b_col4 * 4]) = b_reg[l];
  };
  auto compute = [&](int s) {
#pragma unroll
    for (int k = 0; k < BK; ++k) {
#pragma unroll
      for (int wm = 0; wm < WMITER; ++wm)
#pragma unroll
        for (int i = 0; i < TM; ++i)
          reg_m[wm * TM + i] = As[s][k * BM + warp_row * WM + wm * WSUBM + t_row * TM + i];
#pragma unroll
      for (int wn = 0; wn < WNITER; ++wn)
#pragma unroll
        for (int j = 0; j < TN; ++j)
          reg_n[wn * TN + j] = Bs[s][k * BN + warp_col * WN + wn * WSUBN + t_col * TN + j];
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
  };

  if constexpr (DB) {
    load_global(0);
    store_shared(0);
    __syncthreads();
    int s = 0;
    for (int k0 = 0; k0 < K; k0 += BK) {
      const bool more = k0 + BK < K;
      if (more) load_global(k0 + BK);  // in flight while we compute on stage s
      compute(s);
      if (more) store_shared(s ^ 1);  // stage s^1 was last read before the previous barrier
      __syncthreads();
      s ^= 1;
    }
  } else {
    for (int k0 = 0; k0 < K; k0 += BK) {
      load_global(k0);
      store_shared(0);
      __syncthreads();
      compute(0);
      __syncthreads();
    }
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

LaunchInfo sgemm_08(int config, int M, int N, int K, const float* A, const float* B, float* C,
                    cudaStream_t s) {
  int i = 0;
#define SGEMM_TRY(BM, BN, BK, WM, WN, WNITER, TM, TN, DB)                                       \
  if (config == i++) {                                                                          \
    constexpr int NT = (BM / WM) * (BN / WN) * 32;                                              \
    dim3 grid(N / BN, M / BM);                                                                  \
    sgemm_warptile_kernel<BM, BN, BK, WM, WN, WNITER, TM, TN, NT, DB><<<grid, NT, 0, s>>>(M, N, K, A, B, C); \
    return {(int)grid.x, (int)grid.y, NT};                                                      \
  }
  SGEMM_WARPTILE_CONFIGS(SGEMM_TRY)
#undef SGEMM_TRY
  return {-1, -1, -1};  // unknown configuration: nothing launched
}
