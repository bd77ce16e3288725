// FlashAttention forward with warp specialisation, on the machinery of hgemm step 11 (wgmma, TMA into
// an mbarrier ring, a producer warpgroup that gives its registers to two consumer warpgroups). Built
// after hgemm_common.cuh, for sm_90a only.
//
// O = softmax(Q K^T * scale) V for bf16 Q, K, V of head dimension D = 128, one program per 128 query
// rows of one (batch, head), fp32 accumulation, bf16 O and the log2-domain log-sum-exp of every row
// (lse = m + log2(l), scores in units of scale * log2(e): kernels/flash_attention.py's convention, so
// its backward can take this forward's lse).
//
//  - warpgroup 0, the producer: one thread loads the block's Q tile once, then K and V tiles of 128
//    keys into a 2-slot ring. K and V have a full barrier each, so the scores can start before V lands.
//  - warpgroups 1 and 2, the consumers: each owns 64 query rows. Per key tile: S = Q K^T with eight
//    wgmma m64n128k16 (A = Q and B = K from shared memory, both K-major over d); mask, scale, online
//    softmax in registers (each row lives in the 4 lanes of a quad: two shuffles reduce it); then
//    O += P V with eight wgmma m64n128k16 whose A operand, P, comes from *registers*: the accumulator
//    layout of S is, pair by pair, the A-fragment layout of the next MMA (PTX ISA, "register fragment
//    for matrix A"), so P is only rounded to bf16 and packed, never stored.
//
// V is read as it lies, [N, D] with d contiguous: for O += P V that is B stored N-major (the output
// dimension d contiguous, not the reduction dimension, the keys), which wgmma takes from shared
// memory with its transpose bit (imm-trans-b = 1) and a descriptor whose strides say so
// (desc_mn). The V tile then arrives exactly like a K tile, two 64-column TMA boxes of 128 key
// rows, and no copy of V is made (an earlier version transposed V in the binding: 12% of the time
// at N = 8192, in a copy kernel at 15% of DRAM bandwidth).
//
// Two schedules (the template's OVERLAP): "plain" waits for each product in turn, so the tensor cores
// idle during every softmax; "overlap" is FlashAttention-3's: within a consumer, the softmax of key
// tile j runs while the tensor cores do P V of tile j - 1 (issued together with S of tile j), and the
// two consumers take turns to issue their products through named barriers (ping-pong), so that one's
// softmax hides behind the other's MMAs.
//
// Rows of the last query block past N belong to the next head in the flattened [B*H*N, D] view: they
// are computed and not stored. Keys past N (the last key tile's tail, or the next head's rows) are
// masked to -inf before the softmax, so their P is exactly 0 whatever V holds there (another
// head's rows, or TMA's zero fill past the tensor's end).

#include <type_traits>  // std::true_type / std::false_type: the masked tile, chosen at compile time

namespace faws {
constexpr int BM = 128, BN = 128, D = 128, STAGES = 2, CONSUMERS = 2, NT = 128 * (1 + CONSUMERS);
constexpr int HALF = 128 * 64 * 2;  // one TMA box: 128 rows x 64 bf16 (128-byte swizzled rows)
constexpr int TILE = 2 * HALF;      // a 128 x 128 tile as two boxes side by side: 32 KB
// Q, then per stage K and V; 1 KB of alignment slack; the barriers: Q full, then full K, full V and
// empty per stage (and one spare 8-byte slot: the persistent kernel's Q empty before it had a layout
// of its own).
constexpr int SMEM = TILE + STAGES * 2 * TILE + 1024 + (2 + 3 * STAGES) * 8;
// The persistent kernel keeps two Q tiles (the next tile's Q lands while this one runs); its
// barriers: Q full for each slot, Q empty for each slot, then full K, full V and empty per stage.
constexpr int Q_SLOTS = 2;
constexpr int SMEM_PERSISTENT =
    Q_SLOTS * TILE + STAGES * 2 * TILE + 1024 + (2 * Q_SLOTS + 3 * STAGES) * 8;
constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;
// The persistent kernel's tiles per group of heads (about two waves of blocks on an H100).
constexpr int GROUP_TILES = 256;
static_assert(128 * PRODUCER_REGS + 128 * CONSUMERS * CONSUMER_REGS <= 65536, "register file");
static_assert(SMEM <= 227 * 1024 && SMEM_PERSISTENT <= 227 * 1024, "shared memory per block");
// With square tiles only a block's last key tile holds keys past its rows (the diagonal, causal) or
// past N: the softmax masks that tile alone.
static_assert(BM == BN, "the masked tile is the last one");
}  // namespace faws

