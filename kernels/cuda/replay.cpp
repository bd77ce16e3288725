// Replay of recorded Triton launches from C++: the host path of kernels.replay.
//
// A row-wise op (a norm, softmax), vector add, a small attention problem or a paged decode step is a
// few Triton kernels around a few fresh tensors. Python works out, once per input layout, which tensors to allocate
// and which compiled kernels to launch with which parameters (a Plan); this file allocates and
// launches them with no Python in between. The backward runs as a C++ autograd node, on the
// autograd engine's thread, without taking the GIL: the same path PyTorch's own ops take, and the
// reason for this file (page 3.4 measures it).
//
// Tensors live in numbered slots: the op's inputs first (x, weight, bias, vector add's x and y, or
// attention's q, k, v: three slots, absent ones undefined; an inference op's n inputs: n slots),
// the others are what the plan allocates. A
// kernel parameter is a slot's data pointer plus a byte offset, an integer, an fp32 bit pattern, or
// a null pointer (Triton's scratch).

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda.h>
#include <dlfcn.h>
#include <torch/extension.h>

#include <array>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

namespace {

enum Param : int64_t { PTR = 0, I32 = 1, I64 = 2, F32 = 3, NUL = 4 };
enum Alloc : int64_t { LIKE = 0, NEW = 1, SELECT = 2 };
constexpr int kSlots = 16;
constexpr int kMaxParams = 40;
using Slots = std::array<at::Tensor, kSlots>;

struct Launch {
  CUfunction fn;
  unsigned grid[3], threads, smem;
  bool pdl;  // a programmatic dependent launch: may start before the previous kernel has finished
  std::vector<int64_t> kind, slot, value;
};

struct Allocation {
  int64_t kind, slot, src, index, dtype;  // dtype: -1 the source slot's, 0 fp32
  std::vector<int64_t> shape;
};

struct Program {
  std::vector<Allocation> allocs;
  std::vector<Launch> launches;
};

struct Plan : torch::CustomClassHolder {
  Plan(Program f, Program n, Program b, int64_t y, int64_t dy, std::vector<int64_t> sv,
       std::vector<int64_t> g)
      : fwd(std::move(f)), fwd_nograd(std::move(n)), bwd(std::move(b)), y_slot(y), dy_slot(dy),
        saved(std::move(sv)), grads(std::move(g)) {}
  Program fwd, fwd_nograd, bwd;
  int64_t y_slot, dy_slot;
  std::vector<int64_t> saved;  // slots the backward needs, in order
  std::vector<int64_t> grads;  // per input (x, weight, bias): its gradient's slot, or -1
};

using PlanPtr = c10::intrusive_ptr<Plan>;
constexpr size_t kMaxPlans = 4096;  // distinct layouts kept; past it the cache starts over
std::mutex mutex;
std::map<std::vector<int64_t>, PlanPtr> plans;  // an autograd node keeps its own reference

// Everything the plan depends on: the op, each input's shape, strides, dtype, device and 16-byte
// alignment (Triton compiles a binary per alignment), and the op's scalar setting (a norm's eps,
// softmax's widest fused block, attention's scale or 0 for the default).
std::vector<int64_t> make_key(int64_t op, const std::vector<const at::Tensor*>& inputs,
                              double setting) {
  std::vector<int64_t> key{op};
  key.reserve(2 + 12 * inputs.size());
  int64_t bits;
  std::memcpy(&bits, &setting, sizeof bits);
  key.push_back(bits);
  for (const at::Tensor* t : inputs) {
    if (t == nullptr || !t->defined()) {
      key.push_back(-1);
      continue;
    }
    key.push_back(t->dim());
    for (auto s : t->sizes()) key.push_back(s);
    for (auto s : t->strides()) key.push_back(s);
    key.push_back(static_cast<int64_t>(t->scalar_type()));
    key.push_back(t->get_device());
    key.push_back(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0);
  }
  return key;
}

std::vector<int64_t> make_key(int64_t op, const at::Tensor& x, const std::optional<at::Tensor>& w,
                              const std::optional<at::Tensor>& b, double setting) {
  return make_key(op, {&x, w ? &*w : nullptr, b ? &*b : nullptr}, setting);
}

// Driver entry points from the libcuda torch has loaded, looked up once (as Triton's launcher
// does): no link-time dependency on libcuda.
void* driver_symbol(const char* name) {
  static void* lib = [] {
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (h == nullptr) h = dlopen("libcuda.so.1", RTLD_NOW);
    TORCH_CHECK(h != nullptr, "replay: cannot open libcuda.so.1");
    return h;
  }();
  void* f = dlsym(lib, name);
  TORCH_CHECK(f != nullptr, "replay: libcuda.so.1 has no ", name);
  return f;
}

using LaunchKernel = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                                  unsigned, unsigned, CUstream, void**, void**);
using LaunchKernelEx = CUresult (*)(const CUlaunchConfig*, CUfunction, void**, void**);
using CtxGetCurrent = CUresult (*)(CUcontext*);
using DeviceGet = CUresult (*)(CUdevice*, int);
using PrimaryCtxRetain = CUresult (*)(CUcontext*, CUdevice);
using CtxSetCurrent = CUresult (*)(CUcontext);

