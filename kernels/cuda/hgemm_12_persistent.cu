// Step 12: a persistent, tile-scheduled kernel in clusters of two CTAs that share B through TMA
// multicast, with a store epilogue through shared memory and TMA. Step 11's producer/consumer block
// is unchanged inside; what changes is everything around one tile:
//  - Persistent grid. Step 11 launched one block per 128 x 256 output tile; each block initialised its
//    barriers, waited a full memory round trip for its first tile, ran its main loop, stored and
//    exited, and the SM then idled until the next block had done the same. Here the grid is as many
//    clusters as fit on the GPU at once (cudaOccupancyMaxActiveClusters: 66 clusters on 132 SMs when
//    every GPC has an even number of free SMs, fewer otherwise), and each cluster walks the output
//    tiles t = cluster id, + number of clusters, ... The producer runs ahead into the next tile as
//    soon as ring slots free up, so while the consumers run the epilogue of tile t the loads of tile
//    t + 1 are already in flight: the next main loop starts on full slots.
//  - Tile order for L2 (kernels/matmul.py's GROUP_M): cluster tiles of 256 x 256 are numbered in
//    groups of GROUP_M = 8 tile rows, down a column before moving right. At 8192^3 (32 x 32 cluster
//    tiles) the 66 tiles in flight then span 8 tile rows and 9 columns, 2048 rows of A and 2304 of
//    Bt, instead of 3 rows and all 32 columns in row-major order, 768 rows of A and all 8192 of Bt:
//    4352 rows instead of 8960 to bring from DRAM per k-step, under half, provided L2 (50 MB,
//    nvidia2022hopperwhitepaper) keeps each k-slice until all 66 clusters have read it.
//  - Clusters of 2 along M, B multicast. The two CTAs of a cluster compute vertically adjacent tiles
//    (rows m0 and m0 + 128, the same 256 columns), so they need the same Bt tile (256 x 64). Each CTA
//    loads half of it (128 rows) ONCE from L2 and the copy engine writes it into both CTAs' shared
//    memory (cp.async.bulk.tensor ... .multicast::cluster, CTA mask 0b11), at the same offset, and
//    signals both CTAs' full barriers. Per k-step a CTA asks L2 for 16 KB of A + 16 KB of B instead
//    of 16 + 32 KB: a third less L2 -> SM traffic for the same 4.2 MFLOP. At the dense bf16 peak
//    (989.4 TFLOP/s, nvidia2022hopperwhitepaper) that is 49152 B / 4.19 MFLOP x 989.4 TFLOP/s = 11.6
//    TB/s from L2 to the SMs in step 11, and 7.7 TB/s here.
//  - Store epilogue through TMA. Step 11's threads wrote C with 4-byte stores straight from the
//    accumulator fragments (8 rows x 16 bytes per warp instruction). Here each consumer writes its
//    64 x 256 bf16 fragment into a 128-byte-swizzled staging buffer in shared memory (conflict-free:
//    the 8 rows a warp writes land in 8 different 16-byte bank groups), fences it for the async proxy
//    (fence.proxy.async.shared::cta), and one thread hands it to TMA (cp.async.bulk.tensor global <-
//    shared::cta, 64 x 64 boxes), which clips rows >= M and columns >= N. The staging buffer is
//    reused only after cp.async.bulk.wait_group.read 0 says the previous store has read it. 64 KB of
//    staging would not fit beside a 4-stage ring (4 x 48 + 64 > 227 KB), so each consumer stages
//    EPI_N = 128 columns at a time (16 KB) in two rounds.
// What is NOT overlapped: the consumers' own epilogue with their next MMAs (the tensor cores of the SM
// idle while both consumers store; a second accumulator set or CUTLASS's "ping-pong" of two consumer
// warpgroups on different tiles would hide it), and the last, partial wave: at 4096^3 there are
// 16 x 16 = 256 cluster tiles for 66 clusters, 3.88 waves, the same quantisation as step 11's 512
// blocks on 132 SMs (stream-K or split-K would fix that; not this step).
//
// Barrier bookkeeping (the part to get right; a wrong parity deadlocks or reads a stale tile):
//  - it = the k-iteration counter of this CTA, GLOBAL across tiles (not reset per tile): ring slot
//    it % STAGES, fill number it / STAGES. Producer and consumers walk the same tiles with the same
//    K, so their counters agree. A counter reset per tile would desynchronise the phases unless
//    every slot is filled an even number of times per tile (KT a multiple of 2 * STAGES): the
//    parity a wait expects is the slot's fill count mod 2 since the kernel began, not since the
//    tile began.
//  - full[s] (count 1): this CTA's producer arrives once with expect_tx(48 KB) = its A tile (16 KB,
//    local) + its B half (16 KB, multicast to itself) + the partner's B half (16 KB, multicast to
//    it). The partner's bytes may land before the local expect_tx (the transaction count goes
//    negative, which the mbarrier allows); the phase still cannot complete before the local arrival.
//    Consumers wait on parity (it / STAGES) & 1.
//  - empty[s] (count CLUSTER x CONSUMERS x 4 = 16): a slot of CTA r is written by both producers (A
//    and one B half by r, the other B half by its partner), so neither producer may refill slot s
//    until the consumers of BOTH CTAs are done with it. Every consumer warp therefore arrives on
//    empty[s] of both CTAs: lane q < CLUSTER arrives on CTA q's barrier (mapa + mbarrier.arrive
//    .shared::cluster, default semantics, after wgmma_wait). The producer waits for refill n >= 1
//    on parity (n - 1) & 1. Every fill is released (the last k-step of each tile after
//    wgmma_wait<0>), so the producer of the next tile never waits for a release that will not come.
//  - barrier.cluster arrive/wait at the start (the partner's mbarriers are initialised before any
//    multicast or remote arrive reaches them) and at the end (no CTA exits while the partner can
//    still arrive on its empty barriers; the partner's multicast bytes are all consumed, hence
//    landed, before this CTA's consumers finish).
//
// Registers and shared memory as step 11: 384 threads capped at 168 registers at entry, setmaxnreg
// 40 / 232; 4 x 48 KB ring + 2 x 16 KB staging + 1 KB alignment slack + 64 B of barriers = 225 KB.
//
// Odd shapes: TMA zero-fills loads past M, N, K (full boxes still count their bytes) and clips stores
// at M and N. The last cluster tile can reach wholly past M or N (the second CTA's rows when M % 256
// is 1..128, the second B half when N % 256 is 1..128): such loads start on the last row instead
// (their results fall outside C) and such stores are skipped, so TMA only ever sees partial boxes.
// C's row pitch must be a multiple of 16 bytes for the TMA store: the binding allocates C with its
// pitch rounded up to 8 columns and returns the first N (a copy only when N % 8 != 0). K a multiple
// of 8 (padded by the Python side), as in steps 10-11.
//
// To validate first on a GPU, in this order: (1) the launch itself (cluster dims x 2, 225 KB of
// shared memory, cudaOccupancyMaxActiveClusters > 0); (2) no deadlock and the right answer with one
// tile per cluster (1000^3) and then with many tiles per cluster and KT % STAGES != 0 (4000 x 3000 x
// 5000, 2177 x 4104 x 72: the cross-tile phases); (3) the multicast (a wrong mask, offset or byte
// count shows as the second 128 columns of each 256 wrong, or a hang); (4) the TMA store (N % 8 != 0
// shapes: the padded pitch and the clipping; the swizzled staging layout matches the store map's
// SWIZZLE_128B); (5) compute-sanitizer memcheck and synccheck (hgemm_probe.py --sanitize). The
// tile order and the staging addresses are already checked on the CPU (tests/test_hgemm.py).