// The producer's copies. A tile of 128 columns arrives as two 64-column TMA boxes (128-byte
// swizzled rows) of `half` bytes each (a 128-row box by default), and its full barrier expects both.
__device__ __forceinline__ void load_tile(uint32_t dst, const CUtensorMap* map, uint32_t full, int row,
                                          uint32_t half = faws::HALF) {
  mbar_arrive_expect_tx(full, 2 * half);
  tma_load_2d(dst, map, full, 0, row);
  tma_load_2d(dst + half, map, full, 64, row);
}
// Ring slot s: the K tile and the V tile of the same 128 key rows, each with its own full barrier
// (so the scores can start before V lands).
__device__ __forceinline__ void load_kv(uint32_t kv, uint32_t k_full, uint32_t v_full, uint32_t s,
                                        const CUtensorMap* map_k, const CUtensorMap* map_v, int k_row) {
  using namespace faws;
  const uint32_t k_tile = kv + s * 2 * TILE;
  load_tile(k_tile, map_k, k_full + 8 * s, k_row);
  load_tile(k_tile + TILE, map_v, v_full + 8 * s, k_row);
}

// The descriptor of a 16 x 128 B operand stored N-major with the 128-byte swizzle: 16 rows of keys
// (k) at 128 bytes each, every row 64 of the 128 columns (n), the other 64 in the box `lbo` bytes on
// (HALF for a 128-row tile of K or V; the backward also reads 64-row tiles and its dS^T this way).
// PTX ISA, "Matrix Descriptor" for MN-major swizzled layouts: the leading byte offset steps from one
// 64-column swizzle atom to the next along n (lbo), the stride byte offset from one 8-row group to
// the next along k (1024 bytes).
__device__ __forceinline__ uint64_t desc_mn(uint32_t smem_addr, uint32_t lbo = faws::HALF) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (1ull << 62);
}

// d[64] += A(64x16, registers a[4]) @ B(16x128, descriptor b): A from registers, B N-major
// (imm-trans-b = 1: see desc_mn). The four 32-bit registers hold A's bf16 pairs: rows r and
// r + 8 (r = 16 * warp + lane / 4), columns 2 * (lane % 4) + {0, 1} and 8 + 2 * (lane % 4) + {0, 1},
// in the order (r, lo), (r + 8, lo), (r, hi), (r + 8, hi).
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16\n" HG_WGMMA_D64
      ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : HG_WGMMA_ACC64(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1)
      : "memory");
}

// d[64] = A @ B (zero_d) or d[64] += A @ B: wgmma_m64n128k16 of hgemm_common.cuh with scale-d as a
// run-time predicate, so that the first k16 slice of S = Q K^T overwrites the accumulators instead
// of 64 register moves zeroing them per key tile.
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], uint64_t a, uint64_t b, bool zero_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.eq.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16\n" HG_WGMMA_D64
      ", %64, %65, p, 1, 1, 0, 0;\n}\n"
      : HG_WGMMA_ACC64(d)
      : "l"(a), "l"(b), "r"(static_cast<int>(zero_d))
      : "memory");
}

// 2^x in one MUFU.EX2: exp2f() without --use_fast_math wraps it in a range check and two multiplies
// (denormal results), four extra instructions per score; flushing those to zero costs nothing here
// (P is rounded to bf16, and l sums values near 1).
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// The largest / the sum over the 4 lanes of a quad: the 4 threads that hold one row of a fragment.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// Named barriers 1 and 2 pass the tensor cores between the two consumers (ping-pong): bar.sync waits
// for 256 arrivals, its own warpgroup's 128 and the other's 128 bar.arrive.
// (The backward also waits on barriers of one warpgroup: `threads` = 128.)
__device__ __forceinline__ void named_sync(int id, int threads = 256) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id) {
  asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory");
}

