// The PyTorch entry point: validated tensors in, C out. Built together with the step files above.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <torch/extension.h>

torch::Tensor sgemm(torch::Tensor a, torch::Tensor b, int64_t step, int64_t config) {
  // Python (kernels/cuda/__init__.py) checks and pads; these checks guard direct calls.
  TORCH_CHECK(a.is_cuda() && b.is_cuda(), "a and b must be CUDA tensors");
  TORCH_CHECK(a.scalar_type() == torch::kFloat32 && b.scalar_type() == torch::kFloat32, "fp32 only");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0), "a[M, K] @ b[K, N]");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous(), "a and b must be contiguous");
  const int M = a.size(0), K = a.size(1), N = b.size(1);
  auto c = torch::empty({M, N}, a.options());
  const float* A = a.data_ptr<float>();
  const float* B = b.data_ptr<float>();
  float* C = c.data_ptr<float>();
  cudaStream_t s = at::cuda::getCurrentCUDAStream();
  LaunchInfo info;
  switch (step) {
    case 1: info = sgemm_01(M, N, K, A, B, C, s); break;
    case 2: info = sgemm_02(M, N, K, A, B, C, s); break;
    case 3: info = sgemm_03(M, N, K, A, B, C, s); break;
    case 4: info = sgemm_04(M, N, K, A, B, C, s); break;
    case 5: info = sgemm_05(M, N, K, A, B, C, s); break;
    case 6: info = sgemm_06(M, N, K, A, B, C, s); break;
    case 7: info = sgemm_07(config, M, N, K, A, B, C, s); break;
    case 8: info = sgemm_08(config, M, N, K, A, B, C, s); break;
    default: TORCH_CHECK(false, "step must be 1..8, got ", step);
  }
  TORCH_CHECK(info.block > 0, "unknown configuration ", config);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return c;
}
