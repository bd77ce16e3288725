// Row-wise ops on rows too wide for one SM: each row is split across the CTAs of a thread-block
// cluster (sm_90+), and the row's sums are combined through distributed shared memory.
//
// Why. RMSNorm, LayerNorm and softmax need a whole-row statistic before they can write any of the
// row. A row of 65,536 values does not fit in one SM's registers, so the Triton kernels either
// spill or read the row twice (three passes of memory traffic instead of two). Here the row is cut
// into S chunks of at most CHUNK = 256 threads x E values; the S CTAs of one cluster (Hopper and
// later guarantee they run at the same time, on neighbouring SMs) each hold one chunk in registers.
// Each CTA reduces its chunk (warp shuffles, then shared memory), writes its partial to its own
// shared memory, and after a cluster barrier S threads of each CTA copy the S partials out of the
// other CTAs' shared memory (cg::cluster_group::map_shared_rank) into its own, where every thread
// reads them. Every CTA adds them in the same order, so all of them hold the identical row
// statistic. The row is read once and written once.
//
// Tiles. E values a thread (a CTA holds 256 E of a row), and for the forwards and softmax's
// backward an occupancy target OCC: the CTAs an SM must hold, which caps the registers a thread
// (__launch_bounds__'s second argument; 0: the compiler's own choice). An SM holds (CTAs an SM) x
// (a chunk's bytes) of rows, and 16-bit chunks are half as large, so the three 16-bit forwards
// also build a larger tile (built(), below), and the 16-bit norms' backward
// one of 32 values (with_bwd_tile), which scripts/gpu/cluster_rows_probe.py --tiles times.
// (The backward keeps its column sums in dynamic shared memory, which allow() asks for.)
//
// Kernels (T = float, __half or __nv_bfloat16; rows are 16-byte aligned vectors of T):
//   norm_fwd   y = (x - mean) * rstd * w (+ b), and the row's mean and rstd (fp32) if STATS
//   norm_bwd   dx, and each cluster's fp32 partial column sums of dy * xhat (dw) and dy (db): the
//              clusters are persistent (as many as fit), each walks rows c, c + G, c + 2G, ...
//              with the next row's loads in flight, and keeps its columns' dw/db sums in shared
//              memory; kernels.partial_sums adds the G partial rows up afterwards
//   softmax_fwd  y = exp(x - max) / sum(exp(x - max))
//   norm_fwd_loop, softmax_fwd_loop  the forwards as persistent clusters, with the next row's chunk
//              in flight while a row is worked on (candidates: cluster_rows.py's LOOP_FWD)
//   softmax_bwd  dx = y * (dy - sum(y * dy))
//
// A cluster's shared memory must outlive every read of it from other CTAs, so each kernel ends
// with a cluster barrier (the one-row kernels arrive right after the last remote read and wait
// just before exiting, so the stores in between overlap it; the persistent ones sync after their
// last row). The persistent kernels reuse their partial-sum slots row after row: two slots,
// alternating, are enough, because the barrier of row i + 1 is reached by every thread only after
// its remote reads of row i.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace cluster_rows {
namespace cg = cooperative_groups;

constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;
constexpr float LOG2E = 1.4426950408889634f;
constexpr int MAX_CLUSTER = 16;  // 8 is portable; 16 needs the non-portable attribute (H100: yes)

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// One thread's share of a chunk: E values as E / V vectors of V = 16 / sizeof(T) values. Vector i
// of thread t starts at column c0 + (i * THREADS + t) * V, so a warp's loads are contiguous.
template <typename T, int E>
struct Cols {
  static constexpr int V = 16 / sizeof(T);
  static constexpr int N = E / V;  // vectors per thread
  __device__ __forceinline__ static int col(int c0, int i) { return c0 + (i * THREADS + threadIdx.x) * V; }
};

// The chunk as loaded, 16 bytes a vector: a 16-bit type keeps two values per register, half the
// registers of fp32 copies of its values. at(i, j) converts one value to fp32. A bf16 value is the
// top half of an fp32, so at() makes it from the 32-bit word with one shift or mask: converted from
// 16-bit halves instead, the compiler kept each half in a register of its own across the passes
// over the chunk (ptxas, sm_90: bf16 LayerNorm's forward with a bias at E = 32, 63 registers -> 46;
// RMSNorm's 40 -> 32, as fp16's). at<false>: through the halves, which the norms' backward keeps
// at E = 16 (with words its LayerNorm build spills at 3 CTAs an SM). Columns at or past n load as
// zero bits (the caller masks them where zero is not neutral).
template <typename T, int E>
struct Packed : Cols<T, E> {
  using Cols<T, E>::N;
  using Cols<T, E>::col;
  uint4 raw[N];

  // STREAM: evict-first (a row, read once); else through the read-only cache (the weights).
  template <bool STREAM = true>
  __device__ __forceinline__ void load(const T* row, int c0, int n) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int c = col(c0, i);
      if constexpr (STREAM)
        raw[i] = c < n ? __ldcs(reinterpret_cast<const uint4*>(row + c)) : make_uint4(0, 0, 0, 0);
      else
        raw[i] = c < n ? __ldg(reinterpret_cast<const uint4*>(row + c)) : make_uint4(0, 0, 0, 0);
    }
  }
  template <bool WORDS = true>
  __device__ __forceinline__ float at(int i, int j) const {
    if constexpr (WORDS && std::is_same_v<T, __nv_bfloat16>) {
      const uint32_t u = reinterpret_cast<const uint32_t*>(&raw[i])[j >> 1];
      return __uint_as_float((j & 1) ? (u & 0xffff0000u) : (u << 16));
    } else {
      return to_f(reinterpret_cast<const T*>(&raw[i])[j]);
    }
  }
};