// One consumer's view of the work: its 64 query rows, the rows this thread holds, the scale.
struct Consumer {
  uint32_t q_rows;  // this consumer's 64 rows of Q in box 0 (box 1 is HALF further)
  int row[2];       // the two rows of every fragment this thread holds
  int lane, N;
  float qk_scale;
};

// S = Q K^T for one key tile (issued, not waited for): k16 slice kk of d is 32 bytes into box kk / 4.
__device__ __forceinline__ void issue_qk(float (&sc)[64], const Consumer& me, uint32_t k_tile) {
  using namespace faws;
  wgmma_fence();
  fence_operands(sc);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    wgmma_m64n128k16_ss(sc, desc_k128(me.q_rows + (kk / 4) * HALF + (kk % 4) * 32),
                        desc_k128(k_tile + (kk / 4) * HALF + (kk % 4) * 32), kk == 0);
  wgmma_commit();
}

// O += P V for one key tile (issued, not waited for): P in registers; the k16 slice t of V is its
// key rows 16t .. 16t + 15, 2,048 bytes into each box.
__device__ __forceinline__ void issue_pv(float (&o)[64], const uint32_t (&p)[faws::BN / 16][4],
                                         uint32_t v_tile) {
  using namespace faws;
  wgmma_fence();  // P's registers and the rescaled O were written by ordinary instructions
  fence_operands(o);
#pragma unroll
  for (int t = 0; t < BN / 16; ++t)
    wgmma_m64n128k16_rs(o, p[t], desc_mn(v_tile + t * 16 * 128));
  wgmma_commit();
}

// The online softmax of key tile j: sc becomes P = exp2(S * scale - m * scale) (unrounded), m (in
// units of raw scores) and l are updated, and alpha[h] is what O must be multiplied by before this
// tile's P V. Fragment element 4 * jj + 2 * h + e is row row[h], key j * BN + 8 * jj + 2 * (lane % 4)
// + e. Per score that is one FMNMX (the row maximum, on raw scores: the scale is positive), one FFMA
// (scale and shift), one MUFU.EX2 and one FADD (the row sum). MASK (the tile that holds the diagonal
// or keys past N: only the last one) first sets the scores a row does not see to -inf.
template <bool CAUSAL, bool MASK>
__device__ __forceinline__ void softmax_tile(float (&sc)[64], float (&m)[2], float (&l)[2],
                                             float (&alpha)[2], const Consumer& me, int j) {
  using namespace faws;
  if (MASK) {
#pragma unroll
    for (int jj = 0; jj < BN / 8; ++jj)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = j * BN + 8 * jj + 2 * (me.lane % 4) + e;
          if (key >= me.N || (CAUSAL && key > me.row[h])) sc[4 * jj + 2 * h + e] = -INFINITY;
        }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = m[h];
#pragma unroll
    for (int jj = 0; jj < BN / 8; ++jj) mx = fmaxf(mx, fmaxf(sc[4 * jj + 2 * h], sc[4 * jj + 2 * h + 1]));
    const float m_new = quad_max(mx);
    // A row that has seen nothing yet (m_new = -inf) subtracts 0: its P is 0, not NaN.
    const float shift = m_new == -INFINITY ? 0.f : m_new * me.qk_scale;
    alpha[h] = exp2_ftz(m[h] * me.qk_scale - shift);
    float sum = 0.f;
#pragma unroll
    for (int jj = 0; jj < BN / 8; ++jj)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = sc[4 * jj + 2 * h + e];
        x = exp2_ftz(fmaf(x, me.qk_scale, -shift));
        sum += x;
      }
    l[h] = l[h] * alpha[h] + quad_sum(sum);
    m[h] = m_new;
  }
}