void check(CUresult res, const char* what) {
  TORCH_CHECK(res == CUDA_SUCCESS, "replay: ", what, " failed (CUresult ", res, ")");
}

// Makes the device's primary context (the one torch and Triton use) current on this thread if
// none is. The autograd engine runs a backward on a thread of its own, where the runtime API
// makes a context current lazily but the driver API, which launches here, needs it beforehand.
void ensure_context(int device_index) {
  static const auto get_current = reinterpret_cast<CtxGetCurrent>(driver_symbol("cuCtxGetCurrent"));
  CUcontext ctx = nullptr;
  check(get_current(&ctx), "cuCtxGetCurrent");
  if (ctx != nullptr) return;
  static const auto device_get = reinterpret_cast<DeviceGet>(driver_symbol("cuDeviceGet"));
  static const auto retain = reinterpret_cast<PrimaryCtxRetain>(driver_symbol("cuDevicePrimaryCtxRetain"));
  static const auto set_current = reinterpret_cast<CtxSetCurrent>(driver_symbol("cuCtxSetCurrent"));
  CUdevice dev;
  check(device_get(&dev, device_index), "cuDeviceGet");
  check(retain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  check(set_current(ctx), "cuCtxSetCurrent");
}

// A launch that may begin while the kernel before it on the stream is still running: the kernel
// waits (griddepcontrol.wait) where it needs that kernel's results. Triton's launcher does the same
// for a kernel compiled with launch_pdl.
void launch_dependent(const Launch& l, CUstream stream, void** params) {
  static const auto launch_ex = reinterpret_cast<LaunchKernelEx>(driver_symbol("cuLaunchKernelEx"));
  CUlaunchAttribute attr;
  std::memset(&attr, 0, sizeof attr);
  attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  attr.value.programmaticStreamSerializationAllowed = 1;
  CUlaunchConfig config;
  std::memset(&config, 0, sizeof config);
  config.gridDimX = l.grid[0];
  config.gridDimY = l.grid[1];
  config.gridDimZ = l.grid[2];
  config.blockDimX = l.threads;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.sharedMemBytes = l.smem;
  config.hStream = stream;
  config.attrs = &attr;
  config.numAttrs = 1;
  check(launch_ex(&config, l.fn, params, nullptr), "cuLaunchKernelEx");
}

// Allocates and launches a program on `s`; `ref` gives the device (x in the forward, the first
// saved tensor in the backward, where x itself may not be kept).
void run(const Program& prog, Slots& s, const at::Tensor& ref) {
  for (const auto& a : prog.allocs) {
    if (a.kind == LIKE) {
      s[a.slot] = at::empty_like(s[a.src], at::MemoryFormat::Contiguous);
    } else if (a.kind == NEW) {
      auto dtype = a.dtype < 0 ? s[a.src].scalar_type() : at::kFloat;
      s[a.slot] = at::empty(a.shape, ref.options().dtype(dtype));
    } else {
      s[a.slot] = s[a.src].select(0, a.index);
    }
  }
  auto stream = c10::cuda::getCurrentCUDAStream(ref.get_device()).stream();
  static const auto launch = reinterpret_cast<LaunchKernel>(driver_symbol("cuLaunchKernel"));
  ensure_context(ref.get_device());
  std::array<uint64_t, kMaxParams> store;
  std::array<void*, kMaxParams> ptrs;
  for (const auto& l : prog.launches) {
    if (l.grid[0] == 0 || l.grid[1] == 0 || l.grid[2] == 0) continue;  // as Triton's launcher
    const size_t n = l.kind.size();
    for (size_t i = 0; i < n; i++) {
      store[i] = 0;
      switch (l.kind[i]) {
        case PTR:
          store[i] = reinterpret_cast<uintptr_t>(s[l.slot[i]].data_ptr()) + l.value[i];
          break;
        case I32: {
          const int32_t v = static_cast<int32_t>(l.value[i]);
          std::memcpy(&store[i], &v, sizeof v);
          break;
        }
        case I64:
          store[i] = static_cast<uint64_t>(l.value[i]);
          break;
        case F32: {
          const uint32_t v = static_cast<uint32_t>(l.value[i]);
          std::memcpy(&store[i], &v, sizeof v);
          break;
        }
        default:  // NUL
          break;
      }
      ptrs[i] = &store[i];
    }
    if (l.pdl) {
      launch_dependent(l, stream, ptrs.data());
    } else {
      check(launch(l.fn, l.grid[0], l.grid[1], l.grid[2], l.threads, 1, 1, l.smem, stream,
                   ptrs.data(), nullptr),
            "cuLaunchKernel");
    }
  }
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

Slots input_slots(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  Slots s;
  s[0] = x;
  s[1] = w;
  s[2] = b;
  return s;
}

// The autograd node of an op with N tensor inputs (softmax: x; RMSNorm: x, weight; LayerNorm:
// x, weight, bias): one Function per arity, as autograd's Function takes defined tensors only.
at::Tensor forward_impl(AutogradContext* ctx, const PlanPtr& plan, const at::Tensor& x,
                        const at::Tensor& w, const at::Tensor& b) {
  const Plan& p = *plan;
  Slots s = input_slots(x, w, b);
  run(p.fwd, s, x);
  std::vector<at::Tensor> saved;
  for (auto i : p.saved) saved.push_back(s[i]);
  ctx->save_for_backward(saved);
  ctx->saved_data["plan"] = c10::IValue::make_capsule(plan);
  return s[p.y_slot];
}

// The gradients of the op's inputs (x, weight, bias; undefined past the op's own).
std::array<at::Tensor, 3> backward_impl(AutogradContext* ctx, const variable_list& grad_out) {
  const auto plan = c10::static_intrusive_pointer_cast<Plan>(ctx->saved_data["plan"].toCapsule());
  const Plan& p = *plan;
  const auto saved = ctx->get_saved_variables();
  Slots s;
  for (size_t i = 0; i < saved.size(); i++) s[p.saved[i]] = saved[i];
  const at::Tensor ref = s[p.saved[0]];
  TORCH_CHECK(ref.defined(), "replay: a saved tensor was freed (backward called twice?)");
  c10::cuda::CUDAGuard guard(ref.device());
  at::Tensor dy = grad_out[0];
  if (!dy.defined()) dy = at::zeros_like(ref, at::MemoryFormat::Contiguous);
  // The plan was made for a contiguous, 16-byte aligned dy of the saved tensor's dtype (what
  // autograd hands over almost always); anything else (an expanded gradient of .sum()) is copied.
  if (!dy.is_contiguous() || dy.scalar_type() != ref.scalar_type() ||
      reinterpret_cast<uintptr_t>(dy.data_ptr()) % 16 != 0) {
    dy = dy.to(ref.scalar_type()).clone(at::MemoryFormat::Contiguous);
  }
  s[p.dy_slot] = dy;
  run(p.bwd, s, ref);
  std::array<at::Tensor, 3> grads;
  for (size_t i = 0; i < p.grads.size(); i++) {
    if (p.grads[i] >= 0) grads[i] = s[p.grads[i]];
  }
  return grads;
}

struct RowOp1 : public torch::autograd::Function<RowOp1> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const PlanPtr& plan) {
    return forward_impl(ctx, plan, x, at::Tensor(), at::Tensor());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    auto g = backward_impl(ctx, grad_out);
    return {g[0], at::Tensor()};
  }
};