template <typename T, int V>
__device__ __forceinline__ void load_vec(const T* p, float (&f)[V]) {
  uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));  // weights: reused by every row, cached
  const T* t = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int j = 0; j < V; ++j) f[j] = to_f(t[j]);
}

template <typename T, int V>
__device__ __forceinline__ void store_vec(T* p, const float (&f)[V]) {
  uint4 raw;
  T* t = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int j = 0; j < V; ++j) t[j] = from_f<T>(f[j]);
  __stcs(reinterpret_cast<uint4*>(p), raw);  // streamed: not read again by this kernel
}

// Write this thread's vectors of a chunk (columns c0 ... of `row`, layout F) that lie inside the
// row: fill(i, c, o) computes vector i, which starts at column c, into o[0 .. V).
template <class F, typename T, class Fill>
__device__ __forceinline__ void store_chunk(T* row, int c0, int n, Fill fill) {
#pragma unroll
  for (int i = 0; i < F::N; ++i) {
    const int c = F::col(c0, i);
    if (c >= n) continue;
    float o[F::V];
    fill(i, c, o);
    store_vec<T, F::V>(row + c, o);
  }
}

struct Sum {
  __device__ __forceinline__ static float op(float a, float b) { return a + b; }
};
struct Max {
  __device__ __forceinline__ static float op(float a, float b) { return fmaxf(a, b); }
};

// Shared memory of the reductions: per-warp values; this CTA's K values, read by the cluster; and
// every CTA's K values, gathered from the cluster. `part` has two slots, which the persistent
// kernels alternate row by row: another CTA may still read this row's slot while this CTA writes
// the next row's. `all` needs one: only this CTA reads it, and it is rewritten only after a
// __syncthreads that follows every thread's reads of it (block_reduce's, then the cluster barrier).
template <int K>
struct Scratch {
  float warp[WARPS][K];
  float part[2][K];
  float all[MAX_CLUSTER][K];
};

// Reduce K values per thread over this CTA with Op; every thread gets the K results (fixed order:
// shuffles, then the warps in order). Ends with a barrier, so the scratch can be reused at once.
template <class Op, int K>
__device__ __forceinline__ void block_reduce(float (&v)[K], Scratch<K>& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int k = 0; k < K; ++k) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v[k] = Op::op(v[k], __shfl_xor_sync(0xffffffffu, v[k], off));
  }
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) s.warp[warp][k] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float a = s.warp[0][k];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) a = Op::op(a, s.warp[w][k]);
    v[k] = a;
  }
  __syncthreads();
}

// Exchange K values per CTA (every thread of a CTA holds its CTA's) across the cluster: after it,
// s.all[r][k] holds value k of CTA r, for every rank r, in this CTA's own shared memory.
// Each remote value is read once per CTA, by one thread (ranks x K of them at once), not by every
// thread: read by all 256, the reads cost 256 times the traffic over the SM-to-SM network, and a
// loop over the ranks waits out one remote latency per rank.
template <int K>
__device__ __forceinline__ void exchange(const float (&v)[K], Scratch<K>& s, int slot, cg::cluster_group& cl) {
  if (threadIdx.x < K) s.part[slot][threadIdx.x] = v[threadIdx.x];
  cl.sync();  // every CTA's part is written
  const int ranks = static_cast<int>(cl.num_blocks());
  if (threadIdx.x < ranks * K) {
    const int r = threadIdx.x / K, k = threadIdx.x % K;
    s.all[r][k] = *cl.map_shared_rank(&s.part[slot][k], r);
  }
  __syncthreads();
}

// The sum of K values per thread over the whole cluster; every thread of every CTA gets the same
// K results (ranks added in order).
template <int K>
__device__ __forceinline__ void cluster_sum(float (&v)[K], Scratch<K>& s, int slot, cg::cluster_group& cl) {
  block_reduce<Sum>(v, s);
  exchange(v, s, slot, cl);
  const int ranks = static_cast<int>(cl.num_blocks());
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float a = s.all[0][k];
#pragma unroll 4  // 4 keeps softmax's 16-bit backward at 80 registers (1: 86-88, 2 CTAs an SM)
    for (int r = 1; r < ranks; ++r) a += s.all[r][k];
    v[k] = a;
  }
}

// Valid columns of CTA `rank`'s chunk.
__device__ __forceinline__ int chunk_count(int rank, int chunk, int n) {
  const int left = n - rank * chunk;
  return left <= 0 ? 0 : (left < chunk ? left : chunk);
}

// ------------------------------------------------------------------------------------ norms
//
// LayerNorm's mean and variance take one cluster exchange: each CTA publishes its chunk's sum and
// its sum of squared deviations from the chunk's own mean (M2, exact: the chunk is in registers),
// and every CTA merges the S pairs with Chan et al.'s rule, M2 = sum M2_r + sum n_r (m_r - m)^2.
// That is as stable as two passes (no E[x^2] - E[x]^2 cancellation) at the cost of one barrier.

