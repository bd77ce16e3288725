// Shared by every step of the Hopper ladder (steps 9-12): C[M, N] = A[M, K] @ B[K, N] with bf16 inputs,
// fp32 accumulation and a bf16 result. kernels/cuda/__init__.py concatenates this header and the step
// files in order and builds them, separately from the SGEMM ladder, for sm_90a only: wgmma and
// setmaxnreg exist on no other target (the "a" is for architecture-specific features that later
// GPUs do not promise to keep).
//
// Layouts. A is row-major [M, K]; B is passed *transposed*, Bt[N, K] row-major, so that both operands
// are K-major (K contiguous), the layout wgmma reads without its transpose bits and the one every
// Hopper GEMM tutorial builds on. kernels.cuda.hgemm passes b.t() when b is already the transpose
// of a contiguous tensor (nn.Linear's weight) and otherwise copies once. C is row-major [M, N].
//
// Shared-memory tiles are BK = 64 bf16 wide: one row of a tile is exactly 128 bytes, the span of the
// 128-byte swizzle. Each step defines its kernel(s) and a host launcher
// `hgemm_NN(M, N, K, A, Bt, C, stream)` returning the launch it made (step 12 also takes C's row
// pitch: its TMA store needs one of a multiple of 16 bytes).
#include <cuda.h>          // CUtensorMap and its enums: types only, nothing from libcuda is linked
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled, the driver function's type
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#define HG_CEIL_DIV(a, b) (((a) + (b) - 1) / (b))

typedef __nv_bfloat16 bf16;

// The launch a host launcher made; error is nullptr when it launched.
struct HgemmLaunch {
  int grid_x, grid_y, block, smem_bytes;
  const char* error;
};

// ----------------------------------------------------------------------------- shared memory

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The first 1024-byte boundary at or after the dynamic shared-memory base (the kernels allocate 1 KB
// of slack for it). The 128-byte swizzle repeats every 8 rows x 128 bytes = 1024 bytes, and both the
// tensor cores (through the descriptor's base offset of 0) and TMA compute it from address bits, so
// every tile must start on such a boundary.
__device__ __forceinline__ uint32_t smem_base_1024(const void* dynamic_smem) {
  return (smem_u32(dynamic_smem) + 1023u) & ~1023u;
}

// The 128-byte swizzle (CUTLASS's Swizzle<3, 4, 3> on byte addresses, TMA's
// CU_TENSOR_MAP_SWIZZLE_128B): in a tile of 128-byte rows starting on a 1024-byte boundary, the
// 16-byte chunk `chunk` (0-7) of row `row` is stored at chunk index chunk ^ (row % 8). Eight
// consecutive rows therefore put their chunk 0 in eight different 16-byte bank groups, which is what
// lets the tensor cores read an 8x16-byte core matrix (8 rows, same k) without bank conflicts.
__host__ __device__ __forceinline__ uint32_t swizzle_128b(int row, int chunk) {
  return static_cast<uint32_t>(row * 128 + ((chunk ^ (row & 7)) << 4));
}

// ----------------------------------------------------------------------------- wgmma

// The 64-bit shared-memory matrix descriptor of wgmma (PTX ISA, "Matrix Descriptor Format"), for a
// K-major operand in 128-byte swizzled rows:
//   bits  0-13  start address >> 4 (matrix-descriptor-encode(x) = (x & 0x3FFFF) >> 4)
//   bits 16-29  leading-dimension byte offset >> 4: not used by swizzled K-major layouts ("assumed
//               1"); we write 1 (16 bytes) like CUTLASS
//   bits 32-45  stride-dimension byte offset >> 4: from one group of 8 rows to the next = 8 x 128 B
//               = 1024 B, encoded 64
//   bits 49-51  base offset: 0, because every tile starts on a 1024-byte boundary
//   bits 62-63  swizzle mode: 1 = 128-byte swizzle
// Moving along K inside the 128-byte row (k16 step kk = 32 bytes) just adds 32 * kk to the start
// address: the hardware applies the swizzle to the address bits, as TMA did when it wrote them.
// REVIEW: read against the PTX ISA (descriptor fields, SBO 1024, swizzle mode 1 at bits 62-63, the
// +32 B start-address step per k16 with base offset 0 on 1024-aligned tiles) and it agrees with
// swizzle_128b and with TMA's SWIZZLE_128B; LBO = 1 relies on the ISA's "not used" for swizzled
// K-major operands whose k16 slice stays inside one 128-byte row. Unrun: the first GPU check is
// step 9 with hgemm_check.diagnose(9) (A = I and B = I must come back exact); a wrong descriptor,
// swizzle or k-step shows there as moved rows/columns before any timing is worth taking.
__device__ __forceinline__ uint64_t desc_k128(uint32_t smem_addr) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(16 >> 4) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (1ull << 62);
}