struct RowOp2 : public torch::autograd::Function<RowOp2> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const PlanPtr& plan) {
    return forward_impl(ctx, plan, x, w, at::Tensor());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    auto g = backward_impl(ctx, grad_out);
    return {g[0], g[1], at::Tensor()};
  }
};

struct RowOp3 : public torch::autograd::Function<RowOp3> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const at::Tensor& b, const PlanPtr& plan) {
    return forward_impl(ctx, plan, x, w, b);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    auto g = backward_impl(ctx, grad_out);
    return {g[0], g[1], g[2], at::Tensor()};
  }
};

}  // namespace

// The op's output if a plan for this layout exists (None otherwise: Python then checks the
// inputs, runs its own path, and adds a plan). Through autograd when a gradient is wanted.
std::optional<at::Tensor> row_op(int64_t op, const at::Tensor& x,
                                 const std::optional<at::Tensor>& w,
                                 const std::optional<at::Tensor>& b, double setting) {
  // Plans exist for dense CUDA tensors only: anything else (a CPU, meta or sparse tensor) goes to
  // the Python path, whose checks say what is wrong with it.
  for (const at::Tensor* t : {&x, w ? &*w : nullptr, b ? &*b : nullptr}) {
    if (t != nullptr && (!t->defined() || !t->is_cuda() || t->layout() != at::kStrided)) {
      return std::nullopt;
    }
  }
  const auto key = make_key(op, x, w, b, setting);
  PlanPtr plan;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = plans.find(key);
    if (it == plans.end() || it->second->saved.empty()) return std::nullopt;
    plan = it->second;
  }
  c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor wt = w ? *w : at::Tensor();
  const at::Tensor bt = b ? *b : at::Tensor();
  const bool grad = at::GradMode::is_enabled() &&
                    (x.requires_grad() || (wt.defined() && wt.requires_grad()) ||
                     (bt.defined() && bt.requires_grad()));
  if (grad) {
    if (bt.defined()) return RowOp3::apply(x, wt, bt, plan);
    if (wt.defined()) return RowOp2::apply(x, wt, plan);
    return RowOp1::apply(x, plan);
  }
  const Plan& p = *plan;
  Slots s = input_slots(x, wt, bt);
  run(p.fwd_nograd, s, x);
  return s[p.y_slot];
}