// The row's mean (0 for RMSNorm) and rstd, from each CTA's chunk f (exchange slot `slot`).
template <typename T, int E, bool RMS>
__device__ __forceinline__ float2 norm_stats(const Packed<T, E>& f, Scratch<2>& s, int slot,
                                             cg::cluster_group& cl, int rank, int n, float eps) {
  using F = Packed<T, E>;
  constexpr int V = F::V;
  constexpr int CHUNK = E * THREADS;
  const int c0 = rank * CHUNK;
  float mean = 0.f, var;
  if constexpr (RMS) {
    float a[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < F::N; ++i)
#pragma unroll
      for (int j = 0; j < V; ++j) a[0] += f.at(i, j) * f.at(i, j);  // padding loads as 0
    cluster_sum(a, s, slot, cl);
    var = a[0] / n;
  } else {
    const int count = chunk_count(rank, CHUNK, n);
    float a[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < F::N; ++i)
#pragma unroll
      for (int j = 0; j < V; ++j) a[0] += f.at(i, j);
    block_reduce<Sum>(a, s);
    const float local_mean = count > 0 ? a[0] / count : 0.f;
    float m2 = 0.f;
#pragma unroll
    for (int i = 0; i < F::N; ++i) {
      const bool in = F::col(c0, i) < n;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float d = in ? f.at(i, j) - local_mean : 0.f;
        m2 += d * d;
      }
    }
    float b2[2] = {m2, 0.f};
    block_reduce<Sum>(b2, s);
    a[1] = b2[0];
    exchange(a, s, slot, cl);
    const int ranks = static_cast<int>(cl.num_blocks());
    float total = 0.f;
    for (int r = 0; r < ranks; ++r) total += s.all[r][0];
    mean = total / n;
    float M2 = 0.f;
    for (int r = 0; r < ranks; ++r) {
      const int nr = chunk_count(r, CHUNK, n);
      if (nr == 0) continue;
      const float d = s.all[r][0] / nr - mean;
      M2 += s.all[r][1] + nr * d * d;
    }
    var = M2 / n;
  }
  return make_float2(mean, rsqrtf(var + eps));
}

// Write the chunk f of row `row`'s output from its (mean, rstd), and (STATS, CTA 0) the statistics.
template <typename T, int E, bool RMS, bool BIAS, bool STATS>
__device__ __forceinline__ void norm_write(const Packed<T, E>& f, float2 st, int64_t row, int rank, const T* w,
                                           const T* b, T* y, int64_t sy, float* mean_out, float* rstd_out,
                                           int n) {
  using F = Packed<T, E>;
  constexpr int V = F::V;
  const float mean = st.x, rstd = st.y;
  store_chunk<F>(y + row * sy, rank * (E * THREADS), n, [&](int i, int c, float (&o)[V]) {
    float wv[V], bv[V];
    load_vec<T, V>(w + c, wv);
    if constexpr (BIAS) load_vec<T, V>(b + c, bv);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      o[j] = (f.at(i, j) - mean) * rstd * wv[j];
      if constexpr (BIAS) o[j] += bv[j];
    }
  });
  if constexpr (STATS) {
    if (rank == 0 && threadIdx.x == 0) {
      rstd_out[row] = rstd;
      if constexpr (!RMS) mean_out[row] = mean;
    }
  }
}

// The forwards come in two launches. norm_fwd: one row per cluster (rows x S CTAs); the registers
// hold one chunk, and the SM's other CTAs cover the latency of this one's reduction and exchange.
// (Its unnamed int is the row count, which the grid already gives: the two kernels share a
// signature.)
template <typename T, int E, bool RMS, bool BIAS, bool STATS, int OCC = 0>
__global__ void __launch_bounds__(THREADS, OCC) norm_fwd(const T* __restrict__ x, int64_t sx,
                                                    const T* __restrict__ w, const T* __restrict__ b,
                                                    T* __restrict__ y, int64_t sy, float* __restrict__ mean_out,
                                                    float* __restrict__ rstd_out, int, int n, float eps) {
  __shared__ Scratch<2> s;
  cg::cluster_group cl = cg::this_cluster();
  const int ranks = static_cast<int>(cl.num_blocks()), rank = static_cast<int>(cl.block_rank());
  const int64_t row = blockIdx.x / ranks;
  Packed<T, E> f;
  f.load(x + row * sx, rank * (E * THREADS), n);
  const float2 st = norm_stats<T, E, RMS>(f, s, 0, cl, rank, n, eps);
  auto done = cl.barrier_arrive();  // done reading the other CTAs' shared memory
  norm_write<T, E, RMS, BIAS, STATS>(f, st, row, rank, w, b, y, sy, mean_out, rstd_out, n);
  cl.barrier_wait(std::move(done));  // no CTA's shared memory goes while another may read it
}

