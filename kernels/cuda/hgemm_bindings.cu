// The PyTorch entry point of the Hopper ladder (hgemm_*.cu). kernels/cuda/__init__.py validates,
// transposes B to Bt[N, K] and pads K; these checks guard direct calls.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

torch::Tensor hgemm(torch::Tensor a, torch::Tensor bt, int64_t step) {
  TORCH_CHECK(a.is_cuda() && bt.is_cuda(), "a and bt must be CUDA tensors");
  TORCH_CHECK(a.scalar_type() == torch::kBFloat16 && bt.scalar_type() == torch::kBFloat16, "bf16 only");
  TORCH_CHECK(a.dim() == 2 && bt.dim() == 2 && a.size(1) == bt.size(1), "a[M, K] @ bt[N, K]^T");
  TORCH_CHECK(a.is_contiguous() && bt.is_contiguous(), "a and bt must be contiguous");
  TORCH_CHECK(a.size(1) % 8 == 0, "K must be a multiple of 8 (16-byte rows), got ", a.size(1));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(bt.data_ptr()) % 16 == 0,
              "a and bt must be 16-byte aligned");
  const c10::cuda::OptionalCUDAGuard guard(a.device());
  const int M = a.size(0), K = a.size(1), N = bt.size(0);
  // Step 12 stores C with TMA, which needs a row pitch of a multiple of 16 bytes: C gets a pitch of
  // N rounded up to 8 columns, and the first N columns are returned (copied only when N % 8 != 0).
  const int ldc = step == 12 ? (N + 7) / 8 * 8 : N;
  auto c = torch::empty({M, ldc}, a.options());
  const bf16* A = reinterpret_cast<const bf16*>(a.data_ptr());
  const bf16* Bt = reinterpret_cast<const bf16*>(bt.data_ptr());
  bf16* C = reinterpret_cast<bf16*>(c.data_ptr());
  cudaStream_t s = at::cuda::getCurrentCUDAStream();
  HgemmLaunch info;
  switch (step) {
    case 9: info = hgemm_09(M, N, K, A, Bt, C, s); break;
    case 10: info = hgemm_10(M, N, K, A, Bt, C, s); break;
    case 11: info = hgemm_11(M, N, K, A, Bt, C, s); break;
    case 12: info = hgemm_12(M, N, K, A, Bt, C, ldc, s); break;
    default: TORCH_CHECK(false, "step must be 9..12, got ", step);
  }
  TORCH_CHECK(info.error == nullptr, "hgemm step ", step, ": ", info.error ? info.error : "");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return ldc == N ? c : c.narrow(1, 0, N).contiguous();
}