__device__ __forceinline__ void rescale(float (&o)[64], const float (&alpha)[2]) {
#pragma unroll
  for (int jj = 0; jj < faws::D / 8; ++jj)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      o[4 * jj + 2 * h] *= alpha[h];
      o[4 * jj + 2 * h + 1] *= alpha[h];
    }
}

// P as the A operand of O += P V: k16 slice t of the keys is fragment blocks 2t and 2t + 1, rows r and
// r + 8, columns 16t + 2 (lane % 4) + {0, 1} and 8 more.
__device__ __forceinline__ void pack_p(uint32_t (&p)[faws::BN / 16][4], const float (&sc)[64]) {
#pragma unroll
  for (int t = 0; t < faws::BN / 16; ++t) {
    p[t][0] = pack_bf16(sc[8 * t + 0], sc[8 * t + 1]);  // row r, columns 16t + 2(lane%4) + {0,1}
    p[t][1] = pack_bf16(sc[8 * t + 2], sc[8 * t + 3]);  // row r + 8
    p[t][2] = pack_bf16(sc[8 * t + 4], sc[8 * t + 5]);  // row r, columns 16t + 8 + ...
    p[t][3] = pack_bf16(sc[8 * t + 6], sc[8 * t + 7]);  // row r + 8
  }
}

// Epilogue: O / l, rows past N not stored; lse (log2 units) by the first lane of each quad.
__device__ __forceinline__ void store_rows(const float (&o)[64], const float (&m)[2], const float (&l)[2],
                                           const int (&row)[2], int lane, int bh, int N, float qk_scale,
                                           bf16* __restrict__ O, float* __restrict__ lse) {
  using namespace faws;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (row[h] >= N) continue;
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
    const int64_t base = (static_cast<int64_t>(bh) * N + row[h]) * D;
#pragma unroll
    for (int jj = 0; jj < D / 8; ++jj) {
      const int col = 8 * jj + 2 * (lane % 4);
      *reinterpret_cast<__nv_bfloat162*>(O + base + col) =
          __floats2bfloat162_rn(o[4 * jj + 2 * h] * inv, o[4 * jj + 2 * h + 1] * inv);
    }
    if (lane % 4 == 0) lse[static_cast<int64_t>(bh) * N + row[h]] = m[h] * qk_scale + log2f(l[h]);
  }
}