// Order this warpgroup's earlier register and shared-memory accesses before the wgmma that follow
// (required before the first wgmma, and after the accumulators are touched by other instructions).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
// Close the wgmma issued since the last commit into one group that wgmma_wait can count.
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Wait until at most N committed groups are still running (N = 0: all done, accumulators readable
// and their shared-memory operands free to overwrite).
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// An empty asm that "reads and writes" every accumulator register: the compiler may not move any
// computation on them across it. Placed after wgmma_wait (and before the first wgmma) so the
// epilogue's reads cannot be scheduled while the asynchronous MMA still owns the registers.
template <int R>
__device__ __forceinline__ void fence_operands(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The 64 fp32 accumulators of one m64n128 wgmma in inline PTX: HG_WGMMA_D64 is the register list
// (operands %0-%63), HG_WGMMA_ACC64(d) the matching "+f" operands. The wgmma wrappers here and in
// fa_ws.cu put their other operands at %64 on.
#define HG_WGMMA_D64                                                                            \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                     \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "            \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "            \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define HG_WGMMA_ACC64(d)                                                                       \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),  \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), \
      "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), \
      "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), \
      "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), \
      "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// wgmma.mma_async with both operands from shared memory, fp32 accumulate, D += A @ B (scale-d = 1:
// the accumulators are zeroed in registers first). The last four immediates: scale A and B by +1,
// no transpose of A or B (both K-major).
// d[64] += A(64x16, descriptor a) @ B(16x128, descriptor b): one warpgroup-wide MMA, both K-major.
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t a, uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16\n" HG_WGMMA_D64
      ", %64, %65, p, 1, 1, 0, 0;\n}\n"
      : HG_WGMMA_ACC64(d)
      : "l"(a), "l"(b), "n"(1)
      : "memory");
}

// d[128] += A(64x16, descriptor a) @ B(16x256, descriptor b): one warpgroup-wide MMA, both K-major.
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t a, uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16\n{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(a), "l"(b), "n"(1)
      : "memory");
}

// ----------------------------------------------------------------------------- async copies

// cp.async of 16 bytes global -> shared; src_bytes = 0 copies nothing and zero-fills the 16 bytes
// (the predication of steps 9's edge tiles).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Shared memory written through the generic proxy (ordinary stores, cp.async) and read next by the
// async proxy (wgmma, TMA) needs this fence in each writing thread before the barrier that publishes
// the writes.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ----------------------------------------------------------------------------- mbarrier

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Make the initialised barriers visible to the other threads and to the async proxy (TMA) before
// anyone uses them (followed by a __syncthreads).
// REVIEW: fence.mbarrier_init + a CTA/cluster barrier is what CUTLASS's pipelines use before TMA
// signals the barriers; some hand-written Hopper GEMMs also issue fence.proxy.async.shared::cta
// after the inits. Not needed by my reading of the ISA; if step 10 ever hangs on its FIRST k-tile
// with a correct parity, adding that fence here is the cheap experiment.
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also tells the barrier to expect `bytes` more bytes of TMA transactions before
// its phase can complete.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Spin until the phase of parity `parity` has completed. A barrier starts in phase 0, and phase n
// completes when its pending arrivals and transaction bytes reach zero for the (n + 1)-th time; so
// the n-th fill (n = 0, 1, ...) of a ring slot is waited for with parity n & 1.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// ----------------------------------------------------------------------------- TMA

// One 2-D tile (box) of `map` at element coordinates (c0 = column, innermost; c1 = row) into shared
// memory at `dst`, completing `bytes` of transactions on `bar`. Parts of the box outside the tensor
// are filled with zeros and still count as bytes: the edge tiles need no predication.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0,
                                            int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}

