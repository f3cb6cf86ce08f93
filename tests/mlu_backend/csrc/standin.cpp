// A stand-in accelerator registered on PrivateUse1 (renamed "mlu" from Python): test
// infrastructure for precisiondiff, never shipped. Its memory lives on the host; its kernels
// run the CPU's ATen kernels on that memory through aliasing CPU tensors, so in-place ops and
// views behave as on a real device. Like a vendor backend, it leaves a configurable set of ops
// unimplemented (they reach a boxed fallback that copies to the CPU and back), and it can plant
// numerical defects (narrow GEMM accumulator, truncating fp32->bf16 cast, flush-to-zero) and
// torch_mlu's silent conversions (float64 held as float32, int64 narrowed to int32 in some ops).
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace {

constexpr c10::DeviceType kMlu = c10::DeviceType::PrivateUse1;
std::atomic<int> g_device_count{2};
thread_local c10::DeviceIndex t_current = 0;
thread_local bool t_in_fallback = false;  // copies made by the CPU fallback are not read-backs

// ---- memory -----------------------------------------------------------------------------

std::atomic<int64_t> g_allocated{0};

void free_device(void* ctx) {
  auto* header = static_cast<int64_t*>(ctx);
  g_allocated -= header[0];
  c10::free_cpu(header);
}

// Device memory: host memory whose DataPtr says PrivateUse1. A 64-byte header keeps the size
// for the allocated-bytes counter (memory_allocated()).
struct DeviceAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    auto* header = static_cast<int64_t*>(c10::alloc_cpu(n + 64));
    header[0] = static_cast<int64_t>(n);
    g_allocated += static_cast<int64_t>(n);
    void* data = reinterpret_cast<char*>(header) + 64;
    return {data, header, &free_device, c10::Device(kMlu, t_current)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dst, const void* src, std::size_t n) const override { std::memcpy(dst, src, n); }
};
DeviceAllocator g_device_alloc;

std::mutex g_pinned_mutex;
std::set<const void*> g_pinned;

void free_pinned(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    g_pinned.erase(ptr);
  }
  c10::free_cpu(ptr);
}

// Pinned host memory: ordinary host memory, remembered so isPinnedPtr() can answer.
struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* ptr = c10::alloc_cpu(n);
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    g_pinned.insert(ptr);
    return {ptr, ptr, &free_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dst, const void* src, std::size_t n) const override { std::memcpy(dst, src, n); }
};
PinnedAllocator g_pinned_alloc;

REGISTER_ALLOCATOR(kMlu, &g_device_alloc);

// ---- device guard: a current device per thread; one always-complete stream per device -------

struct Guard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kMlu; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    if (d.index() != old.index()) setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kMlu, t_current); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.index() >= 0 && d.index() < g_device_count, "mlu stand-in: invalid device index ", int(d.index()));
    t_current = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override { t_current = d.index(); }
  c10::Stream getStream(c10::Device d) const noexcept override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override { return c10::Stream(c10::Stream::DEFAULT, s.device()); }
  c10::DeviceIndex deviceCount() const noexcept override { return static_cast<c10::DeviceIndex>(g_device_count.load()); }
  // Kernels run synchronously: every event has completed when it is recorded.
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return static_cast<c10::DeviceIndex>(g_device_count.load()); }
  void setCurrentDevice(c10::DeviceIndex d) const override { t_current = d; }
  c10::DeviceIndex getCurrentDevice() const override { return t_current; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override { auto old = t_current; t_current = d; return old; }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return exchangeDevice(d); }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override { return at::detail::getDefaultCPUGenerator(); }
  at::Generator getNewGenerator(c10::DeviceIndex) const override { return at::detail::createCPUGenerator(); }
  at::Device getDeviceFromPtr(void*) const override { return c10::Device(kMlu, t_current); }
  bool isPinnedPtr(const void* data) const override {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    return g_pinned.count(data) > 0;
  }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned_alloc; }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t n) const override {
    at::native::resize_bytes_cpu(storage.unsafeGetStorageImpl(), n);
  }
};
Hooks g_hooks;
const bool g_hooks_registered = (at::RegisterPrivateUse1HooksInterface(&g_hooks), true);

// ---- configuration set from Python ------------------------------------------------------

