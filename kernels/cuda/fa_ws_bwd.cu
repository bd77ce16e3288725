// FlashAttention backward with warp specialisation (FlashAttention-3's design), on the machinery of
// the forward (fa_ws.cu, built after it: the TMA loads, the N-major V descriptor, the register-A
// wgmma, exp2_ftz and pack_bf16 come from there). sm_90a only.
//
// One block per 128 keys of one (batch, head); it keeps K and V of those keys in shared memory for
// the whole loop and walks over the query tiles (64 queries per step), streamed by TMA through a
// two-slot ring of Q and dO. Every product of the backward is done once per pair of tiles:
//
//   consumer c (warpgroup 1 + c) owns keys 64c .. 64c + 63 of the block:
//     S^T  = K_c Q^T              wgmma m64n64k16, both from shared memory (K-major)
//     P^T  = exp2(S^T scale - lse) (lse of each query column, log2 units: the forward's)
//     dP^T = V_c dO^T             wgmma m64n64k16, both from shared memory
//     dV_c += P^T dO              wgmma m64n128k16, P^T from registers, dO N-major (like V forward)
//     dS^T = P^T (dP^T - delta)   (delta_q = sum_d dO_qd O_qd, from the prep kernel)
//     dK_c += dS^T Q              wgmma m64n128k16, dS^T from registers, Q N-major
//   both consumers write dS^T (bf16) to shared memory; then consumer c computes columns 64c ..
//   64c + 63 of this step's dQ = dS K (wgmma m64n64k16 with both operands MN-major: dS stored key by
//   key, K with d contiguous) and adds it into an fp32 dQ in global memory with TMA bulk
//   reductions (cp.reduce.async.bulk.tensor .add), one per 8-column box of a staging tile.
//
// Schedules (the kernel's VARIANT bits, kernels/cuda/fa_ws_bwd.py's VARIANTS): with STATS_SMEM the
// producer brings each tile's lse and delta into shared memory with Q and dO (the consumers' global
// loads waited on L2); with DQ_WARPS producer warps 1 and 2 issue the dQ reductions, so a consumer
// only stages its tile and signals; with DS_REGS dS^T is packed into registers of its own, so dK is
// issued while dV still reads P^T; with DS_STMATRIX dS^T is stored by four stmatrix a step.
//
// A prep kernel computes delta, copies lse beside it into rows padded to whole query tiles, and zeroes
// the fp32 dQ first; a convert kernel scales dQ by sm_scale into bf16 afterwards (fa_ws_backward
// launches all three).
//
// Keys past N (the next head's rows in the flattened [BH * N, 128] view) and queries past N get
// P = 0, so they add nothing anywhere; their dK and dV rows are not stored. For queries that needs
// no test in the loop: their padded lse is +inf, so exp2(s - lse) = 0. With the causal mask a
// block starts at the query tile of its first key (earlier queries see none of its keys).

namespace fabwd {
constexpr int BN = 128;  // keys per block (64 per consumer)
constexpr int BM = 64;   // queries per step
constexpr int D = 128, CONSUMERS = 2, NT = 128 * (1 + CONSUMERS);
constexpr int KV_HALF = 128 * 64 * 2;  // one TMA box of K or V: 128 rows x 64 bf16 = 16 KB
constexpr int KV_TILE = 2 * KV_HALF;   // all 128 columns: 32 KB
constexpr int Q_HALF = 64 * 64 * 2;    // one TMA box of Q or dO: 64 rows x 64 bf16 = 8 KB
constexpr int Q_TILE = 2 * Q_HALF;     // 16 KB
constexpr int DS_TILE = BN * BM * 2;   // dS^T, 128 keys x 64 queries bf16: 16 KB (128-byte rows)
constexpr int DQ_HALF = BM * 64 * 4;   // one consumer's dQ staging: 64 queries x 64 fp32 = 16 KB,
constexpr int DQ_COLS = 8;             // as eight TMA boxes of 8 columns: 32-byte rows, no swizzle
constexpr int DQ_BOX = BM * DQ_COLS * 4;
constexpr int ROW_STATS = BM * 4;     // one query tile's lse (or delta): 64 fp32 = 256 bytes
// K, V; per stage Q and dO; dS^T; dQ staging for both consumers; per stage the tile's lse and delta;
// 1 KB of alignment slack; the barriers: K/V full, then per stage Q full, dO full and empty.
constexpr int smem_bytes(int stages) {
  return 2 * KV_TILE + stages * 2 * Q_TILE + DS_TILE + 2 * DQ_HALF + stages * 2 * ROW_STATS + 1024 +
         (1 + 3 * stages) * 8;
}
// The schedule's bits (VARIANT); only combinations that do not spill registers are built:
constexpr int STATS_SMEM = 1;  // the producer bulk-copies each tile's lse and delta into shared memory
constexpr int DQ_WARPS = 2;    // producer warps 1 and 2 issue consumer 0's and 1's dQ reductions
constexpr int DS_REGS = 4;     // dS^T packed into its own registers: dK need not wait for dV
constexpr int DS_STMATRIX = 8; // dS^T stored with stmatrix (4 instructions, 4 addresses a step)
// Named barriers: 1, 2 the dS^T exchange; 3 + c consumer c's dQ staging (without DQ_WARPS); with it
// DQ_FULL + c (staging written) and DQ_EMPTY + c (its reductions have read it), 160 threads each.
constexpr int DQ_FULL = 5, DQ_EMPTY = 7, DQ_THREADS = 128 + 32;
constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = 240;
static_assert(128 * PRODUCER_REGS + 128 * CONSUMERS * CONSUMER_REGS <= 65536, "register file");
static_assert(smem_bytes(3) <= 227 * 1024, "shared memory per block, three ring slots");
}  // namespace fabwd

