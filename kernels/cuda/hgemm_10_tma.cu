// Step 10: TMA loads into a ring of shared-memory stages, synchronised with mbarriers. Step 9 loaded
// a tile, waited for it, multiplied, waited again: the tensor cores idled through every load. Here
// the loads of the next STAGES - 1 tiles are in flight while the tensor cores work on the current one.
//
// Two Hopper pieces make that cheap:
//  - TMA (the tensor memory accelerator, cp.async.bulk.tensor): ONE thread asks for a whole 128 x 64
//    tile with one instruction, described by a CUtensorMap built on the host (hgemm_tensor_map: the
//    matrix's shape, pitch, box size and the 128-byte swizzle). The copy engine computes the
//    addresses, writes the swizzled layout wgmma reads, zero-fills whatever lies outside the matrix
//    (so edge tiles need no predication) and frees 127 threads from address arithmetic and loads.
//  - mbarrier transaction counts: the thread that issues the copies of stage s arrives once on
//    full[s] with expect_tx(bytes of A + B tiles); the barrier's phase completes when those bytes have
//    landed. Consumers wait on the phase parity: the n-th fill of slot s is phase n, parity n & 1.
//
// The ring. Tiles are BM x BN x BK = 128 x 128 x 64 as in step 9, STAGES = 3 slots of 32 KB. At
// iteration kt the warpgroup waits for full[kt % STAGES], issues its 8 wgmma, commits, and waits
// until at most ONE group is outstanding (wgmma_wait<1>): the MMAs of kt - 1 are then done, so after a
// __syncthreads (all four warps past that point) thread 0 refills slot (kt - 1) % STAGES with tile
// kt - 1 + STAGES while the MMAs of kt still run. No warp specialisation yet: the same warpgroup
// issues copies and MMAs (step 11 splits them).
//
// Napkin math: a 128 x 128 x 64 step is 0.28 us of tensor-core time per SM at peak (step 9); with
// two tiles always in flight a load has two steps (0.56 us at peak) to arrive instead of none, so the
// MMAs wait only when a load takes longer than that. Shared memory 3 x 32 KB + 1 KB per block: two
// blocks fit in an SM's 228 KB (nvidiahoppertuning), so one block's epilogue overlaps the other's
// main loop. Expect a large step over
// step 9; what remains is the epilogue (registers -> global with 4-byte stores) and the single
// warpgroup per block issuing everything.
//
// Odd shapes: M and N free (TMA zero-fills, the epilogue predicates); K a multiple of 8 (the
// tensor map's row pitch must be a multiple of 16 bytes), guaranteed by the Python side.
//
// To validate first on a GPU: the tensor map (box {64, 128}, SWIZZLE_128B) writes exactly the layout
// step 9 wrote by hand; the expect_tx byte count equals what the two boxes deliver (full boxes are
// counted even at the matrix edge); the parity sequence of the ring (a wrong parity deadlocks or
// reads a stale tile: run with compute-sanitizer first, and a K of a few tiles, e.g. K = 64, 192, 320).

namespace hg10 {
constexpr int BM = 128, BN = 128, BK = 64, NT = 128, STAGES = 3;
constexpr int TILE_A = BM * BK * 2, TILE_B = BN * BK * 2, STAGE = TILE_A + TILE_B;  // bytes
constexpr int SMEM = STAGES * STAGE + 1024 + STAGES * 8;  // tiles, alignment slack, mbarriers
}  // namespace hg10

__global__ void __launch_bounds__(hg10::NT, 2)
    hgemm_tma_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                     int M, int N, int K, bf16* __restrict__ C) {
  using namespace hg10;
  extern __shared__ uint8_t smem[];
  const uint32_t tiles = smem_base_1024(smem);
  const uint32_t full = tiles + STAGES * STAGE;  // STAGES mbarriers of 8 bytes
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  const int KT = HG_CEIL_DIV(K, BK);
  const bool leader = threadIdx.x == 0;

  // Load k-tile kt into ring slot s: both boxes complete their bytes on full[s].
  auto issue = [&](int kt, int s) {
    const uint32_t bar = full + 8 * s, a = tiles + s * STAGE;
    mbar_arrive_expect_tx(bar, STAGE);
    tma_load_2d(a, &map_a, bar, kt * BK, m0);
    tma_load_2d(a + TILE_A, &map_b, bar, kt * BK, n0);
  };

  if (leader) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) mbar_init(full + 8 * s, 1);  // one arrival: the leader's
    mbar_fence_init();
  }
  __syncthreads();
  if (leader)
    for (int s = 0; s < STAGES && s < KT; ++s) issue(s, s);

  float acc[2][64];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[h][i] = 0.f;

  for (int kt = 0; kt < KT; ++kt) {
    const int s = kt % STAGES;
    mbar_wait(full + 8 * s, (kt / STAGES) & 1);
    const uint32_t sA = tiles + s * STAGE, sB = sA + TILE_A;
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
    wgmma_wait<1>();  // the group of kt - 1 is done; kt's may still run
#pragma unroll
    for (int h = 0; h < 2; ++h) fence_operands(acc[h]);
    __syncthreads();  // ... in all four warps: slot (kt - 1) % STAGES is free
    const int next = kt - 1 + STAGES;
    if (leader && kt >= 1 && next < KT) issue(next, (kt - 1) % STAGES);
  }
  wgmma_wait<0>();
#pragma unroll
  for (int h = 0; h < 2; ++h) fence_operands(acc[h]);

#pragma unroll
  for (int h = 0; h < 2; ++h) store_fragment<BN>(acc[h], C, M, N, m0 + 64 * h, n0);
}

HgemmLaunch hgemm_10(int M, int N, int K, const bf16* A, const bf16* Bt, bf16* C, cudaStream_t s) {
  using namespace hg10;
  HgemmLaunch info{HG_CEIL_DIV(N, BN), HG_CEIL_DIV(M, BM), NT, SMEM, nullptr};
  CUtensorMap map_a, map_b;
  if ((info.error = hgemm_tensor_map(&map_a, A, M, K, BM))) return info;
  if ((info.error = hgemm_tensor_map(&map_b, Bt, N, K, BN))) return info;
  if ((info.error = hgemm_allow_smem(hgemm_tma_kernel, SMEM))) return info;
  hgemm_tma_kernel<<<dim3(info.grid_x, info.grid_y), NT, SMEM, s>>>(map_a, map_b, M, N, K, C);
  return info;
}