namespace {

// Decoding of what Python hands over (kernels/replay.py writes the same layout).
// launch: [function, grid x, y, z, threads, shared bytes, programmatic dependent (0 or 1), then
// (kind, slot, value) per parameter]
constexpr size_t kHeader = 7;
Launch decode_launch(const std::vector<int64_t>& v) {
  TORCH_CHECK(v.size() >= kHeader && (v.size() - kHeader) % 3 == 0, "replay: malformed launch");
  Launch l;
  l.fn = reinterpret_cast<CUfunction>(static_cast<uintptr_t>(v[0]));
  for (int i = 0; i < 3; i++) l.grid[i] = static_cast<unsigned>(v[1 + i]);
  l.threads = static_cast<unsigned>(v[4]);
  l.smem = static_cast<unsigned>(v[5]);
  l.pdl = v[6] != 0;
  const size_t n = (v.size() - kHeader) / 3;
  TORCH_CHECK(n <= kMaxParams, "replay: more than ", kMaxParams, " kernel parameters");
  for (size_t i = 0; i < n; i++) {
    const int64_t kind = v[kHeader + 3 * i], slot = v[kHeader + 1 + 3 * i];
    TORCH_CHECK(kind >= PTR && kind <= NUL, "replay: unknown parameter kind ", kind);
    TORCH_CHECK(kind != PTR || (slot >= 0 && slot < kSlots), "replay: slot out of range");
    l.kind.push_back(kind);
    l.slot.push_back(slot);
    l.value.push_back(v[kHeader + 2 + 3 * i]);
  }
  return l;
}

// allocation: [kind, slot, source slot, index, dtype, shape...]; `inputs` slots come before the
// first one a plan may allocate into.
Allocation decode_alloc(const std::vector<int64_t>& v, int64_t inputs) {
  TORCH_CHECK(v.size() >= 5, "replay: malformed allocation");
  Allocation a{v[0], v[1], v[2], v[3], v[4], std::vector<int64_t>(v.begin() + 5, v.end())};
  TORCH_CHECK(a.kind >= LIKE && a.kind <= SELECT, "replay: unknown allocation kind");
  TORCH_CHECK(a.slot >= inputs && a.slot < kSlots && a.src >= 0 && a.src < kSlots,
              "replay: allocation slot out of range");
  return a;
}

Program decode(const std::vector<std::vector<int64_t>>& allocs,
               const std::vector<std::vector<int64_t>>& launches, int64_t inputs = 3) {
  Program p;
  for (const auto& a : allocs) p.allocs.push_back(decode_alloc(a, inputs));
  for (const auto& l : launches) p.launches.push_back(decode_launch(l));
  return p;
}

}  // namespace