// The 32 fp32 accumulators of one m64n64 wgmma (operands %0-%31).
#define FB_WGMMA_D32                                                                        \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                 \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define FB_WGMMA_ACC32(d)                                                                           \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),   \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),  \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),  \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

// d[32] (+)= A(64x16) @ B(16x64), both from shared memory; TRANS_A / TRANS_B: the operand is stored
// MN-major (imm-trans = 1) instead of K-major. zero_d: overwrite d instead of adding to it.
template <int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t a, uint64_t b, bool zero_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.eq.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16\n" FB_WGMMA_D32
      ", %32, %33, p, 1, 1, %35, %36;\n}\n"
      : FB_WGMMA_ACC32(d)
      : "l"(a), "l"(b), "r"(static_cast<int>(zero_d)), "n"(TRANS_A), "n"(TRANS_B)
      : "memory");
}

// The loop's wgmma descriptors as 32-bit halves of fa_ws.cu's desc_mn (desc_k128 is desc_mn with a
// leading offset of 16 bytes): the start address >> 4 in bits 0-13 and the leading offset in bits
// 16-29 of the low word; the high word (stride 1024 B, the 128-byte swizzle) is the same for every
// operand. Every tile here is 1024-byte aligned, so a tile's low word plus (offset >> 4) is the low
// word at that offset: one integer add per wgmma instead of the whole descriptor rebuilt from a
// masked address (about 200 uniform-datapath instructions a step). desc_mn(0, ...) folds to constants.
namespace fabwd {
__device__ __forceinline__ uint32_t desc_lo(uint32_t smem_addr, uint32_t lbo) {
  return (smem_addr >> 4) + static_cast<uint32_t>(desc_mn(0, lbo));
}
__device__ __forceinline__ uint64_t desc(uint32_t lo) {
  return (desc_mn(0) & ~0xFFFFFFFFull) | lo;
}
}  // namespace fabwd