namespace hg12 {
constexpr int BM = 128, BN = 256, BK = 64, STAGES = 4, CONSUMERS = 2, NT = 128 * (1 + CONSUMERS);
constexpr int CLUSTER = 2;             // CTAs per cluster, stacked along M
constexpr int B_ROWS = BN / CLUSTER;   // rows of Bt each CTA loads and multicasts: 128
constexpr int TILE_A = BM * BK * 2, TILE_B = BN * BK * 2, STAGE = TILE_A + TILE_B;  // bytes
constexpr int B_HALF = B_ROWS * BK * 2;                                              // bytes
constexpr int EPI_N = 128;            // columns of C per epilogue round and consumer
constexpr int C_BOX = 64 * 64 * 2;    // one TMA store box: 64 rows x 64 bf16 (128-byte rows)
constexpr int C_STAGE = 64 * EPI_N * 2;  // a consumer's staging buffer: 64 rows x EPI_N columns
constexpr int SMEM = STAGES * STAGE + CONSUMERS * C_STAGE + 1024 + 2 * STAGES * 8;
constexpr int GROUP_M = 8;  // cluster-tile rows per group of the tile order
constexpr int EMPTY_ARRIVALS = CLUSTER * CONSUMERS * 4;  // one per consumer warp of each CTA
constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;
static_assert(128 * PRODUCER_REGS + 128 * CONSUMERS * CONSUMER_REGS <= 65536, "register file");
static_assert(SMEM <= 227 * 1024, "shared memory per block");
static_assert(BN % EPI_N == 0 && EPI_N % 64 == 0, "epilogue rounds of whole 64-column boxes");
static_assert(CLUSTER == 2, "the mask, the empty-barrier arrivals and the rank arithmetic assume 2");

// ----------------------------------------------------------------------------- cluster helpers

__device__ __forceinline__ uint32_t cluster_ctarank() {  // 0 or 1 in this cluster
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t cluster_id_x() {  // this cluster's index in the grid
  uint32_t r;
  asm volatile("mov.u32 %0, %%clusterid.x;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t cluster_count_x() {  // clusters in the grid
  uint32_t r;
  asm volatile("mov.u32 %0, %%nclusterid.x;\n" : "=r"(r));
  return r;
}
// Every thread of both CTAs: release what it wrote, wait for all non-exited threads of the
// cluster. Not the .aligned form: at the end of the kernel the threads of a warp arrive from
// different branches (the producer's thread 0 from its loop).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
// One arrival on the mbarrier at the same shared-memory offset as `bar` in CTA `cta` of this
// cluster (mapa translates the offset into that CTA's window of the cluster's shared memory). The
// arrive has the default semantics, as CUTLASS's cluster barrier does
// (mbarrier.arrive.shared::cluster.b64 _, [remote]): the slot's reads it hands back are already
// complete (wgmma_wait). An earlier version released at cluster scope (.release.cluster, with an
// acquire.cluster wait): ptxas 13.0 compiles that to MEMBAR.ALL.CTA + MEMBAR.ALL.GPU before the
// SYNCS.ARRIVE, once per consumer warp per k-step, and Nsight Compute on an H100 showed the cost:
// membar the top stall, the tensor pipe busy 52% of active cycles against 93.6% without it
// (results/profiles/2026-11-27-nvidia-h100-80gb-hbm3-hgemm.txt). HGEMM12_CLUSTER_RELEASE=1 builds
// that version again, for the A/B of scripts/gpu/hgemm_probe.py --define.
#ifndef HGEMM12_CLUSTER_RELEASE
#define HGEMM12_CLUSTER_RELEASE 0
#endif
#if HGEMM12_CLUSTER_RELEASE
#define HGEMM12_ARRIVE "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}\n"
#define HGEMM12_TRY_WAIT "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
#else
#define HGEMM12_ARRIVE "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n"
#define HGEMM12_TRY_WAIT "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
#endif
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t cta) {
  asm volatile(
      "{\n.reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n" HGEMM12_ARRIVE ::"r"(bar),
      "r"(cta)
      : "memory");
}
// mbar_wait for the empty barriers, whose arrivals come from both CTAs: the default semantics (the
// producer reads nothing the consumers wrote), or acquire at cluster scope with
// HGEMM12_CLUSTER_RELEASE=1.
__device__ __forceinline__ void mbar_wait_cluster(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        HGEMM12_TRY_WAIT
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// ----------------------------------------------------------------------------- TMA multicast, store

// tma_load_2d, but the box lands at offset `dst` in the shared memory of every CTA in `mask` and
// completes its bytes on the mbarrier at offset `bar` in each of them.
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const CUtensorMap* map,
                                                      uint32_t bar, int c0, int c1, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "h"(mask)
      : "memory");
}
// One box of shared memory at `src` to global memory at element coordinates (c0, c1) of `map`;
// elements outside the matrix are not written. Completion is tracked per thread in bulk groups.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, uint32_t src, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(src), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Wait until at most N of this thread's bulk groups are still READING shared memory (their global
// writes may still be in flight): the staging buffer may then be overwritten.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// Wait until at most N of this thread's bulk groups are incomplete (writes done too).
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
// A barrier among the `threads` threads (a multiple of 32) that use barrier `id` (1-15; 0 is
// __syncthreads): one consumer warpgroup synchronises without stopping the other or the producer.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// ----------------------------------------------------------------------------- tile scheduler

// Cluster tile t (of tiles_m x tiles_n tiles of CLUSTER*BM x BN) -> its row tm and column tn, in
// grouped order: GROUP_M tile rows are walked down a column before moving right (kernels/matmul.py's
// _tile_coords), so the clusters working at the same time share panels of A and B in L2. Host and
// device: tests/test_hgemm.py runs it on the CPU (every tile once, the span of a wave).
__host__ __device__ __forceinline__ void cluster_tile(int t, int tiles_m, int tiles_n, int& tm,
                                                      int& tn) {
  const int per_group = GROUP_M * tiles_n;
  const int first_m = (t / per_group) * GROUP_M;
  const int rows = min(tiles_m - first_m, GROUP_M);
  tm = first_m + (t % per_group) % rows;
  tn = (t % per_group) / rows;
}

// Byte offset in a consumer's staging buffer of the bf16 pair that lane `lane` holds for 8-column
// block j (0 .. EPI_N / 8 - 1) of this round, fragment row `row` (0-63): 64-column boxes of
// 128-byte rows, each in TMA's SWIZZLE_128B layout (16-byte chunk j % 8 of row r at chunk
// (j % 8) ^ (r % 8)). A warp's 32 stores of one (j, h) hit 32 different banks; tests/test_hgemm.py
// checks that on the CPU, and that one round writes every word of the buffer exactly once.
__host__ __device__ __forceinline__ uint32_t staging_offset(int row, int j, int lane) {
  return static_cast<uint32_t>((j / 8) * C_BOX) + swizzle_128b(row, j % 8) + 4 * (lane % 4);
}
}  // namespace hg12