// norm_fwd_loop: persistent clusters (as many as fit), each walking rows c, c + G, ... as the
// backward does, with the next row's chunk loading while this row is reduced, exchanged and
// written; the exchange's slot alternates row by row, and one cluster barrier ends the kernel.
// A candidate (LOOP_FWD in cluster_rows.py), built for the tile (32, 0) only.
template <typename T, int E, bool RMS, bool BIAS, bool STATS>
__global__ void __launch_bounds__(THREADS) norm_fwd_loop(const T* __restrict__ x, int64_t sx,
                                                    const T* __restrict__ w, const T* __restrict__ b,
                                                    T* __restrict__ y, int64_t sy, float* __restrict__ mean_out,
                                                    float* __restrict__ rstd_out, int n_rows, int n, float eps) {
  __shared__ Scratch<2> s;
  cg::cluster_group cl = cg::this_cluster();
  const int ranks = static_cast<int>(cl.num_blocks()), rank = static_cast<int>(cl.block_rank());
  const int cluster = blockIdx.x / ranks, clusters = gridDim.x / ranks;
  const int c0 = rank * (E * THREADS);
  Packed<T, E> f, next;  // this row's chunk, and the next row's, in flight
  int row = cluster, slot = 0;
  if (row < n_rows) f.load(x + static_cast<int64_t>(row) * sx, c0, n);
  for (; row < n_rows; row += clusters, slot ^= 1) {
    if (row + clusters < n_rows) next.load(x + static_cast<int64_t>(row + clusters) * sx, c0, n);
    const float2 st = norm_stats<T, E, RMS>(f, s, slot, cl, rank, n, eps);
    norm_write<T, E, RMS, BIAS, STATS>(f, st, row, rank, w, b, y, sy, mean_out, rstd_out, n);
    f = next;
  }
  cl.sync();
}

// The backward walks its cluster's rows with the next row's loads in flight: while row i is reduced,
// exchanged and written, the registers already hold x and dy of row i + G arriving (both packed, 16
// bytes a vector). The columns' running sums of dy * xhat and dy live in (dynamic) shared memory,
// each thread its own slots ([E / 4][THREADS] float4: a warp's accesses are contiguous, no bank
// conflicts, no barrier), which leaves the registers to the two rows, the weights and the arithmetic.
// xhat and dy * w are recomputed from the packed values for dx instead of being kept as fp32.
// Built at E = 16 (3 CTAs an SM for 16-bit types, 2 for fp32) and, for 16-bit types, at E = 32
// (2 CTAs an SM with 32 KB of the next row in flight each, and half the CTAs a row: 8 at 65,536).
template <typename T, int E>
constexpr int bwd_ctas() { return sizeof(T) == 2 && E == 16 ? 3 : 2; }
template <int E, bool BIAS>
constexpr int bwd_sums_bytes() { return (BIAS ? 2 : 1) * (E / 4) * THREADS * static_cast<int>(sizeof(float4)); }

template <typename T, int E, bool RMS, bool BIAS>
__global__ void __launch_bounds__(THREADS, bwd_ctas<T, E>())
    norm_bwd(const T* __restrict__ dy, int64_t sdy, const T* __restrict__ x, int64_t sx,
             const T* __restrict__ w, const float* __restrict__ mean, const float* __restrict__ rstd,
             T* __restrict__ dx, int64_t sdx, float* __restrict__ dw_part, float* __restrict__ db_part,
             int n_rows, int n) {
  using F = Packed<T, E>;
  constexpr int V = F::V, G4 = V / 4;  // float4 groups of column sums per vector
  constexpr int K = RMS ? 1 : 2;
  __shared__ Scratch<K> s;
  extern __shared__ float4 sums[];  // [BIAS ? 2 : 1][E / 4][THREADS]: bwd_sums_bytes<E, BIAS>()
  float4* dw_sum = sums;
  float4* db_sum = sums + (E / 4) * THREADS;
  cg::cluster_group cl = cg::this_cluster();
  const int ranks = static_cast<int>(cl.num_blocks());
  const int cluster = blockIdx.x / ranks, clusters = gridDim.x / ranks;
  const int c0 = static_cast<int>(cl.block_rank()) * (E * THREADS);
  const int t = threadIdx.x;
#pragma unroll
  for (int q = 0; q < E / 4; ++q) {
    dw_sum[q * THREADS + t] = make_float4(0.f, 0.f, 0.f, 0.f);
    if constexpr (BIAS) db_sum[q * THREADS + t] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  // The weights: held in registers at E = 16; at E = 32, where four chunks of rows fill them, each
  // pass re-reads its vector of weights through the L1 cache (16 KB a CTA, read by every row).
  constexpr bool HOLD_W = E == 16;
  struct NoWeights {};
  std::conditional_t<HOLD_W, F, NoWeights> wv;
  F xa, ga, xb, gb;
  if constexpr (HOLD_W) wv.template load<false>(w, c0, n);
  auto weights = [&](int i) -> uint4 {
    if constexpr (HOLD_W) return wv.raw[i];
    const int c = F::col(c0, i);
    return c < n ? __ldg(reinterpret_cast<const uint4*>(w + c)) : make_uint4(0, 0, 0, 0);
  };
  // Values from 32-bit words at E = 32 (2 CTAs an SM leave the registers), from halves at E = 16.
  constexpr bool WORDS = E == 32;
  // xhat: for a 16-bit input one FFMA, x * rs + (-mu * rs) (its rounding, ~2^-24 |mu| rs, is far
  // below the input's own); fp32 keeps (x - mu) * rs, exact where the mean dwarfs the spread.
  int row = cluster, slot = 0;
  float rs = 0.f, mu = 0.f, rs_b = 0.f, mu_b = 0.f;  // the row's statistics, and the next row's
  auto xhat = [&](float v, float mrs) {
    if constexpr (sizeof(T) == 2) return fmaf(v, rs, mrs);
    else return (v - mu) * rs;
  };
  if (row < n_rows) {
    xa.load(x + row * sx, c0, n);
    ga.load(dy + row * sdy, c0, n);
    rs = rstd[row];
    if constexpr (!RMS) mu = mean[row];
  }
  for (; row < n_rows; row += clusters, slot ^= 1) {
    const int next = row + clusters;
    if (next < n_rows) {  // in flight while this row is reduced, exchanged and written
      xb.load(x + next * sx, c0, n);
      gb.load(dy + next * sdy, c0, n);
      rs_b = rstd[next];
      if constexpr (!RMS) mu_b = mean[next];
    }
    // Padding columns load dy = 0, so they add nothing to the sums.
    const float mrs = -mu * rs;
    float acc[K] = {};
#pragma unroll
    for (int i = 0; i < F::N; ++i) {
      const uint4 wr = weights(i);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float h = xhat(xa.template at<WORDS>(i, j), mrs);
        const float g = ga.template at<WORDS>(i, j) * to_f(reinterpret_cast<const T*>(&wr)[j]);
        acc[0] += g * h;
        if constexpr (!RMS) acc[K - 1] += g;
      }
    }
    cluster_sum(acc, s, slot, cl);
    const float c1 = acc[0] / n, c2 = RMS ? 0.f : acc[K - 1] / n;
    // dx = rs * (g - xhat * c1 - c2) = g * rs + (xhat * a + b): two FFMAs a value.
    const float a = -rs * c1, b = -rs * c2;
#pragma unroll
    for (int i = 0; i < F::N; ++i) {
      const int c = F::col(c0, i);
      if (c >= n) continue;
      float h[V], d[V], o[V];
      const uint4 wr = weights(i);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        h[j] = xhat(xa.template at<WORDS>(i, j), mrs);
        d[j] = ga.template at<WORDS>(i, j);
        o[j] = fmaf(d[j] * to_f(reinterpret_cast<const T*>(&wr)[j]), rs, fmaf(h[j], a, b));
      }
      store_vec<T, V>(dx + row * sdx + c, o);
#pragma unroll
      for (int k = 0; k < G4; ++k) {
        float4& sw = dw_sum[(i * G4 + k) * THREADS + t];
        sw.x += d[4 * k] * h[4 * k], sw.y += d[4 * k + 1] * h[4 * k + 1];
        sw.z += d[4 * k + 2] * h[4 * k + 2], sw.w += d[4 * k + 3] * h[4 * k + 3];
        if constexpr (BIAS) {
          float4& sb = db_sum[(i * G4 + k) * THREADS + t];
          sb.x += d[4 * k], sb.y += d[4 * k + 1], sb.z += d[4 * k + 2], sb.w += d[4 * k + 3];
        }
      }
    }
    xa = xb;
    ga = gb;
    rs = rs_b;
    mu = mu_b;
  }
  auto done = cl.barrier_arrive();
  // This cluster's partial column sums: row `cluster` of the [clusters, n] fp32 blocks.