std::atomic<int64_t> g_gemm_chunk{0};     // > 0: bf16 GEMMs accumulate in bf16 every `chunk` terms
std::atomic<bool> g_truncate_cast{false};  // fp32 -> bf16 on the device rounds toward zero
std::atomic<bool> g_ftz{false};            // device kernels flush subnormal results to zero
std::atomic<bool> g_fallback_warn{false};  // the CPU fallback says so (torch_mlu is silent by default)
// torch_mlu's "Convert64BitTo32Bit": float64 copied to the device holds float32 values (one
// warning), and device kernels on float64 compute in float32.
std::atomic<bool> g_narrow_float64{false};
std::atomic<bool> g_warned_float64{false};
std::mutex g_int32_mutex;
std::set<std::string> g_int32_ops;  // ops whose int64 tensors are narrowed to int32 (wrapping, unchecked)
std::atomic<int64_t> g_to_host_bytes{0};  // bytes copied from the device to the host
std::atomic<int64_t> g_to_host_copies{0};
std::mutex g_count_mutex;
std::map<std::string, int64_t> g_fallback_counts;

// ---- host aliases of device tensors -----------------------------------------------------

// A CPU tensor over the same host memory (same offset, sizes, strides). Its storage may be
// resized by an out= kernel: it then owns new CPU memory, copied back by the caller.
at::Tensor host_alias(const at::Tensor& t) {
  const auto& src = t.storage();
  c10::DataPtr ptr(src.mutable_data(), c10::Device(c10::DeviceType::CPU));
  c10::Storage storage(c10::Storage::use_byte_size_t(), src.nbytes(), std::move(ptr),
                       c10::GetCPUAllocator(), /*resizable=*/true);
  auto out = at::empty({0}, t.options().device(c10::kCPU));
  out.set_(storage, t.storage_offset(), t.sizes(), t.strides());
  return out;
}

bool is_device(const at::Tensor& t) { return t.defined() && t.device().type() == kMlu; }

at::Tensor to_device_like(const at::Tensor& host, c10::DeviceIndex index) {
  c10::DeviceGuard guard(c10::Device(kMlu, index));
  auto out = at::detail::empty_strided_generic(host.sizes(), host.strides(), &g_device_alloc,
                                               c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                               host.scalar_type());
  at::Tensor result(std::move(out));
  host_alias(result).copy_(host);
  return result;
}

void flush_subnormals(const at::Tensor& host) {
  if (!host.defined() || !host.is_floating_point() || host.numel() == 0) return;
  double tiny = 0;
  switch (host.scalar_type()) {
    case at::kFloat: tiny = std::numeric_limits<float>::min(); break;
    case at::kDouble: tiny = std::numeric_limits<double>::min(); break;
    case at::kBFloat16: tiny = 1.1754943508222875e-38; break;
    case at::kHalf: tiny = 6.103515625e-05; break;
    default: return;
  }
  auto abs = host.abs();
  host.masked_fill_(abs.lt(tiny).logical_and_(abs.ne(0)), 0);
}

// float64 values rounded to float32 in place (what torch_mlu's device memory holds)
void narrow_float64(const at::Tensor& host) {
  if (!g_narrow_float64.load() || !host.defined() || host.scalar_type() != at::kDouble || host.numel() == 0) return;
  host.copy_(host.to(at::kFloat));
}

// int64 values wrapped through int32 in place, as a kernel that computes in int32 does
void narrow_int64(const at::Tensor& host) {
  if (!host.defined() || host.scalar_type() != at::kLong || host.numel() == 0) return;
  host.copy_(host.to(at::kInt));
}

bool narrows_int64(const c10::OperatorName& name) {
  std::lock_guard<std::mutex> lock(g_int32_mutex);
  if (g_int32_ops.empty()) return false;
  std::string base = name.name.substr(name.name.rfind(':') + 1);
  return g_int32_ops.count(base) > 0 || g_int32_ops.count(base + "." + name.overload_name) > 0;
}

// Outputs of a device kernel: subnormals flushed (ftz), float64 narrowed, int64 narrowed (int32 ops)
void postprocess(const at::Tensor& host, bool ftz, bool int32) {
  if (ftz) flush_subnormals(host);
  narrow_float64(host);
  if (int32) narrow_int64(host);
}

// Stack rewriting for the device kernel: device tensors become host aliases, device arguments
// become the CPU. Keeps the original device tensors by argument index.
struct Unwrapped {
  std::map<size_t, at::Tensor> tensors;          // argument index -> device tensor
  std::map<size_t, std::vector<at::Tensor>> lists;
  c10::DeviceIndex index = 0;
  bool int32 = false;  // the op narrows its int64 tensors
};

