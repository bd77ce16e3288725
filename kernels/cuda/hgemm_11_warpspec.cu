// Step 11: warp specialisation. In step 10 one warpgroup did everything: it waited for tiles, issued
// MMAs, synchronised its four warps every k-step and only then asked for the next copy, so each of
// those chores sat on the critical path of the tensor cores. Here the block has three warpgroups with
// one job each:
//  - warpgroup 0, the producer: one thread issues the TMA copies into a 4-slot ring, waiting on an
//    "empty" mbarrier per slot before it refills it. It needs almost no registers, so it gives them
//    back: setmaxnreg.dec to 40 per thread.
//  - warpgroups 1 and 2, the consumers: each owns 64 rows of a 128 x 256 block tile and issues
//    wgmma m64n256k16 on its half (A rows 64c..64c+63, all of B), 128 fp32 accumulators per thread.
//    They take the producer's registers: setmaxnreg.inc to 232. Two consumers also mean one's waits
//    (barrier, wgmma_wait) overlap the other's MMAs.
// Handshake per slot s: full[s] (1 arrival + the tile bytes, as in step 10) says "tile landed";
// empty[s] (8 arrivals, lane 0 of each consumer warp, once its wgmma_wait<1> shows the MMAs of the
// previous tile are done) says "slot free". No __syncthreads in the main loop.
//
// Registers: __launch_bounds__(384, 1) caps every thread at 65536 / 384 = 170 -> 168 registers at
// entry (a cap is what lets setmaxnreg work). After the switch: 128 x 40 + 256 x 232 = 64512 <= 65536.
//
// Tile 128 x 256 x 64 (BN = 256: global/L2 bytes per FLOP drop by a quarter, (128 + 256) / (128 x 256)
// against (128 + 128) / (128 x 128); the shared-memory bytes the tensor cores read per FLOP drop by a
// sixth, each m64n256k16 reading 64 + 256 rows for 64 x 256 outputs instead of 64 + 128 for 64 x 128),
// 4 stages of 48 KB = 192 KB, one block per SM. Napkin math: a k-step is 2 x 128 x 256 x 64 = 4.2 MFLOP
// = 0.56 us at the per-SM peak; three tiles in flight give a load 1.7 us to arrive. What is left for
// step 12: the epilogue (not overlapped with the next tile's main loop: one tile per block), the
// tail effect of a non-persistent grid, and L2 reuse (no clusters / multicast).
//
// Odd shapes: as step 10 (TMA zero-fill, predicated epilogue, K a multiple of 8).
//
// To validate first on a GPU: the empty-barrier parity ((kt / STAGES - 1) & 1 for the refill of
// tile kt), the arrival count (8) matching the arrivals, and that ptxas honoured setmaxnreg (no
// warning C7508 at build time; 168 registers reported for the kernel).

namespace hg11 {
constexpr int BM = 128, BN = 256, BK = 64, STAGES = 4, CONSUMERS = 2, NT = 128 * (1 + CONSUMERS);
constexpr int TILE_A = BM * BK * 2, TILE_B = BN * BK * 2, STAGE = TILE_A + TILE_B;  // bytes
constexpr int SMEM = STAGES * STAGE + 1024 + 2 * STAGES * 8;  // tiles, slack, full + empty barriers
constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;
static_assert(128 * PRODUCER_REGS + 128 * CONSUMERS * CONSUMER_REGS <= 65536, "register file");
static_assert(SMEM <= 227 * 1024, "shared memory per block");
}  // namespace hg11

__global__ void __launch_bounds__(hg11::NT, 1)
    hgemm_warpspec_kernel(const __grid_constant__ CUtensorMap map_a,
                          const __grid_constant__ CUtensorMap map_b, int M, int N, int K,
                          bf16* __restrict__ C) {
  using namespace hg11;
  extern __shared__ uint8_t smem[];
  const uint32_t tiles = smem_base_1024(smem);
  const uint32_t full = tiles + STAGES * STAGE, empty = full + STAGES * 8;
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  const int KT = HG_CEIL_DIV(K, BK);
  const int wg = threadIdx.x / 128;

  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full + 8 * s, 1);                  // the producer's arrive.expect_tx
      mbar_init(empty + 8 * s, CONSUMERS * 4);     // lane 0 of every consumer warp
    }
    mbar_fence_init();
  }
  __syncthreads();

  if (wg == 0) {
    // ---- producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
    if (threadIdx.x == 0) {
      for (int kt = 0; kt < KT; ++kt) {
        const int s = kt % STAGES;
        // The n-th refill (n = kt / STAGES >= 1) of slot s needs the consumers' release of fill
        // n - 1, which completes phase n - 1 of empty[s].
        if (kt >= STAGES) mbar_wait(empty + 8 * s, (kt / STAGES - 1) & 1);
        const uint32_t bar = full + 8 * s, a = tiles + s * STAGE;
        mbar_arrive_expect_tx(bar, STAGE);
        tma_load_2d(a, &map_a, bar, kt * BK, m0);
        tma_load_2d(a + TILE_A, &map_b, bar, kt * BK, n0);
      }
    }
  } else {
    // ---- consumers
    // REVIEW: inc blocks until the registers exist: it needs exactly what the producer's dec frees
    // (384 x 168 = 64512 at launch; 128 x (168 - 40) = 256 x (232 - 168) = 16384). A hang with
    // every consumer warp parked here means the launch allocated other than 168 (ncu "Registers Per
    // Thread").
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));
    const int c = wg - 1;  // rows 64c .. 64c + 63 of the block tile
    const bool lane0 = threadIdx.x % 32 == 0;
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    for (int kt = 0; kt < KT; ++kt) {
      const int s = kt % STAGES;
      mbar_wait(full + 8 * s, (kt / STAGES) & 1);
      const uint32_t sA = tiles + s * STAGE + c * 64 * 128, sB = tiles + s * STAGE + TILE_A;
      wgmma_fence();
      fence_operands(acc);
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk)
        wgmma_m64n256k16(acc, desc_k128(sA + kk * 32), desc_k128(sB + kk * 32));
      wgmma_commit();
      wgmma_wait<1>();  // this warp's MMAs of tile kt - 1 are done: release its slot
      fence_operands(acc);
      if (kt >= 1 && lane0) mbar_arrive(empty + 8 * ((kt - 1) % STAGES));
    }
    wgmma_wait<0>();
    fence_operands(acc);
    store_fragment<BN>(acc, C, M, N, m0 + 64 * c, n0);
  }
}

HgemmLaunch hgemm_11(int M, int N, int K, const bf16* A, const bf16* Bt, bf16* C, cudaStream_t s) {
  using namespace hg11;
  HgemmLaunch info{HG_CEIL_DIV(N, BN), HG_CEIL_DIV(M, BM), NT, SMEM, nullptr};
  CUtensorMap map_a, map_b;
  if ((info.error = hgemm_tensor_map(&map_a, A, M, K, BM))) return info;
  if ((info.error = hgemm_tensor_map(&map_b, Bt, N, K, BN))) return info;
  if ((info.error = hgemm_allow_smem(hgemm_warpspec_kernel, SMEM))) return info;
  hgemm_warpspec_kernel<<<dim3(info.grid_x, info.grid_y), NT, SMEM, s>>>(map_a, map_b, M, N, K, C);
  return info;
}