#pragma unroll
  for (int i = 0; i < F::N; ++i) {
    const int c = F::col(c0, i);
    if (c >= n) continue;
    float4* pw = reinterpret_cast<float4*>(dw_part + static_cast<int64_t>(cluster) * n + c);
#pragma unroll
    for (int k = 0; k < G4; ++k) pw[k] = dw_sum[(i * G4 + k) * THREADS + t];
    if constexpr (BIAS) {
      float4* pb = reinterpret_cast<float4*>(db_part + static_cast<int64_t>(cluster) * n + c);
#pragma unroll
      for (int k = 0; k < G4; ++k) pb[k] = db_sum[(i * G4 + k) * THREADS + t];
    }
  }
  cl.barrier_wait(std::move(done));
}

// ------------------------------------------------------------------------------------ softmax
//
// The forward takes one cluster exchange too: each CTA publishes its chunk's max m_r and its sum
// l_r of exp(x - m_r), and every CTA merges them as the online softmax does (page 4.5):
// m = max m_r, l = sum l_r exp(m_r - m).

// The row's max and sum of exp(x - max), from each CTA's chunk f (exchange slot `slot`).
template <typename T, int E>
__device__ __forceinline__ float2 softmax_stats(const Packed<T, E>& f, Scratch<2>& s, int slot,
                                                cg::cluster_group& cl, int c0, int n) {
  using F = Packed<T, E>;
  constexpr int V = F::V;
  float m[2] = {-INFINITY, 0.f};
#pragma unroll
  for (int i = 0; i < F::N; ++i) {
    if (F::col(c0, i) >= n) continue;
#pragma unroll
    for (int j = 0; j < V; ++j) m[0] = fmaxf(m[0], f.at(i, j));
  }
  block_reduce<Max>(m, s);
  // A chunk of padding only (m_r = -inf) adds nothing: its l_r is 0.
  const float mr = m[0] == -INFINITY ? 0.f : m[0];
  float l[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < F::N; ++i) {
    if (F::col(c0, i) >= n) continue;
#pragma unroll
    for (int j = 0; j < V; ++j) l[0] += exp2f((f.at(i, j) - mr) * LOG2E);
  }
  block_reduce<Sum>(l, s);
  float part[2] = {m[0], l[0]};
  exchange(part, s, slot, cl);
  const int ranks = static_cast<int>(cl.num_blocks());
  float mx = -INFINITY;
  for (int r = 0; r < ranks; ++r) mx = fmaxf(mx, s.all[r][0]);
  float sum = 0.f;
  for (int r = 0; r < ranks; ++r) {
    const float m_r = s.all[r][0];
    if (m_r == -INFINITY) continue;
    sum += s.all[r][1] * exp2f((m_r - mx) * LOG2E);
  }
  return make_float2(mx, sum);
}