template <bool CAUSAL, bool OVERLAP>
__global__ void __launch_bounds__(faws::NT, 1)
    fa_ws_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                 const __grid_constant__ CUtensorMap map_v, int N, float qk_scale,
                 bf16* __restrict__ O, float* __restrict__ lse) {
  using namespace faws;
  extern __shared__ uint8_t smem[];
  const uint32_t q_tile = smem_base_1024(smem), kv = q_tile + TILE;
  const uint32_t q_full = kv + STAGES * 2 * TILE, k_full = q_full + 8, v_full = k_full + STAGES * 8,
                 empty = v_full + STAGES * 8;
  const int m0 = blockIdx.x * BM, bh = blockIdx.y;
  const int n_keys = CAUSAL ? min(N, m0 + BM) : N;  // keys any row of this block can see
  const int blocks = HG_CEIL_DIV(n_keys, BN);
  const int wg = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    mbar_init(q_full, 1);
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(k_full + 8 * s, 1);
      mbar_init(v_full + 8 * s, 1);
      mbar_init(empty + 8 * s, CONSUMERS * 4);  // lane 0 of every consumer warp
    }
    mbar_fence_init();
  }
  __syncthreads();

  if (wg == 0) {
    // ---- producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
    if (threadIdx.x == 0) {
      load_tile(q_tile, &map_q, q_full, bh * N + m0);
      for (int j = 0; j < blocks; ++j) {
        const int s = j % STAGES;
        // The n-th refill of slot s waits for the consumers' release of fill n - 1.
        if (j >= STAGES) mbar_wait(empty + 8 * s, (j / STAGES - 1) & 1);
        load_kv(kv, k_full, v_full, s, &map_k, &map_v, bh * N + j * BN);
      }
    }
  } else {
    // ---- consumers
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));
    const int c = wg - 1;  // query rows 64c .. 64c + 63 of the block
    const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    const int r0 = m0 + 64 * c + 16 * warp + lane / 4;
    const Consumer me{q_tile + c * 64 * 128, {r0, r0 + 8}, lane, N, qk_scale};
    float o[64], sc[64], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, alpha[2];
    uint32_t p[BN / 16][4];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.f;
    mbar_wait(q_full, 0);
    const auto k_tile = [&](int j) { return kv + (j % STAGES) * 2 * TILE; };
    const auto parity = [](int j) { return static_cast<uint32_t>((j / STAGES) & 1); };

    // The last key tile is the only one with scores to mask (MASK: std::true_type), so it is peeled
    // off each loop: the loops' bodies hold the unmasked softmax alone.
    if (!OVERLAP) {
      // Each tile in turn: S = Q K^T, softmax, O += P V, waiting for each product.
      const auto tile = [&](int j, auto mask) {
        mbar_wait(k_full + 8 * (j % STAGES), parity(j));
        issue_qk(sc, me, k_tile(j));
        wgmma_wait<0>();
        fence_operands(sc);
        softmax_tile<CAUSAL, decltype(mask)::value>(sc, m, l, alpha, me, j);
        rescale(o, alpha);
        pack_p(p, sc);
        mbar_wait(v_full + 8 * (j % STAGES), parity(j));
        issue_pv(o, p, k_tile(j) + TILE);
        wgmma_wait<0>();
        fence_operands(o);
        if (lane == 0) mbar_arrive(empty + 8 * (j % STAGES));  // this warp is done with the slot
      };
      for (int j = 0; j < blocks - 1; ++j) tile(j, std::false_type{});
      tile(blocks - 1, std::true_type{});
    } else {
      // FlashAttention-3's schedule. Within a consumer, the softmax of tile j runs while the tensor
      // cores do P V of tile j - 1 (issued just before, with S of tile j). Between the consumers, a
      // named barrier passes the turn to issue products back and forth (ping-pong), so that one's
      // softmax overlaps the other's products. Phases per consumer: S_0, then blocks - 1 times
      // (S_j with P V_{j-1}), then P V of the last tile. Consumer 1 hands consumer 0 the first turn
      // and skips its last hand-over, so every bar.sync meets exactly one bar.arrive.
      const int mine = 1 + c, other = 2 - c;
      if (c == 1) named_arrive(1);
      named_sync(mine);
      mbar_wait(k_full, parity(0));
      issue_qk(sc, me, k_tile(0));
      named_arrive(other);
      wgmma_wait<0>();
      fence_operands(sc);
      if (blocks == 1) softmax_tile<CAUSAL, true>(sc, m, l, alpha, me, 0);
      else softmax_tile<CAUSAL, false>(sc, m, l, alpha, me, 0);
      pack_p(p, sc);
      const auto step = [&](int j, auto mask) {
        named_sync(mine);
        mbar_wait(k_full + 8 * (j % STAGES), parity(j));
        issue_qk(sc, me, k_tile(j));
        rescale(o, alpha);  // O so far, to the maximum of tile j - 1, before its P V
        mbar_wait(v_full + 8 * ((j - 1) % STAGES), parity(j - 1));
        issue_pv(o, p, k_tile(j - 1) + TILE);
        named_arrive(other);
        wgmma_wait<1>();  // S_j is done; P V_{j-1} may still run
        fence_operands(sc);
        softmax_tile<CAUSAL, decltype(mask)::value>(sc, m, l, alpha, me, j);
        wgmma_wait<0>();  // P V_{j-1} is done: its slot and P's registers are free
        fence_operands(o);
        if (lane == 0) mbar_arrive(empty + 8 * ((j - 1) % STAGES));
        pack_p(p, sc);
      };
      for (int j = 1; j < blocks - 1; ++j) step(j, std::false_type{});
      if (blocks > 1) step(blocks - 1, std::true_type{});
      const int last = blocks - 1;
      named_sync(mine);
      rescale(o, alpha);
      mbar_wait(v_full + 8 * (last % STAGES), parity(last));
      issue_pv(o, p, k_tile(last) + TILE);
      if (c == 0) named_arrive(other);
      wgmma_wait<0>();
      fence_operands(o);
      if (lane == 0) mbar_arrive(empty + 8 * (last % STAGES));
    }

    store_rows(o, m, l, me.row, lane, bh, N, qk_scale, O, lse);
  }
}