__global__ void __cluster_dims__(hg12::CLUSTER, 1, 1) __launch_bounds__(hg12::NT, 1)
    hgemm_persistent_kernel(const __grid_constant__ CUtensorMap map_a,
                            const __grid_constant__ CUtensorMap map_b,
                            const __grid_constant__ CUtensorMap map_c, int M, int N, int K) {
  using namespace hg12;
  extern __shared__ uint8_t smem[];
  // The same layout in both CTAs (same kernel, same dynamic base): the multicast writes at one
  // offset in each of them.
  const uint32_t tiles = smem_base_1024(smem);
  const uint32_t staging = tiles + STAGES * STAGE;  // CONSUMERS x C_STAGE, 1024-aligned
  const uint32_t full = staging + CONSUMERS * C_STAGE, empty = full + STAGES * 8;
  const int KT = HG_CEIL_DIV(K, BK);
  const int tiles_m = HG_CEIL_DIV(M, CLUSTER * BM), tiles_n = HG_CEIL_DIV(N, BN);
  const int n_tiles = tiles_m * tiles_n;
  const int rank = static_cast<int>(cluster_ctarank());
  const int first_tile = static_cast<int>(cluster_id_x());    // tiles first_tile, + tile_step, ...
  const int tile_step = static_cast<int>(cluster_count_x());  // (the same in both CTAs)
  const int wg = threadIdx.x / 128;

  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full + 8 * s, 1);                 // this CTA's producer's arrive.expect_tx
      mbar_init(empty + 8 * s, EMPTY_ARRIVALS);  // every consumer warp of both CTAs
    }
    mbar_fence_init();  // visible to the partner CTA and to the copy engine
  }
  cluster_sync();  // both CTAs' barriers are initialised before anyone multicasts or arrives remotely

  if (wg == 0) {
    // ---- producer: one thread streams A and half of B for every tile of this cluster
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
    if (threadIdx.x == 0) {
      int it = 0;  // k-iterations issued so far, over ALL tiles: slot it % STAGES, fill it / STAGES
      for (int t = first_tile; t < n_tiles; t += tile_step) {
        int tm, tn;
        cluster_tile(t, tiles_m, tiles_n, tm, tn);
        const int m0 = (tm * CLUSTER + rank) * BM, n0 = tn * BN;
        // Box origins kept inside the matrix: in the last tile row or column the second CTA's A
        // rows (M % 256 in 1..128) or the second B half (N % 256 in 1..128) lie wholly outside it.
        // Starting such a box on the last row keeps every load a partial box (the zero-filled edge
        // case steps 10-11 rely on); what it computes lands in rows or columns >= M or N, which the
        // epilogue never stores.
        const int a_row = min(m0, M - 1), b_row = min(n0 + rank * B_ROWS, N - 1);
        for (int kt = 0; kt < KT; ++kt, ++it) {
          const int s = it % STAGES;
          // Refill n = it / STAGES >= 1 of slot s needs fill n - 1 released by the consumers of
          // both CTAs: phase n - 1 of this CTA's empty[s].
          if (it >= STAGES) mbar_wait_cluster(empty + 8 * s, (it / STAGES - 1) & 1);
          const uint32_t bar = full + 8 * s, a = tiles + s * STAGE;
          // REVIEW: the partner's multicast half can complete_tx on this full[s] before this
          // expect_tx (tx-count briefly negative; the pending arrival keeps the phase open, as
          // CUTLASS relies on). A randomized model of this ring (both CTAs, 4 stages, 1-3 tiles, KT
          // 1-8) neither deadlocked nor read a stale slot; the GPU must confirm with 1000^3 (one
          // tile per cluster) and then 4000 x 3000 x 5000 and 2177 x 4104 x 72 (many tiles, KT %
          // STAGES != 0) under run_check's timeout.
          mbar_arrive_expect_tx(bar, STAGE);  // A + both halves of B land on this barrier
          tma_load_2d(a, &map_a, bar, kt * BK, a_row);
          tma_load_2d_multicast(a + TILE_A + rank * B_HALF, &map_b, bar, kt * BK, b_row,
                                static_cast<uint16_t>((1 << CLUSTER) - 1));
        }
      }
    }
  } else {
    // ---- consumers: wgmma on 64 rows each, then the epilogue through shared memory and TMA
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));
    const int c = wg - 1;  // rows 64c .. 64c + 63 of the CTA's tile
    const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
    const bool leader = threadIdx.x % 128 == 0;  // issues this consumer's TMA stores
    const uint32_t my_staging = staging + c * C_STAGE;
    float acc[128];
    int it = 0;  // k-iterations consumed so far, over ALL tiles (the producer's count, in step)
    for (int t = first_tile; t < n_tiles; t += tile_step) {
      int tm, tn;
      cluster_tile(t, tiles_m, tiles_n, tm, tn);
      const int m0 = (tm * CLUSTER + rank) * BM, n0 = tn * BN;
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0.f;
      for (int kt = 0; kt < KT; ++kt, ++it) {
        const int s = it % STAGES;
        mbar_wait(full + 8 * s, (it / STAGES) & 1);
        const uint32_t sA = tiles + s * STAGE + c * 64 * 128, sB = tiles + s * STAGE + TILE_A;
        wgmma_fence();
        fence_operands(acc);
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk)
          wgmma_m64n256k16(acc, desc_k128(sA + kk * 32), desc_k128(sB + kk * 32));
        wgmma_commit();
        wgmma_wait<1>();  // this warp's MMAs of k-iteration it - 1 are done: release its slot
        fence_operands(acc);
        if (kt >= 1 && lane < CLUSTER) mbar_arrive_cluster(empty + 8 * ((it - 1) % STAGES), lane);
      }
      wgmma_wait<0>();
      fence_operands(acc);
      // The tile's last slot (k-iteration it - 1): released now, so the producer can fill it with
      // the next tile's data while this epilogue runs.
      if (lane < CLUSTER) mbar_arrive_cluster(empty + 8 * ((it - 1) % STAGES), lane);

      // Epilogue in BN / EPI_N rounds: fragments -> swizzled staging buffer -> TMA store.
