// The PyTorch entry point of int4_gemv_mma.cu. kernels/quant/ (qgemv.py, cuda_int4.py) validates
// and repacks; these checks guard direct calls.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <torch/extension.h>

torch::Tensor int4_gemv_mma(torch::Tensor w, torch::Tensor sc, torch::Tensor x, int64_t nt,
                            int64_t s, int64_t d) {
  TORCH_CHECK(w.is_cuda() && sc.is_cuda() && x.is_cuda(), "w, sc and x must be CUDA tensors");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous bf16 [M, K] tensor");
  TORCH_CHECK(sc.scalar_type() == torch::kFloat16 && sc.dim() == 4 && sc.size(2) == 8 &&
                  sc.size(3) == 2 && sc.is_contiguous(),
              "sc must be the repacked fp16 [N/16, K/128, 8, 2] scales");
  const int M = x.size(0), K = x.size(1), N = sc.size(0) * 16, G = sc.size(1);
  TORCH_CHECK(M >= 1 && M <= 8, "x must have 1 to 8 rows, got ", M);
  TORCH_CHECK(K == 128 * G, "x has K = ", K, " but the weight was packed for K = ", 128 * G);
  TORCH_CHECK(w.is_contiguous() && w.numel() * w.element_size() == (int64_t)N * K / 2,
              "w must be the repacked int4 weight of N * K / 2 bytes");
  TORCH_CHECK(N % (16 * nt) == 0 && G % s == 0, "N must be a multiple of 16 nt and K / 128 of s");
  auto y = torch::empty({M, N}, x.options());
  const int rc = int4_gemv_mma_launch(nt, s, d, w.data_ptr(), sc.data_ptr(), x.data_ptr(),
                                      y.data_ptr(), M, N, K, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(rc == 0, "unknown configuration nt = ", nt, ", s = ", s, ", d = ", d);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}