// ----------------------------------------------------------------------------- epilogue

// Store one warpgroup's 64 x NN accumulator fragment (of a wgmma m64nNNk16) as bf16 at rows row0..,
// columns col0.. of C[M, N], predicated on M and N. The fragment layout (PTX ISA, "WGMMA .m64nNk16
// register fragment layout for accumulator matrix D"): warp w of the warpgroup owns rows 16w..16w+15;
// in it, lane l holds, for each 8-column block j, d[4j + 0, 1] at row l/4, columns 8j + 2(l%4) + 0, 1
// and d[4j + 2, 3] at row l/4 + 8, the same columns.
template <int NN>
__device__ __forceinline__ void store_fragment(const float (&d)[NN / 2], bf16* C, int M, int N, int row0,
                                               int col0) {
  const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  const int r = row0 + warp * 16 + lane / 4;
  const bool pairs = (N % 2) == 0;  // a bf16 pair at an even column is 4-byte aligned
#pragma unroll
  for (int j = 0; j < NN / 8; ++j) {
    const int c = col0 + 8 * j + 2 * (lane % 4);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = r + 8 * h;
      if (row >= M || c >= N) continue;
      bf16* p = C + static_cast<int64_t>(row) * N + c;
      const float x = d[4 * j + 2 * h], y = d[4 * j + 2 * h + 1];
      if (pairs) {
        *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
      } else {
        p[0] = __float2bfloat16_rn(x);
        if (c + 1 < N) p[1] = __float2bfloat16_rn(y);
      }
    }
  }
}

// ----------------------------------------------------------------------------- host: tensor maps

// cuTensorMapEncodeTiled is a driver function; asking the runtime for its address
// (cudaGetDriverEntryPointByVersion) avoids linking libcuda into the extension.
static PFN_cuTensorMapEncodeTiled_v12000 hgemm_encode_tiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  if (fn == nullptr) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found;
#if CUDART_VERSION >= 12050  // the versioned query; the unversioned one is deprecated in CUDA 13
    const cudaError_t rc = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                                            cudaEnableDefault, &found);
#else
    const cudaError_t rc =
        cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &p, cudaEnableDefault, &found);
#endif
    if (rc == cudaSuccess && found == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }
  return fn;
}

// The tensor map of a row-major bf16 matrix [rows, cols] read in boxes of box_rows x 64 columns
// (64 bf16 = 128 bytes, the widest box the 128-byte swizzle allows) written to shared memory with
// the 128-byte swizzle. Needs a row pitch of a multiple of 16 bytes (cols % 8 == 0, or a padded
// pitch `ld` >= cols with ld % 8 == 0: step 12's output) and a 16-byte aligned base; out-of-bounds
// elements read as zero (OOB_FILL_NONE) and are not written by a TMA store (step 12).
// REVIEW: CHECK_SHAPES (1, 1, 8) and (64, 8, 200) give boxes larger than the whole tensor (a 64 x
// 128 box over K = 8, M = 1). Neither the ISA nor the driver API forbids it and the complete_tx of
// such a box is still the full box (the expect_tx values assume it); a GPU run must see the encode
// accepted (an error here names the call, it does not hang) and those shapes finish under
// run_check's timeout.
static const char* hgemm_tensor_map(CUtensorMap* map, const bf16* ptr, int rows, int cols,
                                    int box_rows, int ld = 0) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = hgemm_encode_tiled();
  if (encode == nullptr) return "cuTensorMapEncodeTiled not found (driver too old for CUDA 12 TMA?)";
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t pitch = static_cast<cuuint64_t>(ld > 0 ? ld : cols);
  const cuuint64_t strides[1] = {pitch * sizeof(bf16)};  // bytes, dim 1
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult rc =
      encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<bf16*>(ptr), dims, strides, box,
             elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return rc == CUDA_SUCCESS ? nullptr : "cuTensorMapEncodeTiled rejected the tensor map";
}

// Raise a kernel's dynamic shared-memory limit past the default 48 KB (nullptr when it worked).
template <typename Kernel>
static const char* hgemm_allow_smem(Kernel kernel, int bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) ==
                 cudaSuccess
             ? nullptr
             : "cudaFuncSetAttribute(MaxDynamicSharedMemorySize) failed";
}