// One contiguous run of `bytes` bytes (a multiple of 16, both addresses 16-byte aligned) from global
// into shared memory, completing that many transaction bytes on `bar` (a non-tensor TMA copy).
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
// A 128-column tile as two TMA boxes (fa_ws.cu's load_tile) and, on the same barrier, one row of
// statistics (ROW_STATS bytes).
__device__ __forceinline__ void load_tile_and_stats(uint32_t dst, const CUtensorMap* map, uint32_t full, int row,
                                                    uint32_t stats_dst, const float* stats_src) {
  using namespace fabwd;
  mbar_arrive_expect_tx(full, 2 * Q_HALF + ROW_STATS);
  tma_load_2d(dst, map, full, 0, row);
  tma_load_2d(dst + Q_HALF, map, full, 64, row);
  bulk_load(stats_dst, stats_src, ROW_STATS, full);
}
__device__ __forceinline__ float2 ld_shared_f2(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// The eight TMA reductions (boxes of 8 columns) of one consumer's staged dQ tile into rows q_row..
// of the fp32 accumulator, columns 64c.., committed as one bulk group.
__device__ __forceinline__ void reduce_dq(const CUtensorMap* map_dq, uint32_t stage, int c, int q_row) {
  using namespace fabwd;
#pragma unroll
  for (int box = 0; box < 64 / DQ_COLS; ++box)
    asm volatile(
        "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
            reinterpret_cast<uint64_t>(map_dq)),
        "r"(64 * c + DQ_COLS * box), "r"(q_row), "r"(stage + box * DQ_BOX)
        : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

// One consumer's rows.
struct BwdConsumer {
  int c, warp, lane;
  int key[2];  // the two key rows (within the head) of every fragment this thread holds
};

// X^T = A_c B^T for one query tile, 64 keys x 64 queries (issued, not waited for): A_c is the
// consumer's 64 rows of K or V (in the 128-row boxes of the resident tile), B the Q or dO tile; both
// K-major, given as desc_lo(tile, 16) (desc_k128's low word).
__device__ __forceinline__ void issue_keys_by_queries(float (&x)[32], uint32_t a_lo, uint32_t b_lo) {
  using namespace fabwd;
  wgmma_fence();
  fence_operands(x);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    wgmma_m64n64k16_ss<0, 0>(x, desc(a_lo + (((kk / 4) * KV_HALF + (kk % 4) * 32) >> 4)),
                             desc(b_lo + (((kk / 4) * Q_HALF + (kk % 4) * 32) >> 4)), kk == 0);
  wgmma_commit();
}

// acc[64 keys x 128] += X^T (registers, 64 keys x 64 queries) @ B (the Q or dO tile, 64 queries x
// 128, d contiguous: N-major, given as desc_lo(tile, Q_HALF)), issued, not waited for.
__device__ __forceinline__ void issue_keys_by_d(float (&acc)[64], const uint32_t (&x)[fabwd::BM / 16][4],
                                                uint32_t b_lo) {
  using namespace fabwd;
  wgmma_fence();
  fence_operands(acc);
#pragma unroll
  for (int t = 0; t < BM / 16; ++t) wgmma_m64n128k16_rs(acc, x[t], desc(b_lo + ((t * 16 * 128) >> 4)));
  wgmma_commit();
}

// x[32] as the A operand of an m64n*k16 wgmma, k16 slice t = fragment blocks 2t and 2t + 1 (as
// pack_p in fa_ws.cu, for 64 columns).
__device__ __forceinline__ void pack_a(uint32_t (&a)[fabwd::BM / 16][4], const float (&x)[32]) {
#pragma unroll
  for (int t = 0; t < fabwd::BM / 16; ++t) {
    a[t][0] = pack_bf16(x[8 * t + 0], x[8 * t + 1]);
    a[t][1] = pack_bf16(x[8 * t + 2], x[8 * t + 3]);
    a[t][2] = pack_bf16(x[8 * t + 4], x[8 * t + 5]);
    a[t][3] = pack_bf16(x[8 * t + 6], x[8 * t + 7]);
  }
}

// Fragment element 4 * jj + 2 * h + e of a 64 x 64 accumulator: key row me.key[h], query column
// q0 + 8 * jj + 2 * (lane % 4) + e.
__device__ __forceinline__ int query_of(const BwdConsumer& me, int q0, int jj, int e) {
  return q0 + 8 * jj + 2 * (me.lane % 4) + e;
}

// dS^T (bf16 pairs, the A fragments) into the shared 128 x 64 tile of dS^T: key row 64c + r, query
// columns in 128-byte swizzled rows, the layout the dQ product reads as its MN-major A operand.
// STMATRIX: one stmatrix.x4 per k16 slice t instead of 16 32-bit stores (the four 8 x 8 matrices of
// a[t] are rows r0 .. r0 + 7 and r0 + 8 .., columns 16t .. and 16t + 8 ..; lane l gives the address of
// row l % 8 of matrix l / 8).
template <bool STMATRIX>
__device__ __forceinline__ void store_ds(uint32_t ds_tile, const uint32_t (&a)[fabwd::BM / 16][4],
                                         const BwdConsumer& me) {
  if (STMATRIX) {
    const int j = me.lane / 8, row = 64 * me.c + 16 * me.warp + me.lane % 8 + 8 * (j & 1);
#pragma unroll
    for (int t = 0; t < fabwd::BM / 16; ++t)
      asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                       ds_tile + swizzle_128b(row, 2 * t + (j >> 1))),
                   "r"(a[t][0]), "r"(a[t][1]), "r"(a[t][2]), "r"(a[t][3])
                   : "memory");
    return;
  }
  const int r = 64 * me.c + 16 * me.warp + me.lane / 4;
#pragma unroll
  for (int t = 0; t < fabwd::BM / 16; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = r + 8 * (i & 1);    // a[t][0], a[t][2]: row r; a[t][1], a[t][3]: row r + 8
      const int chunk = 2 * t + (i >> 1);  // 8 queries per 16-byte chunk: columns 16t (+ 8)
      const uint32_t addr = ds_tile + swizzle_128b(row, chunk) + 4 * (me.lane % 4);
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(a[t][i]) : "memory");
    }
}

