// The PyTorch entry points of the cluster row kernels (cluster_rows.cu). kernels/cuda/cluster_rows.py
// checks eligibility (dtype, 16-byte alignment, row stride, width); these checks guard direct calls.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

namespace {

int dtype_code(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return cluster_rows::F32;
    case torch::kFloat16: return cluster_rows::F16;
    case torch::kBFloat16: return cluster_rows::BF16;
    default: TORCH_CHECK(false, "cluster_rows: fp32, fp16 or bf16 only, got ", t.scalar_type());
  }
  return 0;
}

// A [rows, n] matrix whose rows are 16-byte aligned vectors of its dtype.
void check_rows(const char* name, const torch::Tensor& t, int64_t e) {
  TORCH_CHECK(t.is_cuda() && t.dim() == 2 && t.stride(1) == 1, "cluster_rows: ", name,
              " must be a CUDA [rows, n] matrix with unit column stride");
  const int64_t v = 16 / t.element_size();
  TORCH_CHECK(t.size(1) % v == 0 && t.stride(0) % v == 0 &&
                  reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
              "cluster_rows: ", name, "'s rows must be 16-byte aligned whole vectors");
  TORCH_CHECK(e == 16 || e == 32 || e == 64, "cluster_rows: e must be 16, 32 or 64, got ", e);
  const int64_t cl = (t.size(1) + e * cluster_rows::THREADS - 1) / (e * cluster_rows::THREADS);
  TORCH_CHECK(cl >= 1 && cl <= cluster_rows::MAX_CLUSTER, "cluster_rows: rows of ", t.size(1),
              " values need ", cl, " CTAs, more than a cluster holds (", cluster_rows::MAX_CLUSTER, ")");
  TORCH_CHECK(t.size(0) < (int64_t(1) << 31) / cl, "cluster_rows: too many rows");
}

void check(const char* err) { TORCH_CHECK(err == nullptr, "cluster_rows: ", err ? err : ""); }

}  // namespace