#pragma unroll
      for (int r = 0; r < BN / EPI_N; ++r) {
        if (leader) bulk_wait_read<0>();  // the last store from this buffer has read it
        named_sync(1 + c, 128);
#pragma unroll
        for (int j = 0; j < EPI_N / 8; ++j) {  // 8-column blocks of this round
          const int jj = r * (EPI_N / 8) + j;   // ... and of the whole fragment (store_fragment's j)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = warp * 16 + lane / 4 + 8 * h;  // row in the consumer's 64
            __nv_bfloat162 v = __floats2bfloat162_rn(acc[4 * jj + 2 * h], acc[4 * jj + 2 * h + 1]);
            st_shared_b32(my_staging + staging_offset(row, j, lane), *reinterpret_cast<uint32_t*>(&v));
          }
        }
        fence_proxy_async();  // generic-proxy stores -> async-proxy (TMA) reads
        named_sync(1 + c, 128);
        if (leader) {
          const int row0 = m0 + 64 * c;
#pragma unroll
          for (int b = 0; b < EPI_N / 64; ++b) {
            const int col0 = n0 + r * EPI_N + 64 * b;
            if (row0 < M && col0 < N)  // boxes wholly outside C are not issued; TMA clips the rest
              tma_store_2d(&map_c, my_staging + b * C_BOX, col0, row0);
          }
          bulk_commit();
        }
      }
    }
    if (leader) bulk_wait<0>();  // the last stores have finished before the CTA's memory goes away
  }
  cluster_sync();  // the partner's last remote arrivals on our empty barriers have happened
}

