// The PyTorch entry point of the warp-specialised FlashAttention backward (fa_ws_bwd.cu).
// kernels/cuda/fa_ws_bwd.py validates the inputs; these checks guard direct calls.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

std::vector<torch::Tensor> fa_ws_bwd(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor o,
                                     torch::Tensor lse, torch::Tensor dout, bool causal, double sm_scale,
                                     int64_t stages, int64_t group_heads, int64_t variant) {
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
  auto f32 = q.options().dtype(torch::kFloat32);
  auto stats = torch::empty({2, static_cast<int64_t>(BH) * fabwd_padded(N)}, f32);  // lse, delta
  auto dq_acc = torch::empty({static_cast<int64_t>(BH) * N, fabwd::D}, f32);
  auto dq = torch::empty_like(q);
  auto dk = torch::empty_like(k);
  auto dv = torch::empty_like(v);
  const auto in = [](const torch::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr()); };
  const auto out = [](torch::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr()); };
  const float qk_scale = static_cast<float>(sm_scale * 1.4426950408889634);  // scores in log2 units
  const char* err = fa_ws_backward(in(q), in(k), in(v), in(o), in(dout), lse.data_ptr<float>(),
                                   stats.data_ptr<float>(), dq_acc.data_ptr<float>(), out(dq), out(dk),
                                   out(dv), BH, N, qk_scale, static_cast<float>(sm_scale), causal,
                                   static_cast<int>(stages), static_cast<int>(group_heads), static_cast<int>(variant),
                                   at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == nullptr, "fa_ws_bwd: ", err ? err : "");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dq, dk, dv};
}