// STAGES: slots of the Q/dO ring (2 or 3); VARIANT: the schedule's bits. group_heads > 0: a 1-D grid,
// blocks ordered in groups of that many heads, key tiles of a group ascending (with the causal mask,
// the longest first), heads fastest within a key tile; 0: the 2-D grid (key tiles fastest, then heads).
template <bool CAUSAL, int STAGES, int VARIANT>
__global__ void __launch_bounds__(fabwd::NT, 1)
    fa_ws_bwd_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                     const __grid_constant__ CUtensorMap map_v, const __grid_constant__ CUtensorMap map_do,
                     const __grid_constant__ CUtensorMap map_dq, const float* __restrict__ lse_pad,
                     const float* __restrict__ delta_pad, bf16* __restrict__ dK, bf16* __restrict__ dV, int N,
                     int n_pad, float qk_scale, float sm_scale, int BH, int group_heads) {
  using namespace fabwd;
  extern __shared__ uint8_t smem[];
  const uint32_t k_tile = smem_base_1024(smem), v_tile = k_tile + KV_TILE;
  const uint32_t ring = v_tile + KV_TILE;  // per stage: Q tile, then dO tile
  const uint32_t ds_tile = ring + STAGES * 2 * Q_TILE, dq_stage = ds_tile + DS_TILE;
  // Per stage the tile's lse (ROW_STATS bytes), then its delta.
  const uint32_t row_stats = dq_stage + 2 * DQ_HALF;
  const uint32_t kv_full = row_stats + STAGES * 2 * ROW_STATS, q_full = kv_full + 8,
                 do_full = q_full + STAGES * 8, empty = do_full + STAGES * 8;
  constexpr bool stats_smem = VARIANT & STATS_SMEM, dq_warps = VARIANT & DQ_WARPS, ds_regs = VARIANT & DS_REGS;
  int key_tile = blockIdx.x, bh = blockIdx.y;
  if (group_heads > 0) {
    const int key_tiles = HG_CEIL_DIV(N, BN), per_group = group_heads * key_tiles;
    const int group = blockIdx.x / per_group, r = blockIdx.x % per_group;
    const int in_group = min(group_heads, BH - group * group_heads);
    key_tile = r / in_group;
    bh = group * group_heads + r % in_group;
  }
  const int key0 = key_tile * BN;
  const int wg = threadIdx.x / 128;
  // Queries before key0 see none of this block's keys (causal): start at its first query tile.
  const int first = CAUSAL ? key0 / BM : 0, steps = HG_CEIL_DIV(N, BM) - first;

  if (threadIdx.x == 0) {
    mbar_init(kv_full, 2);  // the K tile's arrival and the V tile's
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(q_full + 8 * s, 1);
      mbar_init(do_full + 8 * s, 1);
      mbar_init(empty + 8 * s, CONSUMERS * 4);
    }
    mbar_fence_init();
  }
  __syncthreads();

  if (wg == 0) {
    // ---- producer: K and V once, then Q and dO tile by tile through the ring
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
    if (threadIdx.x == 0) {
      // K and V on one barrier: two arrivals (one per tile) and their bytes.
      load_tile(k_tile, &map_k, kv_full, bh * N + key0, KV_HALF);
      load_tile(v_tile, &map_v, kv_full, bh * N + key0, KV_HALF);
      for (int i = 0; i < steps; ++i) {
        const int s = i % STAGES;
        if (i >= STAGES) mbar_wait(empty + 8 * s, (i / STAGES - 1) & 1);
        const uint32_t q_slot = ring + s * 2 * Q_TILE, do_slot = q_slot + Q_TILE;
        const int q0 = (first + i) * BM, q_row = bh * N + q0;
        if (stats_smem) {
          const int64_t at = static_cast<int64_t>(bh) * n_pad + q0;
          const uint32_t lse_slot = row_stats + s * 2 * ROW_STATS;
          load_tile_and_stats(q_slot, &map_q, q_full + 8 * s, q_row, lse_slot, lse_pad + at);
          load_tile_and_stats(do_slot, &map_do, do_full + 8 * s, q_row, lse_slot + ROW_STATS, delta_pad + at);
        } else {
          load_tile(q_slot, &map_q, q_full + 8 * s, q_row, Q_HALF);  // two boxes of 64 rows
          load_tile(do_slot, &map_do, do_full + 8 * s, q_row, Q_HALF);
        }
      }
    } else if (dq_warps && threadIdx.x >= 32 && threadIdx.x < 32 * (1 + CONSUMERS)) {
      // Warp 1 + c adds consumer c's staged dQ tile of each step into the fp32 accumulator, and
      // frees the staging once the reductions have read it.
      const int c = __shfl_sync(0xffffffffu, threadIdx.x / 32, 0) - 1;
      const uint32_t stage = dq_stage + c * DQ_HALF;
      for (int i = 0; i < steps; ++i) {
        named_sync(DQ_FULL + c, DQ_THREADS);
        if (threadIdx.x % 32 == 0) {
          reduce_dq(&map_dq, stage, c, bh * N + (first + i) * BM);
          asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
        }
        __syncwarp();
        if (i + 1 < steps) bar_arrive(DQ_EMPTY + c, DQ_THREADS);
      }
      if (threadIdx.x % 32 == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    }
  } else {
    // ---- consumers
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));
    // Broadcast from lane 0 so the compiler knows c is the same in the whole warp: the tile
    // addresses and descriptors built from it then live in uniform registers.
    const int c = __shfl_sync(0xffffffffu, wg, 0) - 1;
    BwdConsumer me;
    me.c = c;
    me.warp = (threadIdx.x % 128) / 32;
    me.lane = threadIdx.x % 32;
    me.key[0] = key0 + 64 * c + 16 * me.warp + me.lane / 4;
    me.key[1] = me.key[0] + 8;
    const uint32_t k_lo = desc_lo(k_tile + c * 64 * 128, 16), v_lo = desc_lo(v_tile + c * 64 * 128, 16);
    const uint32_t ds_lo = desc_lo(ds_tile, Q_HALF), kc_lo = desc_lo(k_tile + c * KV_HALF, KV_HALF);
    // This thread's first query column in a tile; lse and delta of its 16 columns are 8 float2
    // loads at constant offsets from it.
    const float* lse_row = lse_pad + static_cast<int64_t>(bh) * n_pad + 2 * (me.lane % 4);
    const float* delta_row = delta_pad + static_cast<int64_t>(bh) * n_pad + 2 * (me.lane % 4);
    // The staging of this consumer's dQ columns: box jj (columns 8jj ..), row q at 32 q bytes.
    const uint32_t stage = dq_stage + c * DQ_HALF;
    const uint32_t dq_at = stage + (16 * me.warp + me.lane / 4) * 32 + 8 * (me.lane % 4);
    // With STATS_SMEM: this thread's first lse in a ring slot's row of statistics (delta ROW_STATS on).
    const uint32_t stats_at = row_stats + 8 * (me.lane % 4);
    float dk[64], dv[64], x[32], y[32];
    uint32_t a[BM / 16][4], b[BM / 16][4];  // P^T, and with DS_REGS dS^T, as A operands