// Write the chunk f of softmax's output row `y_row` from the row's (max, sum).
template <typename T, int E>
__device__ __forceinline__ void softmax_write(const Packed<T, E>& f, float2 st, T* y_row, int c0, int n) {
  using F = Packed<T, E>;
  constexpr int V = F::V;
  // A row of -inf only has no max to subtract: its output is NaN, as torch.softmax's is.
  const float mx = st.x, inv = 1.f / st.y;
  store_chunk<F>(y_row, c0, n, [&](int i, int, float (&o)[V]) {
#pragma unroll
    for (int j = 0; j < V; ++j) o[j] = exp2f((f.at(i, j) - mx) * LOG2E) * inv;
  });
}

template <typename T, int E, int OCC = 0>
__global__ void __launch_bounds__(THREADS, OCC) softmax_fwd(const T* __restrict__ x, int64_t sx,
                                                       T* __restrict__ y, int64_t sy, int, int n) {
  __shared__ Scratch<2> s;
  cg::cluster_group cl = cg::this_cluster();
  const int ranks = static_cast<int>(cl.num_blocks());
  const int64_t row = blockIdx.x / ranks;
  const int c0 = static_cast<int>(cl.block_rank()) * (E * THREADS);
  Packed<T, E> f;
  f.load(x + row * sx, c0, n);
  const float2 st = softmax_stats(f, s, 0, cl, c0, n);
  auto done = cl.barrier_arrive();
  softmax_write(f, st, y + row * sy, c0, n);
  cl.barrier_wait(std::move(done));
}

// softmax_fwd as persistent clusters with the next row in flight (as norm_fwd_loop).
template <typename T, int E>
__global__ void __launch_bounds__(THREADS) softmax_fwd_loop(const T* __restrict__ x, int64_t sx,
                                                       T* __restrict__ y, int64_t sy, int n_rows, int n) {
  __shared__ Scratch<2> s;
  cg::cluster_group cl = cg::this_cluster();
  const int ranks = static_cast<int>(cl.num_blocks());
  const int cluster = blockIdx.x / ranks, clusters = gridDim.x / ranks;
  const int c0 = static_cast<int>(cl.block_rank()) * (E * THREADS);
  Packed<T, E> f, next;  // this row's chunk, and the next row's, in flight
  int row = cluster, slot = 0;
  if (row < n_rows) f.load(x + static_cast<int64_t>(row) * sx, c0, n);
  for (; row < n_rows; row += clusters, slot ^= 1) {
    if (row + clusters < n_rows) next.load(x + static_cast<int64_t>(row + clusters) * sx, c0, n);
    softmax_write(f, softmax_stats(f, s, slot, cl, c0, n), y + static_cast<int64_t>(row) * sy, c0, n);
    f = next;
  }
  cl.sync();
}

template <typename T, int E, int OCC = 0>
__global__ void __launch_bounds__(THREADS, OCC) softmax_bwd(const T* __restrict__ y, int64_t sy,
                                                       const T* __restrict__ dy, int64_t sdy,
                                                       T* __restrict__ dx, int64_t sdx, int n) {
  using F = Packed<T, E>;
  constexpr int V = F::V;
  __shared__ Scratch<1> s;
  cg::cluster_group cl = cg::this_cluster();
  const int ranks = static_cast<int>(cl.num_blocks());
  const int64_t row = blockIdx.x / ranks;
  const int c0 = static_cast<int>(cl.block_rank()) * (E * THREADS);
  F fy, fd;
  fy.load(y + row * sy, c0, n);
  fd.load(dy + row * sdy, c0, n);
  float a[1] = {0.f};
#pragma unroll
  for (int i = 0; i < F::N; ++i)
#pragma unroll
    for (int j = 0; j < V; ++j) a[0] += fy.at(i, j) * fd.at(i, j);  // padding loads as 0
  cluster_sum(a, s, 0, cl);
  auto done = cl.barrier_arrive();
  store_chunk<F>(dx + row * sdx, c0, n, [&](int i, int, float (&o)[V]) {
#pragma unroll
    for (int j = 0; j < V; ++j) o[j] = fy.at(i, j) * (fd.at(i, j) - a[0]);
  });
  cl.barrier_wait(std::move(done));
}

// ------------------------------------------------------------------------------------ host side

enum DType { F32 = 0, F16 = 1, BF16 = 2 };

// Let `kernel` run in clusters of `cluster` CTAs with `smem` bytes of dynamic shared memory. Past
// the portable 8 CTAs the cluster size must be asked for; so must dynamic shared memory whenever
// it and the kernel's static shared memory together pass 48 KB, so any is asked for (the attribute
// then holds exactly `smem`). False if the driver refused (cudaGetLastError says why).
template <typename... P>
bool allow(void (*kernel)(P...), int cluster, int smem) {
  if (cluster > 8 && cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess)
    return false;
  return smem == 0 ||
         cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) == cudaSuccess;
}

