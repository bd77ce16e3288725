// The PyTorch entry point of the warp-specialised FlashAttention backward (fa_ws_bwd.cu).
// kernels/cuda/fa_ws_bwd.py validates the inputs; these checks guard direct calls.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

std::vector<torch::Tensor> fa_ws_bwd(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor o,
                                     torch::Tensor lse, torch::Tensor dout, bool causal, double sm_scale) {
  for (const auto* t : {&q, &k, &v, &o, &dout}) {
    TORCH_CHECK(t->is_cuda() && t->scalar_type() == torch::kBFloat16 && t->is_contiguous(),
                "q, k, v, o and dout must be contiguous bf16 CUDA tensors");
    TORCH_CHECK(t->sizes() == q.sizes(), "q, k, v, o and dout must be [B, H, N, 128] alike");
  }
  TORCH_CHECK(q.dim() == 4 && q.size(3) == fabwd::D, "head dimension must be 128");
  TORCH_CHECK(lse.is_cuda() && lse.scalar_type() == torch::kFloat32 && lse.is_contiguous() &&
                  lse.numel() == q.size(0) * q.size(1) * q.size(2),
              "lse must be a contiguous fp32 [B, H, N] CUDA tensor");
  const c10::cuda::OptionalCUDAGuard guard(q.device());
  const int BH = q.size(0) * q.size(1), N = q.size(2);
  // delta_i = sum_d dO_id O_id, the row term of dS = P (dP - delta).
  auto delta = (dout.to(torch::kFloat32) * o.to(torch::kFloat32)).sum(-1).contiguous();
  auto dq_acc = torch::zeros({static_cast<int64_t>(BH) * N, fabwd::D}, q.options().dtype(torch::kFloat32));
  auto dk = torch::empty_like(k);
  auto dv = torch::empty_like(v);
  const auto ptr = [](const torch::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr()); };
  const float qk_scale = static_cast<float>(sm_scale * 1.4426950408889634);  // scores in log2 units
  const char* err = fa_ws_backward(ptr(q), ptr(k), ptr(v), ptr(dout), lse.data_ptr<float>(),
                                   delta.data_ptr<float>(), dq_acc.data_ptr<float>(),
                                   reinterpret_cast<bf16*>(dk.data_ptr()), reinterpret_cast<bf16*>(dv.data_ptr()),
                                   BH, N, qk_scale, static_cast<float>(sm_scale), causal,
                                   at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == nullptr, "fa_ws_bwd: ", err ? err : "");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // dS carries no factor of sm_scale yet: dQ = sm_scale dS K, rounded once to bf16.
  auto dq = (dq_acc * sm_scale).to(torch::kBFloat16).view(q.sizes());
  return {dq, dk, dv};
}