#pragma unroll
    for (int i = 0; i < 64; ++i) dk[i] = dv[i] = 0.f;
    mbar_wait(kv_full, 0);

    for (int i = 0; i < steps; ++i) {
      const int s = i % STAGES;
      const uint32_t parity = (i / STAGES) & 1;
      const uint32_t q_slot = ring + s * 2 * Q_TILE, do_slot = q_slot + Q_TILE;
      const int q0 = (first + i) * BM;
      // S^T = K_c Q^T and dP^T = V_c dO^T issued back to back; meanwhile this thread's lse and
      // delta (16 query columns each).
      const uint32_t q_lo = desc_lo(q_slot, 16), do_lo = desc_lo(do_slot, 16);
      mbar_wait(q_full + 8 * s, parity);
      issue_keys_by_queries(x, k_lo, q_lo);
      mbar_wait(do_full + 8 * s, parity);
      issue_keys_by_queries(y, v_lo, do_lo);
      const uint32_t lse_at = stats_at + s * 2 * ROW_STATS;
      float2 lse_q[BM / 8], delta_q[BM / 8];
#pragma unroll
      for (int jj = 0; jj < BM / 8; ++jj) {
        if (stats_smem) {
          lse_q[jj] = ld_shared_f2(lse_at + 32 * jj);
        } else {
          lse_q[jj] = *reinterpret_cast<const float2*>(lse_row + q0 + 8 * jj);
          delta_q[jj] = *reinterpret_cast<const float2*>(delta_row + q0 + 8 * jj);
        }
      }
      wgmma_wait<1>();  // S^T is done; dP^T may still run while P is computed
      fence_operands(x);
      // P^T = exp2(S^T * scale - lse): 0 for a query past N (lse +inf); set to 0 where the key is
      // past N or (causal) after the query.
      const bool edge = key0 + BN > N || (CAUSAL && q0 < key0 + BN);
#pragma unroll
      for (int jj = 0; jj < BM / 8; ++jj)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& p = x[4 * jj + 2 * h + e];
            p = exp2_ftz(fmaf(p, qk_scale, -(e ? lse_q[jj].y : lse_q[jj].x)));
            if (edge) {
              const int q = query_of(me, q0, jj, e);
              if (me.key[h] >= N || (CAUSAL && me.key[h] > q)) p = 0.f;
            }
          }
      pack_a(a, x);
      wgmma_wait<0>();
      fence_operands(y);
      // dV_c += P^T dO
      issue_keys_by_d(dv, a, desc_lo(do_slot, Q_HALF));
      // dS^T = P^T (dP^T - delta)