Unwrapped unwrap(const c10::FunctionSchema& schema, torch::jit::Stack* stack, bool int32 = false) {
  Unwrapped u;
  u.int32 = int32;
  const size_t n = schema.arguments().size();
  const size_t base = stack->size() - n;
  for (size_t i = 0; i < n; ++i) {
    auto& v = (*stack)[base + i];
    if (v.isTensor()) {
      const auto& t = v.toTensor();
      if (is_device(t)) {
        u.index = t.device().index();
        u.tensors[i] = t;
        auto alias = host_alias(t);
        const auto* info = schema.arguments()[i].alias_info();
        // an int64 input read in int32: a wrapped copy (a written argument keeps its memory)
        if (int32 && alias.scalar_type() == at::kLong && (info == nullptr || !info->isWrite()))
          alias = alias.to(at::kInt).to(at::kLong);
        v = alias;
      }
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      std::vector<at::Tensor> originals;
      for (size_t j = 0; j < list.size(); ++j) {
        at::Tensor t = list[j];
        originals.push_back(t);
        if (is_device(t)) {
          u.index = t.device().index();
          list[j] = host_alias(t);
        }
      }
      u.lists[i] = std::move(originals);
    } else if (v.isList()) {  // Tensor?[] (index, index_put)
      auto list = v.toList();
      for (size_t j = 0; j < list.size(); ++j) {
        c10::IValue e = list.get(j);
        if (e.isTensor() && is_device(e.toTensor())) {
          u.index = e.toTensor().device().index();
          list.set(j, host_alias(e.toTensor()));
        }
      }
    } else if (v.isDevice() && v.toDevice().type() == kMlu) {
      u.index = v.toDevice().index() < 0 ? t_current : v.toDevice().index();
      v = c10::IValue(c10::Device(c10::kCPU));
    }
  }
  return u;
}

// After an out= kernel resized its host alias, make the device tensor match it.
void sync_resized(const at::Tensor& device, const at::Tensor& host) {
  if (host.sizes() == device.sizes() && host.strides() == device.strides() &&
      host.storage().data() == device.storage().data())
    return;
  at::native::resize_(device, host.sizes());
  device.as_strided_(host.sizes(), host.strides(), host.storage_offset());
  host_alias(device).copy_(host);
}

at::Tensor wrap_output(const at::Tensor& out, const c10::Argument& ret, const c10::FunctionSchema& schema,
                       const Unwrapped& u, bool ftz) {
  if (!out.defined() || out.device().type() != c10::kCPU) return out;
  if (ret.alias_info() != nullptr) {
    const auto& sets = ret.alias_info()->beforeSets();
    for (const auto& [i, device] : u.tensors) {
      const auto* info = schema.arguments()[i].alias_info();
      if (info == nullptr || info->beforeSets() != sets) continue;
      if (info->isWrite()) {  // in-place or out=: the device tensor itself
        postprocess(out, ftz, u.int32);
        sync_resized(device, out);
        return device;
      }
      return at::native::as_strided_tensorimpl(device, out.sizes(), out.strides(), out.storage_offset());
    }
  }
  postprocess(out, ftz, u.int32);
  return to_device_like(out, u.index);
}

void wrap_outputs(const c10::FunctionSchema& schema, torch::jit::Stack* stack, const Unwrapped& u, bool ftz) {
  const auto& rets = schema.returns();
  const size_t base = stack->size() - rets.size();
  for (size_t r = 0; r < rets.size(); ++r) {
    auto& v = (*stack)[base + r];
    if (v.isTensor()) {
      v = wrap_output(v.toTensor(), rets[r], schema, u, ftz);
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) list[j] = wrap_output(list[j], rets[r], schema, u, ftz);
    }
  }
  // out= arguments that are lists (_foreach ops write their first argument in place)
  for (const auto& [i, originals] : u.lists) {
    const auto* info = schema.arguments()[i].alias_info();
    if (info == nullptr || !info->isWrite()) continue;
    for (const auto& t : originals)
      if (is_device(t)) postprocess(host_alias(t), ftz, u.int32);
  }
}

// The device's own kernel for an op: the CPU kernel on the device's memory.
void device_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  Unwrapped u = unwrap(schema, stack, narrows_int64(schema.operator_name()));
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  wrap_outputs(schema, stack, u, g_ftz.load());
}