// The plain schedule on a persistent grid: one block per SM walks over (query tile, head) pairs,
// its first tile blockIdx.x and each later one drawn off a global counter (gridDim.x + atomicAdd),
// so the producer loads the next tile's Q, K and V while the consumers finish the last one (their
// epilogue, and the ramp of every tile, no longer leave the tensor cores idle), and a block that
// drew short causal tiles draws more. Causal tiles go longest first within a group of heads, so
// the short ones fill the end. The K/V ring
// runs on across tiles (a fill counter g, not the key index, picks the slot and the phase). Q has
// two slots, tile `it` in slot it % 2, each with a full barrier and an empty one (the consumers
// are done with that Q): the producer draws the next tile and loads its Q once it has issued this
// tile's last K and V and the slot's previous tile (two back) has released it, so the next tile's
// first scores need not wait for the counter's atomic and Q's trip from memory. (With one slot the
// producer waited for the last S of a tile before it drew the next. On an H100 the second slot
// took the masked forward at 512 tokens from 0.75x to 0.82x cuDNN; without the mask, and from
// 1,024 tokens, it moved within the runs' spread:
// results/profiles/2026-12-07-nvidia-h100-80gb-hbm3-fa-q-slots.txt.)
//
// EARLY: once a tile's last P V is done, the consumers wait for the next tile's Q and issue its
// first S = Q K^T before they normalise and store this tile's O, so the epilogue's stores run while
// the tensor cores work. (The two paths, with an S in flight and without, each store on their own:
// merged, ptxas must assume the S registers busy and waits for the wgmma there, warning C7517.)
template <bool CAUSAL, bool EARLY>
__global__ void __launch_bounds__(faws::NT, 1)
    fa_ws_persistent_kernel(const __grid_constant__ CUtensorMap map_q,
                            const __grid_constant__ CUtensorMap map_k,
                            const __grid_constant__ CUtensorMap map_v, int N, int BH, float qk_scale,
                            bf16* __restrict__ O, float* __restrict__ lse, int* tile_counter) {
  using namespace faws;
  extern __shared__ uint8_t smem[];
  // The tile in each Q slot, written by the producer before it arrives on that slot's Q full (an
  // arrive releases, a wait acquires: the consumers see it once their wait on Q full returns).
  __shared__ int current_tile[Q_SLOTS];
  const uint32_t q_tiles = smem_base_1024(smem), kv = q_tiles + Q_SLOTS * TILE;
  const uint32_t q_full = kv + STAGES * 2 * TILE, q_empty = q_full + Q_SLOTS * 8,
                 k_full = q_empty + Q_SLOTS * 8, v_full = k_full + STAGES * 8,
                 empty = v_full + STAGES * 8;
  const int m_tiles = HG_CEIL_DIV(N, BM), tiles = m_tiles * BH;
  const int wg = threadIdx.x / 128;
  // Tile t: the tiles go in groups of `heads` heads (about GROUP_TILES tiles, two waves of blocks),
  // so the blocks running at once share the K and V of a few heads in L2. (Heads first, one head per
  // block, measured 0.67-0.99x plain: 132 heads' K and V at once overflow L2 and are read again
  // from DRAM for every query tile.) Within a group, query tiles go longest first when causal, the
  // group's heads varying fastest, so the short tiles fill the end.
  const int heads = max(1, min(BH, GROUP_TILES / m_tiles));
  const auto coords = [&](int t, int& m0, int& bh, int& blocks) {
    const int group = t / (heads * m_tiles), r = t % (heads * m_tiles);
    const int in_group = min(heads, BH - group * heads);  // the last group may hold fewer heads
    const int mt = r / in_group;
    bh = group * heads + r % in_group;
    m0 = (CAUSAL ? m_tiles - 1 - mt : mt) * BM;
    blocks = HG_CEIL_DIV(CAUSAL ? min(N, m0 + BM) : N, BN);
  };

  if (threadIdx.x == 0) {
#pragma unroll
    for (int q = 0; q < Q_SLOTS; ++q) {
      mbar_init(q_full + 8 * q, 1);
      mbar_init(q_empty + 8 * q, CONSUMERS * 4);  // lane 0 of every consumer warp
    }
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(k_full + 8 * s, 1);
      mbar_init(v_full + 8 * s, 1);
      mbar_init(empty + 8 * s, CONSUMERS * 4);
    }
    mbar_fence_init();
  }
  __syncthreads();

  if (wg == 0) {
    // ---- producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
    if (threadIdx.x == 0) {
      uint32_t g = 0;  // K/V fills so far, over all tiles
      for (int it = 0;; ++it) {
        // Q slot it % 2 is free once the consumers have released its previous tile, it - 2 (they
        // read the tile number before they start on Q, so that is free too).
        const int qs = it % Q_SLOTS;
        if (it >= Q_SLOTS) mbar_wait(q_empty + 8 * qs, (it / Q_SLOTS - 1) & 1);
        // Tiles are handed out dynamically: the first one per block, then whichever comes next
        // off a global counter, so a block that drew short (causal) tiles draws more of them.
        const int t = it == 0 ? blockIdx.x : gridDim.x + atomicAdd(tile_counter, 1);
        current_tile[qs] = t;
        if (t >= tiles) {  // no tile left: one arrival without bytes releases the consumers
          mbar_arrive(q_full + 8 * qs);
          break;
        }
        int m0, bh, blocks;
        coords(t, m0, bh, blocks);
        load_tile(q_tiles + qs * TILE, &map_q, q_full + 8 * qs, bh * N + m0);
        for (int j = 0; j < blocks; ++j, ++g) {
          const uint32_t s = g % STAGES;
          if (g >= STAGES) mbar_wait(empty + 8 * s, (g / STAGES - 1) & 1);
          load_kv(kv, k_full, v_full, s, &map_k, &map_v, bh * N + j * BN);
        }
      }
    }
  } else {
    // ---- consumers: the plain schedule, tile after tile
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));
    const int c = wg - 1;
    const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    float o[64], sc[64], m[2], l[2], alpha[2];
    uint32_t p[BN / 16][4];
    uint32_t g = 0;
    // Tile `it`'s number, coordinates and rows: read once its Q slot is full.
    int t, m0, bh, blocks;
    Consumer me;
    const auto next_tile = [&](int it) {
      const int qs = it % Q_SLOTS;
      mbar_wait(q_full + 8 * qs, (it / Q_SLOTS) & 1);
      t = current_tile[qs];
      if (t >= tiles) return false;
      coords(t, m0, bh, blocks);
      const int r0 = m0 + 64 * c + 16 * warp + lane / 4;
      me = Consumer{q_tiles + qs * TILE + c * 64 * 128, {r0, r0 + 8}, lane, N, qk_scale};
      return true;
    };
    // S of the ring's next K tile (fill g), issued and not waited for.
    const auto first_s = [&] {
      mbar_wait(k_full + 8 * (g % STAGES), (g / STAGES) & 1);
      issue_qk(sc, me, kv + (g % STAGES) * 2 * TILE);
    };
    bool more = next_tile(0);
    if (EARLY && more) first_s();
    for (int it = 0; more; ++it) {
      const int qs = it % Q_SLOTS;
#pragma unroll
      for (int i = 0; i < 64; ++i) o[i] = 0.f;
      m[0] = m[1] = -INFINITY;
      l[0] = l[1] = 0.f;
      // One key tile: j picks the keys (and the mask), g the ring slot and its phase; ISSUED: its S
      // is already in flight (EARLY's first tile). After the last S of the tile, Q is released.
      const auto tile = [&](int j, auto mask, auto issued) {
        const uint32_t s = g % STAGES, parity = (g / STAGES) & 1;
        const uint32_t k_tile = kv + s * 2 * TILE;
        if (!decltype(issued)::value) {
          mbar_wait(k_full + 8 * s, parity);
          issue_qk(sc, me, k_tile);
        }
        wgmma_wait<0>();
        fence_operands(sc);
        // The last S of the tile: its Q slot is free.
        if (decltype(mask)::value && lane == 0) mbar_arrive(q_empty + 8 * qs);
        softmax_tile<CAUSAL, decltype(mask)::value>(sc, m, l, alpha, me, j);
        rescale(o, alpha);
        pack_p(p, sc);
        mbar_wait(v_full + 8 * s, parity);
        issue_pv(o, p, k_tile + TILE);
        wgmma_wait<0>();
        fence_operands(o);
        if (lane == 0) mbar_arrive(empty + 8 * s);
        ++g;
      };
      int j = 0;
      if constexpr (EARLY) {  // the first key tile's S is in flight; it may be the last tile too
        if (blocks == 1) tile(0, std::true_type{}, std::true_type{});
        else tile(0, std::false_type{}, std::true_type{});
        j = 1;
      }
      if (j < blocks) {
        for (; j < blocks - 1; ++j) tile(j, std::false_type{}, std::false_type{});
        tile(blocks - 1, std::true_type{}, std::false_type{});
      }
      // This tile's rows, before the next tile's coordinates replace them.
      const int row[2] = {me.row[0], me.row[1]}, this_bh = bh;
      more = next_tile(it + 1);
      if (EARLY && more) {
        first_s();
        store_rows(o, m, l, row, lane, this_bh, N, qk_scale, O, lse);
      } else {
        store_rows(o, m, l, row, lane, this_bh, N, qk_scale, O, lse);
      }
    }
  }
}