#pragma unroll
      for (int jj = 0; jj < BM / 8; ++jj) {
        if (stats_smem) delta_q[jj] = ld_shared_f2(lse_at + ROW_STATS + 32 * jj);
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int k = 4 * jj + 2 * h + e;
            y[k] = x[k] * (y[k] - (e ? delta_q[jj].y : delta_q[jj].x));
          }
      }
      // dS^T packed: into b while dV's product still reads a (DS_REGS), or into a once it is done.
      uint32_t(&ds)[BM / 16][4] = ds_regs ? b : a;
      if (!ds_regs) {
        wgmma_wait<0>();  // dV's product read the packed P: now a may be overwritten
        fence_operands(dv);
      }
      pack_a(ds, y);
      // dS^T to shared memory, once the other consumer's previous dQ product is done with it, and
      // before the dK product takes it as its operand (registers an in-flight wgmma reads may not
      // be accessed until it is waited for).
      named_sync(1, 256);
      store_ds<(VARIANT & DS_STMATRIX) != 0>(ds_tile, ds, me);
      fence_proxy_async();
      // dK_c += dS^T Q, then (both consumers' dS^T in shared memory) dQ[:, 64c .. 64c + 63] =
      // dS K_{:, 64c ..} into x (P is dead): A = dS^T stored key-major (MN-major A), B = the K box
      // c, d contiguous (MN-major B); 8 k16 slices of 16 keys. One wait for all.
      issue_keys_by_d(dk, ds, desc_lo(q_slot, Q_HALF));
      named_sync(2, 256);
      wgmma_fence();
      fence_operands(x);
