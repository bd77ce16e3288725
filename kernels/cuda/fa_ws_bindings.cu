// The PyTorch entry point of the warp-specialised FlashAttention forward (fa_ws.cu).
// kernels/cuda/fa_ws.py validates the inputs; these checks guard direct calls.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

std::vector<torch::Tensor> fa_ws(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool causal,
                                 double sm_scale, int64_t schedule) {
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "q, k and v must be CUDA tensors");
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && k.scalar_type() == torch::kBFloat16 &&
                  v.scalar_type() == torch::kBFloat16,
              "bf16 only");
  TORCH_CHECK(q.dim() == 4 && q.sizes() == k.sizes() && q.sizes() == v.sizes(),
              "q, k and v must be [B, H, N, 128] alike");
  TORCH_CHECK(q.size(3) == faws::D, "head dimension must be 128, got ", q.size(3));
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "q, k, v must be contiguous");
  const c10::cuda::OptionalCUDAGuard guard(q.device());
  const int BH = q.size(0) * q.size(1), N = q.size(2);
  auto o = torch::empty_like(q);
  auto lse = torch::empty({q.size(0), q.size(1), N}, q.options().dtype(torch::kFloat32));
  const auto ptr = [](const torch::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr()); };
  const float qk_scale = static_cast<float>(sm_scale * 1.4426950408889634);  // scores in log2 units
  // The persistent schedule's tile counter, zeroed on this stream before the launch.
  torch::Tensor counter;
  if (schedule == 2 || schedule == 3) counter = torch::zeros({1}, q.options().dtype(torch::kInt32));
  const char* err = fa_ws_forward(ptr(q), ptr(k), ptr(v), reinterpret_cast<bf16*>(o.data_ptr()),
                                  lse.data_ptr<float>(), BH, N, qk_scale, causal, static_cast<int>(schedule),
                                  schedule == 2 || schedule == 3 ? counter.data_ptr<int>() : nullptr,
                                  at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == nullptr, "fa_ws: ", err ? err : "");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {o, lse};
}