// -> [y, mean, rstd]: mean and rstd are fp32 [rows] (mean empty for RMSNorm; both empty without
// stats).
std::vector<torch::Tensor> cr_norm_fwd(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> b,
                                       double eps, bool rms, bool stats, int64_t e,
                                       int64_t occ, bool loop) {
  check_rows("x", x, e);
  TORCH_CHECK(w.is_contiguous() && w.numel() == x.size(1) && w.scalar_type() == x.scalar_type(),
              "cluster_rows: weight must be contiguous, [n] and of x's dtype");
  const bool bias = b.has_value() && b->defined();
  if (bias)
    TORCH_CHECK(b->is_contiguous() && b->numel() == x.size(1) && b->scalar_type() == x.scalar_type(),
                "cluster_rows: bias must be contiguous, [n] and of x's dtype");
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  const int64_t rows = x.size(0);
  auto y = torch::empty_like(x, torch::MemoryFormat::Contiguous);
  auto f32 = x.options().dtype(torch::kFloat32);
  auto rstd = torch::empty({stats ? rows : 0}, f32);
  auto mean = torch::empty({stats && !rms ? rows : 0}, f32);
  if (rows == 0) return {y, mean, rstd};
  check(cluster_rows::norm_fwd_launch(
      dtype_code(x), static_cast<int>(e), static_cast<int>(occ), loop, rms, bias, stats, x.data_ptr(), x.stride(0),
      w.data_ptr(), bias ? b->data_ptr() : w.data_ptr(), y.data_ptr(), y.stride(0),
      stats && !rms ? mean.data_ptr<float>() : nullptr, stats ? rstd.data_ptr<float>() : nullptr,
      static_cast<int>(rows), static_cast<int>(x.size(1)), static_cast<float>(eps),
      at::cuda::getCurrentCUDAStream()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {y, mean, rstd};
}

// -> [dx, partials]: partials is fp32 [1 or 2, G, n], the G clusters' column sums of dy * xhat
// (and of dy, with a bias); kernels.partial_sums adds them up.
std::vector<torch::Tensor> cr_norm_bwd(torch::Tensor dy, torch::Tensor x, torch::Tensor w,
                                       c10::optional<torch::Tensor> mean, torch::Tensor rstd, bool bias,
                                       int64_t e, int64_t clusters) {
  check_rows("x", x, e);
  check_rows("dy", dy, e);
  TORCH_CHECK(e == 16 || (e == 32 && x.element_size() == 2),
              "cluster_rows: the norms' backward is built for e 16 (and 32 for 16-bit types), got ", e);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type(), "cluster_rows: dy must match x");
  TORCH_CHECK(w.is_contiguous() && w.numel() == x.size(1) && w.scalar_type() == x.scalar_type(),
              "cluster_rows: weight must be contiguous, [n] and of x's dtype");
  const bool rms = !(mean.has_value() && mean->defined() && mean->numel() > 0);
  TORCH_CHECK(!(rms && bias), "cluster_rows: a bias needs LayerNorm's mean");
  TORCH_CHECK(rstd.scalar_type() == torch::kFloat32 && rstd.is_contiguous() && rstd.numel() == x.size(0),
              "cluster_rows: rstd must be fp32 [rows]");
  if (!rms)
    TORCH_CHECK(mean->scalar_type() == torch::kFloat32 && mean->is_contiguous() && mean->numel() == x.size(0),
                "cluster_rows: mean must be fp32 [rows]");
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  const int rows = static_cast<int>(x.size(0)), n = static_cast<int>(x.size(1));
  const int dt = dtype_code(x);
  const char* why = "no cluster of this size fits on the GPU";
  int g = clusters > 0 ? static_cast<int>(clusters)
                       : cluster_rows::norm_bwd_clusters(dt, static_cast<int>(e), rms, bias, n, why);
  TORCH_CHECK(g > 0, "cluster_rows: the backward cannot launch: ", why);
  if (g > rows) g = rows;
  auto dx = torch::empty_like(x, torch::MemoryFormat::Contiguous);
  auto partials = torch::empty({bias ? 2 : 1, std::max(g, 1), n}, x.options().dtype(torch::kFloat32));
  if (rows == 0) return {dx, partials.zero_()};
  check(cluster_rows::norm_bwd_launch(
      dt, static_cast<int>(e), rms, bias, dy.data_ptr(), dy.stride(0), x.data_ptr(), x.stride(0),
      w.data_ptr(), rms ? nullptr : mean->data_ptr<float>(), rstd.data_ptr<float>(), dx.data_ptr(),
      dx.stride(0), partials.data_ptr<float>(), bias ? partials[1].data_ptr<float>() : nullptr, rows, n, g,
      at::cuda::getCurrentCUDAStream()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dx, partials};
}

torch::Tensor cr_softmax_fwd(torch::Tensor x, int64_t e, int64_t occ, bool loop) {
  check_rows("x", x, e);
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  auto y = torch::empty_like(x, torch::MemoryFormat::Contiguous);
  if (x.size(0) == 0) return y;
  check(cluster_rows::softmax_fwd_launch(dtype_code(x), static_cast<int>(e), static_cast<int>(occ), loop,
                                         x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0),
                                         static_cast<int>(x.size(0)), static_cast<int>(x.size(1)),
                                         at::cuda::getCurrentCUDAStream()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

torch::Tensor cr_softmax_bwd(torch::Tensor y, torch::Tensor dy, int64_t e, int64_t occ) {
  check_rows("y", y, e);
  check_rows("dy", dy, e);
  TORCH_CHECK(dy.sizes() == y.sizes() && dy.scalar_type() == y.scalar_type(), "cluster_rows: dy must match y");
  const c10::cuda::OptionalCUDAGuard guard(y.device());
  auto dx = torch::empty_like(y, torch::MemoryFormat::Contiguous);
  if (y.size(0) == 0) return dx;
  check(cluster_rows::softmax_bwd_launch(dtype_code(y), static_cast<int>(e), static_cast<int>(occ),
                                         y.data_ptr(), y.stride(0), dy.data_ptr(), dy.stride(0), dx.data_ptr(),
                                         dx.stride(0), static_cast<int>(y.size(0)),
                                         static_cast<int>(y.size(1)), at::cuda::getCurrentCUDAStream()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return dx;
}
