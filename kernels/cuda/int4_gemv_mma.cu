// Batch-1..8 int4 GEMV on tensor cores, with weights repacked offline into mma fragment order.
//
// y[m, n] = sum_k x[m, k] * q[n, k] * s[n, k / 128], q in [-8, 7], for M <= 8 rows of x.
//
// The trick (Marlin's, simplified): the weight is the A operand of mma.m16n8k16 (16 weight rows x 16
// k), x is the B operand (16 k x 8 columns: up to 8 rows of x, the rest zero). One 16-byte load per
// lane holds the A fragments of 4 consecutive k-steps of one 16-row tile, already in the register
// order the instruction wants, so the weights never touch shared memory: load, unpack with two
// integer instructions and one bf16x2 subtraction per pair, mma. Each warp owns NT tiles of 16 rows
// and a 1/S slice of K; the S warps of a block sum their partials through shared memory at the end.
//
// Layout made by kernels.quant.repack_int4_mma: for row tile rb (16 rows), group g (128 k), quad q
// (4 k-steps) and lane l, 16 bytes at uint4 index ((rb * G + g) * 2 + q) * 32 + l. Word i is k-step
// j = 4q + i; its nibble p holds code[r + 8 (p & 1), k0 + c + (p >> 2) + 8 ((p >> 1) & 1)] with
// r = 16 rb + l / 4, k0 = 128 g + 16 j, c = 2 (l % 4); codes are q + 8 in [0, 15]. Scales: one
// __half2 per (rb, g, l / 4): (s[r, g], s[r + 8, g]).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace gpu_brrr_int4 {

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 8 int4 codes of one word -> 4 bf16x2 registers (q = code - 8): OR each pair of nibbles into the
// mantissa of 128.0 (0x4300), giving 128 + code exactly, then subtract 136 from both halves.
__device__ __forceinline__ void unpack_word(uint32_t w, uint32_t (&a)[4]) {
  const __nv_bfloat162 bias = __floats2bfloat162_rn(136.0f, 136.0f);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t t = ((w >> (4 * j)) & 0x000F000Fu) | 0x43004300u;
    __nv_bfloat162 v = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&t), bias);
    a[j] = *reinterpret_cast<uint32_t*>(&v);
  }
}

template <int NT, int S, int D>
__global__ void __launch_bounds__(32 * S) int4_gemv_mma_kernel(
    const uint4* __restrict__ w, const __half2* __restrict__ sc, const __nv_bfloat16* __restrict__ x,
    __nv_bfloat16* __restrict__ y, int M, int N, int K) {
  // D: groups of weights in flight ahead of the one being multiplied (register buffers).
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int G = K / 128, per = G / S;
  const int rb0 = blockIdx.x * NT;  // first 16-row tile of this block
  const int lr = lane >> 2, c = 2 * (lane & 3);
  const bool has_x = lr < M;  // lane l supplies column l / 4 of B: row l / 4 of x
  const uint32_t* xr = reinterpret_cast<const uint32_t*>(x + (size_t)(has_x ? lr : 0) * K);

  float acc[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[t][i] = 0.f;

  const int g0 = warp * per, g1 = g0 + per;
  // buf[d] holds group g + d; x fragments of group g + 1 are loaded during group g.
  uint4 buf[D + 1][NT][2];
  uint32_t xb[8][2], xn[8][2];
  auto load_w = [&](uint4 (&dst)[NT][2], int g) {
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int q = 0; q < 2; ++q)
        dst[t][q] = g < g1 ? __ldg(w + (((size_t)(rb0 + t) * G + g) * 2 + q) * 32 + lane)
                           : make_uint4(0u, 0u, 0u, 0u);
  };
  auto load_x = [&](uint32_t (&dst)[8][2], int g) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int k = g * 128 + 16 * j + c;
      dst[j][0] = (has_x && g < g1) ? __ldg(xr + k / 2) : 0u;
      dst[j][1] = (has_x && g < g1) ? __ldg(xr + (k + 8) / 2) : 0u;
    }
  };
#pragma unroll
  for (int d = 0; d < D; ++d) load_w(buf[d], g0 + d);
  load_x(xb, g0);

  for (int g = g0; g < g1; ++g) {
    load_w(buf[D], g + D);  // in flight while this group computes
    load_x(xn, g + 1);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const uint32_t words[4] = {buf[0][t][q].x, buf[0][t][q].y, buf[0][t][q].z, buf[0][t][q].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          uint32_t a[4];
          unpack_word(words[i], a);
          mma_bf16(part, a, xb[4 * q + i][0], xb[4 * q + i][1]);
        }
      }
      // part[0..1]: row r = 16 (rb0 + t) + l / 4; part[2..3]: row r + 8; columns c, c + 1 (rows of x).
      const float2 s = __half22float2(sc[((size_t)(rb0 + t) * G + g) * 8 + lr]);
      acc[t][0] += part[0] * s.x;
      acc[t][1] += part[1] * s.x;
      acc[t][2] += part[2] * s.y;
      acc[t][3] += part[3] * s.y;
    }
#pragma unroll
    for (int d = 0; d < D; ++d)
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int q = 0; q < 2; ++q) buf[d][t][q] = buf[d + 1][t][q];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      xb[j][0] = xn[j][0];
      xb[j][1] = xn[j][1];
    }
  }

  // Sum the S warps' partials: red[warp][row][column of x].
  __shared__ float red[S][NT * 16][8];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    red[warp][16 * t + lr][c] = acc[t][0];
    red[warp][16 * t + lr][c + 1] = acc[t][1];
    red[warp][16 * t + lr + 8][c] = acc[t][2];
    red[warp][16 * t + lr + 8][c + 1] = acc[t][3];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < NT * 16 * 8; idx += 32 * S) {
    const int row = idx >> 3, m = idx & 7;
    if (m >= M) continue;
    float v = 0.f;
#pragma unroll
    for (int s = 0; s < S; ++s) v += red[s][row][m];
    y[(size_t)m * N + (size_t)rb0 * 16 + row] = __float2bfloat16(v);
  }
}

}  // namespace gpu_brrr_int4

// ---------------------------------------------------------------------------- launcher

// (NT, S, D) triples the launcher knows: tiles of 16 rows per warp, warps (K slices) per block,
// groups of weights prefetched ahead.
#define INT4_MMA_CONFIGS(X) \
  X(2, 8, 1) X(2, 8, 2) X(1, 8, 2) X(1, 16, 2) X(2, 16, 1) X(2, 4, 2) X(4, 8, 1) X(2, 8, 3)

// Returns 0 on success, -1 for an unknown (nt, s, d).
inline int int4_gemv_mma_launch(int nt, int s, int d, const void* w, const void* sc, const void* x, void* y,
                                int M, int N, int K, cudaStream_t stream) {
#define INT4_MMA_CASE(NT_, S_, D_)                                                          \
  if (nt == NT_ && s == S_ && d == D_) {                                                    \
    gpu_brrr_int4::int4_gemv_mma_kernel<NT_, S_, D_><<<N / (16 * NT_), 32 * S_, 0, stream>>>( \
        static_cast<const uint4*>(w), static_cast<const __half2*>(sc),                      \
        static_cast<const __nv_bfloat16*>(x), static_cast<__nv_bfloat16*>(y), M, N, K);    \
    return 0;                                                                               \
  }
  INT4_MMA_CONFIGS(INT4_MMA_CASE)
#undef INT4_MMA_CASE
  return -1;
}