#pragma unroll
      for (int t = 0; t < BN / 16; ++t)
        wgmma_m64n64k16_ss<1, 1>(x, desc(ds_lo + ((t * 16 * 128) >> 4)), desc(kc_lo + ((t * 16 * 128) >> 4)),
                                 t == 0);
      wgmma_commit();
      wgmma_wait<0>();
      fence_operands(dk);
      fence_operands(dv);
      fence_operands(x);
      if (me.lane == 0) mbar_arrive(empty + 8 * s);  // Q and dO of this slot are no longer read
      // This consumer's staging tile is free once its previous reduction has read it.
      if (dq_warps) {
        if (i > 0) named_sync(DQ_EMPTY + c, DQ_THREADS);
      } else {
        if (threadIdx.x % 128 == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
        named_sync(3 + c, 128);
      }
      // Eight boxes of 8 columns, 32-byte rows: each half-warp's 8-byte stores cover four whole rows,
      // 128 contiguous bytes, so no two of its threads share a bank. (Two boxes of 32 columns in
      // 128-byte swizzled rows put rows r and r ^ 1 on the same banks: two-way conflicts, 68 M of
      // them at 8,192 tokens in Nsight Compute.)
#pragma unroll
      for (int jj = 0; jj < 8; ++jj)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(dq_at + jj * DQ_BOX + h * 8 * 32),
                       "f"(x[4 * jj + 2 * h]), "f"(x[4 * jj + 2 * h + 1])
                       : "memory");
      fence_proxy_async();
      if (dq_warps) {
        bar_arrive(DQ_FULL + c, DQ_THREADS);  // producer warp 1 + c issues the reductions
      } else {
        named_sync(3 + c, 128);
        if (threadIdx.x % 128 == 0) reduce_dq(&map_dq, stage, c, bh * N + q0);
      }
    }
    if (!dq_warps && threadIdx.x % 128 == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");

    // dK (times sm_scale: s = sm_scale q.k) and dV of the rows this thread holds, rows past N not.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (me.key[h] >= N) continue;
      const int64_t base = (static_cast<int64_t>(bh) * N + me.key[h]) * D;
#pragma unroll
      for (int jj = 0; jj < D / 8; ++jj) {
        const int col = 8 * jj + 2 * (me.lane % 4);
        *reinterpret_cast<__nv_bfloat162*>(dK + base + col) =
            __floats2bfloat162_rn(dk[4 * jj + 2 * h] * sm_scale, dk[4 * jj + 2 * h + 1] * sm_scale);
        *reinterpret_cast<__nv_bfloat162*>(dV + base + col) =
            __floats2bfloat162_rn(dv[4 * jj + 2 * h], dv[4 * jj + 2 * h + 1]);
      }
    }
  }
}

// The fp32 dQ as a TMA target of 64-row x 8-column boxes, unswizzled like the staging tile.
static const char* fabwd_dq_map(CUtensorMap* map, float* dq, int rows) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = hgemm_encode_tiled();
  if (encode == nullptr) return "cuTensorMapEncodeTiled not found";
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(fabwd::D), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {fabwd::D * sizeof(float)};
  const cuuint32_t box[2] = {fabwd::DQ_COLS, fabwd::BM};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult rc = encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, dq, dims, strides, box, elem_strides,
                             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return rc == CUDA_SUCCESS ? nullptr : "cuTensorMapEncodeTiled rejected the dQ tensor map";
}

// Before the main kernel, one warp per query row of the padded [BH, n_pad] statistics (n_pad = N
// rounded up to whole query tiles): delta_i = sum_d dO_id O_id in fp32 (the row term of dS = P (dP -
// delta)) and lse_i beside it, and that row of the fp32 dQ accumulator zeroed (one read of O and dO,
// one write of the accumulator; the torch code it replaces ran five kernels: two fp32 casts of O and
// dO, their product, the row sum and the zeros).
// Rows i >= N get lse = +inf and delta = 0, so the main kernel's P is 0 there without a test.
__global__ void fa_ws_bwd_prep_kernel(const bf16* __restrict__ O, const bf16* __restrict__ dO,
                                      const float* __restrict__ lse, float* __restrict__ lse_pad,
                                      float* __restrict__ delta_pad, float* __restrict__ dq_acc, int N,
                                      int n_pad, int padded_rows) {
  const int at_pad = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (at_pad >= padded_rows) return;
  const int i = at_pad % n_pad, row = (at_pad / n_pad) * N + i;
  if (i >= N) {
    if (lane == 0) lse_pad[at_pad] = __int_as_float(0x7f800000), delta_pad[at_pad] = 0.f;
    return;
  }
  const int64_t at = static_cast<int64_t>(row) * fabwd::D + 4 * lane;  // 4 of the 128 columns
  const uint2 o = *reinterpret_cast<const uint2*>(O + at), g = *reinterpret_cast<const uint2*>(dO + at);
  const float2 o0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&o.x)),
               o1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&o.y)),
               g0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&g.x)),
               g1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&g.y));
  float sum = o0.x * g0.x + o0.y * g0.y + o1.x * g1.x + o1.y * g1.y;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) delta_pad[at_pad] = sum, lse_pad[at_pad] = lse[row];
  *reinterpret_cast<float4*>(dq_acc + at) = make_float4(0.f, 0.f, 0.f, 0.f);
}