// Q, K, V, O: [BH * N, 128] row-major; lse: [BH * N]. nullptr when it launched, else what went
// wrong. schedule: 0 plain, 1 overlap, 2 persistent, 3 persistent-early (kernels/cuda/fa_ws.py's
// SCHEDULES, in order).
// tile_counter: one int in global memory, zero at launch (the persistent schedule's tile counter;
// unused by the others).
const char* fa_ws_forward(const bf16* Q, const bf16* K, const bf16* V, bf16* O, float* lse, int BH,
                          int N, float qk_scale, bool causal, int schedule, int* tile_counter,
                          cudaStream_t s) {
  using namespace faws;
  CUtensorMap map_q, map_k, map_v;
  const char* err;
  if ((err = hgemm_tensor_map(&map_q, Q, BH * N, D, BM))) return err;
  if ((err = hgemm_tensor_map(&map_k, K, BH * N, D, BN))) return err;
  if ((err = hgemm_tensor_map(&map_v, V, BH * N, D, BN))) return err;
  if (schedule == 2 || schedule == 3) {
    int device = 0, sms = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
      return "cudaDeviceGetAttribute(MultiProcessorCount) failed";
    const int tiles = HG_CEIL_DIV(N, BM) * BH;
    const bool early = schedule == 3;
    auto kernel = causal ? (early ? fa_ws_persistent_kernel<true, true> : fa_ws_persistent_kernel<true, false>)
                         : (early ? fa_ws_persistent_kernel<false, true> : fa_ws_persistent_kernel<false, false>);
    if ((err = hgemm_allow_smem(kernel, SMEM_PERSISTENT))) return err;
    if (tile_counter == nullptr) return "the persistent schedule needs a tile counter";
    kernel<<<min(sms, tiles), NT, SMEM_PERSISTENT, s>>>(map_q, map_k, map_v, N, BH, qk_scale, O,
                                                        lse, tile_counter);
    return nullptr;
  }
  const bool overlap = schedule == 1;
  const dim3 grid(HG_CEIL_DIV(N, BM), BH);
  auto kernel = causal ? (overlap ? fa_ws_kernel<true, true> : fa_ws_kernel<true, false>)
                       : (overlap ? fa_ws_kernel<false, true> : fa_ws_kernel<false, false>);
  if ((err = hgemm_allow_smem(kernel, SMEM))) return err;
  kernel<<<grid, NT, SMEM, s>>>(map_q, map_k, map_v, N, qk_scale, O, lse);
  return nullptr;
}