// Launch `kernel` on `grid` CTAs in clusters of `cluster` along x, with `smem` bytes of dynamic
// shared memory. nullptr or the error's text.
template <typename... P, typename... A>
const char* launch(void (*kernel)(P...), int grid, int cluster, int smem, cudaStream_t stream, A... args) {
  if (!allow(kernel, cluster, smem)) return cudaGetErrorString(cudaGetLastError());
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid, 1, 1);
  cfg.blockDim = dim3(THREADS, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, static_cast<P>(args)...);
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// Clusters of `cluster` CTAs of `kernel` that fit on the GPU at once. 0 if none, with `why` set
// to the CUDA error or the reason: the caller must not launch the persistent kernel then.
template <typename... P>
int max_clusters(void (*kernel)(P...), int cluster, int smem, const char*& why) {
  if (!allow(kernel, cluster, smem)) {
    why = cudaGetErrorString(cudaGetLastError());
    return 0;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(cluster, 1, 1);
  cfg.blockDim = dim3(THREADS, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int n = 0;
  const cudaError_t err = cudaOccupancyMaxActiveClusters(&n, kernel, &cfg);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    why = cudaGetErrorString(err);
    return 0;
  }
  if (n <= 0) why = "no cluster of this size fits on the GPU";
  return n;
}

// CTAs per row for rows of n values, E values per thread (the caller checks it is <= MAX_CLUSTER).
inline int cluster_for(int n, int e) { return (n + e * THREADS - 1) / (e * THREADS); }

// The kernels' dispatch: dtype (then the tile and the norms' switches) -> one template instance.
#define CR_DTYPES(DT, ...)                                   \
  switch (DT) {                                              \
    case F32: { using T = float; __VA_ARGS__; } break;       \
    case F16: { using T = __half; __VA_ARGS__; } break;      \
    default: { using T = __nv_bfloat16; __VA_ARGS__; } break; \
  }

// The tiles (E, OCC) built for the packed kernels: (16, 0) and (32, 0) everywhere, and for 16-bit
// types a tile that holds more bytes in flight without spilling (ptxas -v, sm_90): 64 values a
// thread in 64 registers (4 CTAs an SM, 32 KB each) for the three forwards
// (scripts/cluster_rows_ptxas.py prints the table). Softmax's backward at 32 values takes 80
// registers (3 CTAs, two chunks each) at the compiler's own choice, so it needs no cap.
enum Kind { SOFTMAX_FWD, SOFTMAX_BWD, RMS_FWD, LAYER_FWD };
template <int KIND, typename T, int E, int OCC>
constexpr bool built() {
  if (OCC == 0) return E == 16 || E == 32;
  if (sizeof(T) != 2) return false;
  return E == 64 && OCC == 4 && KIND != SOFTMAX_BWD;
}
constexpr const char* TILE_MISSING = "no kernel is built for this (e, occ) tile and dtype";
// body(E, OCC) as std::integral_constants if the tile is built: a generic lambda's body is then
// instantiated only for the tiles that exist.
template <int KIND, typename T, int E, int OCC, class Body>
void with_tile(Body&& body, const char*& err) {
  if constexpr (built<KIND, T, E, OCC>())
    body(std::integral_constant<int, E>{}, std::integral_constant<int, OCC>{});
  else
    err = TILE_MISSING;
}
#define CR_TILE_CASE(EE, OO, KIND, EV, OV, ...)                                           \
  if ((EV) == (EE) && (OV) == (OO)) {                                                    \
    with_tile<KIND, T, EE, OO>(                                                          \
        [&](auto e_, auto occ_) {                                                        \
          constexpr int E = decltype(e_)::value, OCC = decltype(occ_)::value;            \
          __VA_ARGS__;                                                                   \
        },                                                                               \
        err);                                                                            \
  } else
#define CR_TILE(KIND, EV, OV, ...)                \
  CR_TILE_CASE(16, 0, KIND, EV, OV, __VA_ARGS__)  \
  CR_TILE_CASE(32, 0, KIND, EV, OV, __VA_ARGS__)  \
  CR_TILE_CASE(64, 4, KIND, EV, OV, __VA_ARGS__)  \
  err = TILE_MISSING;

// Launch a forward as one row per cluster, or (loop) as persistent clusters, as many as fit and at
// most one a row. pick(std::bool_constant<LOOP>) names the kernel; the persistent ones are built
// for the default forward tile, (32, 0), only (CAN_LOOP).
template <bool CAN_LOOP, class Pick, typename... A>
const char* launch_rows(Pick pick, bool loop, int rows, int cl, cudaStream_t st, A... args) {
  if (!loop) return launch(pick(std::false_type{}), rows * cl, cl, 0, st, args...);
  if constexpr (CAN_LOOP) {
    auto kernel = pick(std::true_type{});
    const char* why = nullptr;
    const int g = std::min(max_clusters(kernel, cl, 0, why), rows);
    if (g <= 0) return why;
    return launch(kernel, g * cl, cl, 0, st, args...);
  } else {
    return "the persistent forwards are built for tile (32, 0) only";
  }
}

const char* norm_fwd_launch(int dt, int e, int occ, bool loop, bool rms, bool bias, bool stats,
                            const void* x, int64_t sx, const void* w, const void* b, void* y, int64_t sy,
                            float* mean, float* rstd, int rows, int n, float eps, cudaStream_t st) {
  const int cl = cluster_for(n, e);
  const char* err = nullptr;
#define CR_NORM_FWD_GO(RMS_, BIAS_, STATS_)                                                            \
  err = launch_rows<OCC == 0 && E == 32>(                                                                         \
      [&](auto lp) {                                                                                   \
        if constexpr (decltype(lp)::value) return norm_fwd_loop<T, E, RMS_, BIAS_, STATS_>;            \
        else return norm_fwd<T, E, RMS_, BIAS_, STATS_, OCC>;                                           \
      },                                                                                               \
      loop, rows,                                                                                      \
      cl, st, (const T*)x, sx, (const T*)w, (const T*)b, (T*)y, sy, mean, rstd, rows, n, eps)
  if (rms) {
    CR_DTYPES(dt, CR_TILE(RMS_FWD, e, occ, {
      if (stats) CR_NORM_FWD_GO(true, false, true);
      else CR_NORM_FWD_GO(true, false, false);
    }))
  } else {
    CR_DTYPES(dt, CR_TILE(LAYER_FWD, e, occ, {
      if (bias && stats) CR_NORM_FWD_GO(false, true, true);
      else if (bias) CR_NORM_FWD_GO(false, true, false);
      else if (stats) CR_NORM_FWD_GO(false, false, true);
      else CR_NORM_FWD_GO(false, false, false);
    }))
  }
#undef CR_NORM_FWD_GO
  return err;
}

// The norms' backward tiles: E = 16 for every dtype, E = 32 for 16-bit types (at fp32, 32 values a
// thread in four chunks would not fit the registers of 2 CTAs an SM). body(kernel, smem) gets the
// instance for (T, e, rms, bias) and its dynamic shared memory; a generic lambda's body is then
// instantiated only for the tiles that exist.
template <typename T, int E, class Body>
void with_bwd_tile(bool rms, bool bias, Body&& body, const char*& err) {
  if constexpr (E == 16 || (E == 32 && sizeof(T) == 2)) {
    if (rms) body(norm_bwd<T, E, true, false>, bwd_sums_bytes<E, false>());
    else if (bias) body(norm_bwd<T, E, false, true>, bwd_sums_bytes<E, true>());
    else body(norm_bwd<T, E, false, false>, bwd_sums_bytes<E, false>());
  } else {
    err = TILE_MISSING;
  }
}
#define CR_NORM_BWD_TILE(body)                                            \
  if (e == 16) with_bwd_tile<T, 16>(rms, bias, body, err);                \
  else if (e == 32) with_bwd_tile<T, 32>(rms, bias, body, err);           \
  else err = TILE_MISSING;

// `clusters` persistent clusters, each writing one row of dw_part / db_part (the caller sizes them
// for that many: norm_bwd_clusters says how many fit, and more than one per row is wasted).
const char* norm_bwd_launch(int dt, int e, bool rms, bool bias, const void* dy, int64_t sdy,
                            const void* x, int64_t sx, const void* w, const float* mean,
                            const float* rstd, void* dx, int64_t sdx, float* dw_part, float* db_part,
                            int rows, int n, int clusters, cudaStream_t st) {
  if (clusters <= 0) return "norm_bwd_launch: clusters must be positive";
  const int cl = cluster_for(n, e);
  const char* err = nullptr;
  CR_DTYPES(dt, {
    auto go = [&](auto kernel, int smem) {
      err = launch(kernel, clusters * cl, cl, smem, st, (const T*)dy, sdy, (const T*)x, sx, (const T*)w, mean,
                   rstd, (T*)dx, sdx, dw_part, db_part, rows, n);
    };
    CR_NORM_BWD_TILE(go)
  })
  return err;
}

// Clusters the backward would launch (so the caller can size dw_part and db_part first); 0 if none
// fits or the tile is not built, with `why` set to the reason.
int norm_bwd_clusters(int dt, int e, bool rms, bool bias, int n, const char*& why) {
  const int cl = cluster_for(n, e);
  int g = 0;
  const char* err = nullptr;
  CR_DTYPES(dt, {
    auto fit = [&](auto kernel, int smem) { g = max_clusters(kernel, cl, smem, why); };
    CR_NORM_BWD_TILE(fit)
  })
  if (err) why = err;
  return err ? 0 : g;
}

const char* softmax_fwd_launch(int dt, int e, int occ, bool loop, const void* x, int64_t sx, void* y,
                               int64_t sy, int rows, int n, cudaStream_t st) {
  const int cl = cluster_for(n, e);
  const char* err = nullptr;
  CR_DTYPES(dt, CR_TILE(SOFTMAX_FWD, e, occ, {
    auto pick = [&](auto lp) {
      if constexpr (decltype(lp)::value) return softmax_fwd_loop<T, E>;
      else return softmax_fwd<T, E, OCC>;
    };
    err = launch_rows<OCC == 0 && E == 32>(pick, loop, rows, cl, st, (const T*)x, sx, (T*)y, sy, rows, n);
  }))
  return err;
}

const char* softmax_bwd_launch(int dt, int e, int occ, const void* y, int64_t sy, const void* dy,
                               int64_t sdy, void* dx, int64_t sdx, int rows, int n, cudaStream_t st) {
  const int cl = cluster_for(n, e);
  const char* err = nullptr;
  CR_DTYPES(dt, CR_TILE(SOFTMAX_BWD, e, occ, {
    err = launch(softmax_bwd<T, E, OCC>, rows * cl, cl, 0, st, (const T*)y, sy, (const T*)dy, sdy, (T*)dx,
                 sdx, n);
  }))
  return err;
}

}  // namespace cluster_rows
