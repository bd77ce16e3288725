// Step 9: wgmma, the Hopper warpgroup MMA, from shared memory. The first bf16 rung: the SGEMM ladder
// stopped at fp32 FMAs on the CUDA cores; here one warpgroup (4 warps, 128 threads) per block asks the
// tensor cores for a 64 x 128 x 16 product in one instruction, reading both operands straight from
// shared memory (no ldmatrix, no per-thread fragments of A and B in registers).
//
// What wgmma needs from us:
//  1. Operands in shared memory in a layout the hardware knows: here K-major rows of 64 bf16 = 128
//     bytes, stored with the 128-byte swizzle (swizzle_128b in hgemm_common.cuh). This step writes
//     that layout itself: each thread copies 16-byte chunks with cp.async to the swizzled address.
//  2. A 64-bit descriptor per operand per instruction (desc_k128): start address, the 1024-byte
//     distance between groups of 8 rows, the swizzle mode.
//  3. The asynchronous protocol: wgmma.fence before the first MMA, commit_group after the batch,
//     wait_group 0 before reading the accumulators or overwriting the tiles. Shared memory written by
//     cp.async (the generic proxy) is fenced (fence.proxy.async) before the barrier that hands it to
//     the tensor cores (the async proxy).
//
// Tile: BM x BN x BK = 128 x 128 x 64; per BK step the warpgroup issues 4 (k16) x 2 (two m64 halves)
// wgmma m64n128k16 and keeps 2 x 64 fp32 accumulators per thread. Shared memory: (128 + 128) rows x
// 128 B = 32 KB (plus 1 KB to align it to 1024 B), so several blocks share an SM.
//
// Napkin math (H100 SXM: 132 SMs, dense bf16 peak 989.4 TFLOP/s, nvidia2022hopperwhitepaper): one BK
// step is 2 x 128 x 128 x 64 = 2.1 MFLOP, at the per-SM peak (7.5 TFLOP/s) 0.28 us of tensor-core
// time. Within a block nothing overlaps it with the 32 KB of loads of the step: load, wait, multiply,
// wait, repeat, so every k-step pays a full global-memory round trip on top of its MMAs. Only the
// other blocks on the SM (158 registers x 128 threads: 3 blocks fit) fill the gaps. Expect far more
// than any CUDA-core rung (the tensor cores' bf16 rate is 15x the SM's fp32 FMA rate: 989.4 vs 67
// TFLOP/s, nvidia2022h100) and a fraction of cuBLAS; the next step overlaps loads with MMAs.
//
// Odd shapes: rows past M or N are predicated (cp.async with 0 source bytes zero-fills them, the
// epilogue skips them); K must be a multiple of 8 so each 16-byte chunk is entirely in or out, which
// the Python side guarantees by zero-padding K.
//
// To validate first on a GPU: the swizzle of the writes (swizzle_128b) agrees with the descriptor's
// swizzle mode and SBO; the +32 B per k16 step of the descriptor start address; the fragment layout
// in store_fragment. A mistake in any of them gives O(1) errors, not rounding noise.

namespace hg09 {
constexpr int BM = 128, BN = 128, BK = 64, NT = 128;
constexpr int TILE_A = BM * BK * 2, TILE_B = BN * BK * 2;  // bytes
constexpr int SMEM = TILE_A + TILE_B + 1024;               // + slack for the 1024-byte alignment
}  // namespace hg09

__global__ void __launch_bounds__(hg09::NT)
    hgemm_wgmma_kernel(int M, int N, int K, const bf16* __restrict__ A, const bf16* __restrict__ Bt,
                       bf16* __restrict__ C) {
  using namespace hg09;
  extern __shared__ uint8_t smem[];
  const uint32_t sA = smem_base_1024(smem), sB = sA + TILE_A;
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  // Copy assignment: 8 threads cover one 128-byte row (coalesced 128-byte global reads), 16 rows per
  // pass, 8 passes per 128-row tile.
  const int chunk = threadIdx.x % 8, row_in_pass = threadIdx.x / 8;

  float acc[2][64];  // two m64 halves of the 128 x 128 tile, 64 fp32 each per thread
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[h][i] = 0.f;

  for (int k0 = 0; k0 < K; k0 += BK) {
    const int k = k0 + chunk * 8;  // K % 8 == 0: this chunk is wholly inside K or wholly outside
#pragma unroll
    for (int p = 0; p < BM / 16; ++p) {
      const int r = row_in_pass + 16 * p;
      const bool in_a = m0 + r < M && k < K, in_b = n0 + r < N && k < K;
      const bf16* src_a = in_a ? A + static_cast<int64_t>(m0 + r) * K + k : A;
      const bf16* src_b = in_b ? Bt + static_cast<int64_t>(n0 + r) * K + k : Bt;
      cp_async_16(sA + swizzle_128b(r, chunk), src_a, in_a ? 16 : 0);
      cp_async_16(sB + swizzle_128b(r, chunk), src_b, in_b ? 16 : 0);
    }
    cp_async_wait_all();
    fence_proxy_async();  // generic-proxy writes -> async-proxy (wgmma) reads
    __syncthreads();

    wgmma_fence();
#pragma unroll
    for (int h = 0; h < 2; ++h) fence_operands(acc[h]);
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      const uint64_t db = desc_k128(sB + kk * 32);
#pragma unroll
      for (int h = 0; h < 2; ++h) wgmma_m64n128k16(acc[h], desc_k128(sA + h * 64 * 128 + kk * 32), db);
    }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int h = 0; h < 2; ++h) fence_operands(acc[h]);
    __syncthreads();  // every warp's MMAs are done reading the tiles before they are overwritten
  }

#pragma unroll
  for (int h = 0; h < 2; ++h) store_fragment<BN>(acc[h], C, M, N, m0 + 64 * h, n0);
}

HgemmLaunch hgemm_09(int M, int N, int K, const bf16* A, const bf16* Bt, bf16* C, cudaStream_t s) {
  using namespace hg09;
  HgemmLaunch info{HG_CEIL_DIV(N, BN), HG_CEIL_DIV(M, BM), NT, SMEM, nullptr};
  info.error = hgemm_allow_smem(hgemm_wgmma_kernel, SMEM);
  if (info.error) return info;
  hgemm_wgmma_kernel<<<dim3(info.grid_x, info.grid_y), NT, SMEM, s>>>(M, N, K, A, Bt, C);
  return info;
}
