// Step 7: tuned parameters. Step 6's kernel is a template over the tile shape (BM, BN, BK) and the
// per-thread patch (TM, TN). Which shape is best depends on the GPU (SM count, shared memory, register
// file): rather than guess, we compile every configuration below that satisfies the launch
// constraints (checked by static_asserts in launch_vectorize: whole float4 load passes, 32-1024
// threads; the compiler rejects more than 48 KiB of static shared memory) and time them all on the
// GPU at hand (kernels.cuda.tune()). The list is the search space; the winner per GPU is stored in
// kernels/cuda/sgemm_tuned.json and used by step 7.
// clang-format off
#define SGEMM_TUNE_CONFIGS(X) \
  X(64, 64, 8, 8, 8) \
  X(64, 64, 8, 8, 4) \
  X(64, 64, 8, 4, 8) \
  X(64, 64, 16, 8, 8) \
  X(64, 64, 16, 8, 4) \
  X(64, 64, 16, 4, 8) \
  X(64, 64, 32, 8, 8) \
  X(64, 64, 32, 8, 4) \
  X(64, 64, 32, 4, 8) \
  X(64, 128, 8, 8, 8) \
  X(64, 128, 16, 8, 8) \
  X(64, 128, 16, 8, 4) \
  X(64, 128, 16, 4, 8) \
  X(64, 128, 32, 8, 8) \
  X(64, 128, 32, 8, 4) \
  X(64, 128, 32, 4, 8) \
  X(64, 256, 16, 8, 8) \
  X(64, 256, 32, 8, 8) \
  X(64, 256, 32, 8, 4) \
  X(64, 256, 32, 4, 8) \
  X(128, 64, 8, 8, 8) \
  X(128, 64, 16, 8, 8) \
  X(128, 64, 16, 8, 4) \
  X(128, 64, 16, 4, 8) \
  X(128, 64, 32, 8, 8) \
  X(128, 64, 32, 8, 4) \
  X(128, 64, 32, 4, 8) \
  X(128, 128, 8, 8, 8) \
  X(128, 128, 16, 8, 8) \
  X(128, 128, 16, 8, 4) \
  X(128, 128, 16, 4, 8) \
  X(128, 128, 32, 8, 8) \
  X(128, 128, 32, 8, 4) \
  X(128, 128, 32, 4, 8) \
  X(128, 256, 16, 8, 8) \
  X(128, 256, 32, 8, 8) \
  X(128, 256, 32, 8, 4) \
  X(128, 256, 32, 4, 8) \
  X(256, 64, 16, 8, 8) \
  X(256, 64, 32, 8, 8) \
  X(256, 64, 32, 8, 4) \
  X(256, 64, 32, 4, 8) \
  X(256, 128, 16, 8, 8) \
  X(256, 128, 32, 8, 8) \
  X(256, 128, 32, 8, 4) \
  X(256, 128, 32, 4, 8) \
  X(256, 256, 16, 8, 8)
// clang-format on

LaunchInfo sgemm_07(int config, int M, int N, int K, const float* A, const float* B, float* C,
                    cudaStream_t s) {
  int i = 0;
#define SGEMM_TRY(BM, BN, BK, TM, TN) \
  if (config == i++) return launch_vectorize<BM, BN, BK, TM, TN>(M, N, K, A, B, C, s);
  SGEMM_TUNE_CONFIGS(SGEMM_TRY)
#undef SGEMM_TRY
  return {-1, -1, -1};  // unknown configuration: nothing launched
}