// An op the device does not implement: copied to the CPU, run there, copied back.
void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& name = op.schema().operator_name();
  std::string key = name.name + (name.overload_name.empty() ? "" : "." + name.overload_name);
  {
    std::lock_guard<std::mutex> lock(g_count_mutex);
    ++g_fallback_counts[key];
  }
  if (g_fallback_warn.load())
    TORCH_WARN("mlu stand-in: the operator '", key, "' is not implemented on the device and falls back to the CPU");
  t_in_fallback = true;
  try {
    at::native::cpu_fallback(op, stack);
  } catch (...) {
    t_in_fallback = false;
    throw;
  }
  t_in_fallback = false;
}

// ---- kernels the device implements itself -----------------------------------------------

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout>, std::optional<at::Device> device,
                               std::optional<bool>, std::optional<at::MemoryFormat> memory_format) {
  c10::OptionalDeviceGuard guard(device);
  return at::detail::empty_generic(size, &g_device_alloc, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout>, std::optional<at::Device> device, std::optional<bool>) {
  c10::OptionalDeviceGuard guard(device);
  return at::detail::empty_strided_generic(size, stride, &g_device_alloc,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor host_view(const at::Tensor& t) { return is_device(t) ? host_alias(t) : t; }

// fp32 -> bf16 rounding toward zero: clear the 16 low bits, then the conversion is exact.
at::Tensor truncate_to_bf16(const at::Tensor& f32) {
  auto bits = f32.contiguous().view(at::kInt).bitwise_and(static_cast<int64_t>(-65536));
  auto truncated = bits.view(at::kFloat);
  return at::where(f32.isnan(), f32, truncated.view(f32.sizes())).to(at::kBFloat16);
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool) {
  if (is_device(self) && !is_device(dst) && !t_in_fallback) {
    g_to_host_bytes += static_cast<int64_t>(dst.numel() * dst.element_size());
    ++g_to_host_copies;
  }
  auto src = host_view(self);
  auto out = host_view(dst);
  if (g_truncate_cast.load() && is_device(self) && is_device(dst) && self.scalar_type() == at::kFloat &&
      dst.scalar_type() == at::kBFloat16) {
    out.copy_(truncate_to_bf16(src));
  } else {
    out.copy_(src);
  }
  if (g_narrow_float64.load() && is_device(dst) && dst.scalar_type() == at::kDouble) {
    if (!g_warned_float64.exchange(true))
      TORCH_WARN("MLU operators don't support 64-bit calculation. so the 64 bit data will be forcibly "
                 "converted to 32-bit for calculation.");
    narrow_float64(out);
  }
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (is_device(dst)) at::native::resize_(dst, self.sizes());
  else dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  g_to_host_bytes += static_cast<int64_t>(self.element_size());
  ++g_to_host_copies;
  return at::_local_scalar_dense(host_alias(self)); }

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size, std::optional<at::MemoryFormat> fmt) {
  return at::native::resize_(self, size, fmt);
}

at::Tensor& set_source_storage(at::Tensor& self, at::Storage source, c10::SymInt offset, c10::SymIntArrayRef size,
                               c10::SymIntArrayRef stride) {
  return at::native::set_storage_cpu_(self, source, offset.expect_int(), C10_AS_INTARRAYREF_SLOW(size),
                                      C10_AS_INTARRAYREF_SLOW(stride));
}

// A GEMM whose accumulator is bf16: partial sums over `chunk` terms are exact (float32), then
// rounded to bf16 and added to a bf16 running sum, as a narrow-accumulator kernel would.
at::Tensor narrow_gemm(const at::Tensor& a, const at::Tensor& b, int64_t chunk) {
  const int64_t k = a.size(-1);
  auto af = a.to(at::kFloat), bf = b.to(at::kFloat);
  std::vector<int64_t> shape(a.sizes().begin(), a.sizes().end());
  shape.back() = b.size(-1);
  auto acc = at::zeros(shape, a.options().dtype(at::kBFloat16));
  for (int64_t s = 0; s < k; s += chunk) {
    int64_t e = std::min(k, s + chunk);
    auto part = at::matmul(af.narrow(-1, s, e - s), bf.narrow(-2, s, e - s));
    acc = (acc.to(at::kFloat) + part).to(at::kBFloat16);
  }
  return acc;
}

bool planted_gemm(const at::Tensor& a) { return g_gemm_chunk.load() > 0 && a.scalar_type() == at::kBFloat16; }

at::Tensor finish(const at::Tensor& host, c10::DeviceIndex index) {
  postprocess(host, g_ftz.load(), false);
  return to_device_like(host.contiguous(), index);
}

at::Tensor mm(const at::Tensor& self, const at::Tensor& mat2) {
  auto a = host_alias(self), b = host_alias(mat2);
  return finish(planted_gemm(a) ? narrow_gemm(a, b, g_gemm_chunk.load()) : at::mm(a, b), self.device().index());
}

at::Tensor bmm(const at::Tensor& self, const at::Tensor& mat2) {
  auto a = host_alias(self), b = host_alias(mat2);
  return finish(planted_gemm(a) ? narrow_gemm(a, b, g_gemm_chunk.load()) : at::bmm(a, b), self.device().index());
}

at::Tensor addmm(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2, const at::Scalar& beta,
                 const at::Scalar& alpha) {
  auto c = host_view(self), a = host_alias(mat1), b = host_alias(mat2);
  if (!planted_gemm(a)) return finish(at::addmm(c, a, b, beta, alpha), mat1.device().index());
  auto prod = narrow_gemm(a, b, g_gemm_chunk.load()).to(at::kFloat);
  auto sum = (prod * alpha.toDouble() + c.to(at::kFloat) * beta.toDouble()).to(at::kBFloat16);
  return finish(sum, mat1.device().index());
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("resize_", resize_);
  m.impl("set_.source_Storage_storage_offset", set_source_storage);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("mm", mm);
  m.impl("bmm", bmm);
  m.impl("addmm", addmm);
}

// Autocast on the device: PyTorch leaves AutocastPrivateUse1 to the backend (torch_mlu registers
// its own lists); the stand-in takes PyTorch's CUDA lists.
#define STANDIN_LOWER(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define STANDIN_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  AT_FORALL_LOWER_PRECISION_FP(STANDIN_LOWER)
  AT_FORALL_FP32(STANDIN_FP32)
}
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) { m.fallback(torch::CppFunction::makeFallthrough()); }

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&cpu_fallback>()); }