// After it: dQ = sm_scale * the accumulator (dS carries no factor of sm_scale), rounded once to
// bf16, eight elements per thread.
__global__ void fa_ws_bwd_dq_kernel(const float* __restrict__ dq_acc, bf16* __restrict__ dQ, int64_t n8,
                                    float sm_scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n8;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 a = *reinterpret_cast<const float4*>(dq_acc + 8 * i),
                 b = *reinterpret_cast<const float4*>(dq_acc + 8 * i + 4);
    const uint4 out = {pack_bf16(a.x * sm_scale, a.y * sm_scale), pack_bf16(a.z * sm_scale, a.w * sm_scale),
                       pack_bf16(b.x * sm_scale, b.y * sm_scale), pack_bf16(b.z * sm_scale, b.w * sm_scale)};
    *reinterpret_cast<uint4*>(dQ + 8 * i) = out;
  }
}

// Q, K, V, O, dO, dQ, dK, dV: [BH * N, 128] bf16 row-major; lse: [BH * N] fp32 (log2 units, from the
// forward); stats [2, BH, fabwd_padded(N)] (lse and delta padded) and dq_acc [BH * N, 128]: fp32
// workspaces. Three launches on stream s: prep, the backward, the dQ conversion. nullptr when they
// launched.
constexpr int fabwd_padded(int N) { return HG_CEIL_DIV(N, fabwd::BM) * fabwd::BM; }
const char* fa_ws_backward(const bf16* Q, const bf16* K, const bf16* V, const bf16* O, const bf16* dO,
                           const float* lse, float* stats, float* dq_acc, bf16* dQ, bf16* dK, bf16* dV,
                           int BH, int N, float qk_scale, float sm_scale, bool causal, int stages,
                           int group_heads, int variant, cudaStream_t s) {
  using namespace fabwd;
  CUtensorMap map_q, map_k, map_v, map_do, map_dq;
  const char* err;
  if ((err = hgemm_tensor_map(&map_q, Q, BH * N, D, BM))) return err;
  if ((err = hgemm_tensor_map(&map_do, dO, BH * N, D, BM))) return err;
  if ((err = hgemm_tensor_map(&map_k, K, BH * N, D, BN))) return err;
  if ((err = hgemm_tensor_map(&map_v, V, BH * N, D, BN))) return err;
  if ((err = fabwd_dq_map(&map_dq, dq_acc, BH * N))) return err;
  if (stages != 2 && stages != 3) return "stages must be 2 or 3";
  using Kernel = decltype(&fa_ws_bwd_kernel<false, 2, 0>);
  Kernel kernel = nullptr;
#define FB_CASE(V)                                                                                  \
  case V:                                                                                           \
    kernel = causal ? (stages == 2 ? fa_ws_bwd_kernel<true, 2, V> : fa_ws_bwd_kernel<true, 3, V>)   \
                    : (stages == 2 ? fa_ws_bwd_kernel<false, 2, V> : fa_ws_bwd_kernel<false, 3, V>); \
    break;
  switch (variant) {
    FB_CASE(0) FB_CASE(1) FB_CASE(9) FB_CASE(11) FB_CASE(13) FB_CASE(15)
    default: return "variant must be 0, 1, 9, 11, 13 or 15";
  }
#undef FB_CASE
  const int smem = smem_bytes(stages);
  if ((err = hgemm_allow_smem(kernel, smem))) return err;
  const int rows = BH * N, n_pad = fabwd_padded(N), padded_rows = BH * n_pad;
  float *lse_pad = stats, *delta_pad = stats + padded_rows;
  fa_ws_bwd_prep_kernel<<<HG_CEIL_DIV(padded_rows, 8), 256, 0, s>>>(O, dO, lse, lse_pad, delta_pad, dq_acc, N,
                                                                     n_pad, padded_rows);
  const dim3 grid = group_heads > 0 ? dim3(HG_CEIL_DIV(N, BN) * BH) : dim3(HG_CEIL_DIV(N, BN), BH);
  kernel<<<grid, NT, smem, s>>>(map_q, map_k, map_v, map_do, map_dq, lse_pad, delta_pad, dK, dV, N, n_pad,
                                qk_scale, sm_scale, BH, group_heads);
  const int64_t n8 = static_cast<int64_t>(rows) * D / 8;
  const int64_t blocks = HG_CEIL_DIV(n8, 256);
  fa_ws_bwd_dq_kernel<<<static_cast<int>(blocks < 4096 ? blocks : 4096), 256, 0, s>>>(dq_acc, dQ, n8, sm_scale);
  return nullptr;
}