// Adds the plan for the layout of (x, w, b, setting).
void add_plan(int64_t op, const at::Tensor& x, const std::optional<at::Tensor>& w,
                 const std::optional<at::Tensor>& b, double setting,
                 const std::vector<std::vector<int64_t>>& fwd_allocs,
                 const std::vector<std::vector<int64_t>>& fwd_launches,
                 const std::vector<std::vector<int64_t>>& nograd_allocs,
                 const std::vector<std::vector<int64_t>>& nograd_launches,
                 const std::vector<std::vector<int64_t>>& bwd_allocs,
                 const std::vector<std::vector<int64_t>>& bwd_launches, int64_t y_slot,
                 int64_t dy_slot, const std::vector<int64_t>& saved,
                 const std::vector<int64_t>& grads) {
  TORCH_CHECK(!saved.empty() && grads.size() <= 3, "replay: malformed plan");
  auto plan = c10::make_intrusive<Plan>(decode(fwd_allocs, fwd_launches),
                                       decode(nograd_allocs, nograd_launches),
                                       decode(bwd_allocs, bwd_launches), y_slot, dy_slot, saved,
                                       grads);
  const auto key = make_key(op, x, w, b, setting);
  std::lock_guard<std::mutex> lock(mutex);
  if (plans.size() >= kMaxPlans) plans.clear();
  plans[key] = std::move(plan);
}

int64_t plan_count() {
  std::lock_guard<std::mutex> lock(mutex);
  return static_cast<int64_t>(plans.size());
}

// An inference op (paged decode: no autograd) with up to kSlots inputs, each in its own slot.

// The op's output if a plan for this layout exists, else None (as row_op).
std::optional<at::Tensor> inference_op(int64_t op, const std::vector<at::Tensor>& inputs,
                                       double setting) {
  if (inputs.empty() || inputs.size() > kSlots) return std::nullopt;
  std::vector<const at::Tensor*> refs;
  for (const auto& t : inputs) {
    if (!t.defined() || !t.is_cuda() || t.layout() != at::kStrided) return std::nullopt;
    refs.push_back(&t);
  }
  const auto key = make_key(op, refs, setting);
  PlanPtr plan;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = plans.find(key);
    if (it == plans.end() || !it->second->saved.empty()) return std::nullopt;
    plan = it->second;
  }
  c10::cuda::CUDAGuard guard(inputs[0].device());
  Slots s;
  for (size_t i = 0; i < inputs.size(); i++) s[i] = inputs[i];
  run(plan->fwd_nograd, s, inputs[0]);
  return s[plan->y_slot];
}

// Adds the plan of an inference op for the layout of `inputs` and `setting`.
void add_inference_plan(int64_t op, const std::vector<at::Tensor>& inputs, double setting,
                        const std::vector<std::vector<int64_t>>& allocs,
                        const std::vector<std::vector<int64_t>>& launches, int64_t y_slot) {
  const auto n = static_cast<int64_t>(inputs.size());
  TORCH_CHECK(n >= 1 && n <= kSlots && y_slot >= 0 && y_slot < kSlots, "replay: malformed plan");
  auto plan = c10::make_intrusive<Plan>(Program{}, decode(allocs, launches, n), Program{}, y_slot,
                                        -1, std::vector<int64_t>{}, std::vector<int64_t>{});
  std::vector<const at::Tensor*> refs;
  for (const auto& t : inputs) refs.push_back(&t);
  const auto key = make_key(op, refs, setting);
  std::lock_guard<std::mutex> lock(mutex);
  if (plans.size() >= kMaxPlans) plans.clear();
  plans[key] = std::move(plan);
}