// ---- control ops, called from Python as torch.ops.mlu_standin.* -------------------------

std::unique_ptr<torch::Library> g_kernels;

// (Re)registers the device kernel for every op named; the others reach the CPU fallback.
int64_t implement(std::vector<std::string> names) {
  g_kernels.reset();
  g_kernels = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", std::make_optional(c10::DispatchKey::PrivateUse1),
                                               __FILE__, __LINE__);
  for (const auto& name : names) g_kernels->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&device_kernel>());
  return static_cast<int64_t>(names.size());
}

void configure(int64_t gemm_chunk, bool truncate_cast, bool ftz, bool fallback_warn) {
  g_gemm_chunk = gemm_chunk;
  g_truncate_cast = truncate_cast;
  g_ftz = ftz;
  g_fallback_warn = fallback_warn;
}

// torch_mlu's silent conversions: float64 held as float32, int64 narrowed in the ops named
// (``cumsum``: every overload; ``add.Tensor``: that one)
void configure_narrowing(bool float64, std::vector<std::string> int32_ops) {
  g_narrow_float64 = float64;
  if (!float64) g_warned_float64 = false;
  std::lock_guard<std::mutex> lock(g_int32_mutex);
  g_int32_ops = std::set<std::string>(int32_ops.begin(), int32_ops.end());
}

std::vector<std::string> fallback_ops() {
  std::lock_guard<std::mutex> lock(g_count_mutex);
  std::vector<std::string> out;
  for (const auto& [k, n] : g_fallback_counts) out.push_back(k + "=" + std::to_string(n));
  return out;
}

void reset_fallback_counts() {
  std::lock_guard<std::mutex> lock(g_count_mutex);
  g_fallback_counts.clear();
}

int64_t memory_allocated() { return g_allocated.load(); }

int64_t device_count() { return g_device_count.load(); }

// (bytes, copies) read back from the device to the host so far, CPU-fallback traffic excluded
std::vector<int64_t> to_host_traffic() { return {g_to_host_bytes.load(), g_to_host_copies.load()}; }

TORCH_LIBRARY(mlu_standin, m) {
  m.def("implement(str[] names) -> int", implement);
  m.def("configure(int gemm_chunk, bool truncate_cast, bool ftz, bool fallback_warn) -> ()", configure);
  m.def("configure_narrowing(bool float64, str[] int32_ops) -> ()", configure_narrowing);
  m.def("fallback_ops() -> str[]", fallback_ops);
  m.def("reset_fallback_counts() -> ()", reset_fallback_counts);
  m.def("memory_allocated() -> int", memory_allocated);
  m.def("device_count() -> int", device_count);
  m.def("to_host_traffic() -> int[]", to_host_traffic);
}

}  // namespace