// Clusters of this kernel that fit on the GPU at once, asked once per device (the kernel's shared
// memory limit must be raised first). Falls back to SMs / CLUSTER if the runtime cannot say.
static int hgemm_12_max_clusters() {
  static int cached[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) dev = 0;
  if (cached[dev] == 0) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(hg12::CLUSTER, 1, 1);
    cfg.blockDim = dim3(hg12::NT, 1, 1);
    cfg.dynamicSmemBytes = hg12::SMEM;  // cluster size: the kernel's __cluster_dims__
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, hgemm_persistent_kernel, &cfg) != cudaSuccess || n <= 0) {
      (void)cudaGetLastError();  // not left behind for the caller's launch check
      int sms = 0;
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
      n = sms / hg12::CLUSTER;
    }
    cached[dev] = n > 0 ? n : 1;
  }
  return cached[dev];
}

HgemmLaunch hgemm_12(int M, int N, int K, const bf16* A, const bf16* Bt, bf16* C, int ldc,
                     cudaStream_t s) {
  using namespace hg12;
  HgemmLaunch info{0, 1, NT, SMEM, nullptr};
  CUtensorMap map_a, map_b, map_c;
  if ((info.error = hgemm_tensor_map(&map_a, A, M, K, BM))) return info;
  if ((info.error = hgemm_tensor_map(&map_b, Bt, N, K, B_ROWS))) return info;
  if ((info.error = hgemm_tensor_map(&map_c, C, M, N, 64, ldc))) return info;
  if ((info.error = hgemm_allow_smem(hgemm_persistent_kernel, SMEM))) return info;
  const int tiles = HG_CEIL_DIV(M, CLUSTER * BM) * HG_CEIL_DIV(N, BN);
  // REVIEW: print this on the H100 (<= 66 expected). The fallback SMs / CLUSTER is still correct if
  // not all clusters are co-resident (no cluster waits on another), only slower.
  const int clusters = hgemm_12_max_clusters();
  info.grid_x = CLUSTER * (tiles < clusters ? tiles : clusters);  // a multiple of the cluster size
  hgemm_persistent_kernel<<<info.grid_x, NT, SMEM, s>>>(map_a, map_b, map_c, M, N, K);
  return info;
}
