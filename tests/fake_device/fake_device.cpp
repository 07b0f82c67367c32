// A fake accelerator for ckptfx's tests, registered as torch's PrivateUse1 backend.
//
// Why it exists: on CUDA and NPU the autograd engine runs each device's backward on a worker
// thread of its own, which sees none of the caller's thread-local state. A backend registered
// here makes the engine start those threads on a CPU-only machine, so the suite can test what
// users on accelerators get: device threads, a device generator, device autocast, streams and
// events, pinned host memory, and device-mismatch errors.
//
// What it is: two devices whose memory is host memory. Most ops run through one boxed fallback
// that hands the CPU kernel *aliases* of the device tensors (same memory, CPU device), so
// in-place ops and views write and read the device tensors directly, and copies only the fresh
// outputs into device memory. Random ops draw from the device's own generator (one per
// device, seedable, with get/set state), not from the CPU one. Streams and events are ids:
// the device is synchronous, so every event has completed when it is recorded. What would be
// asynchronous on a real device is logged instead (Rule 4), so a test can check the order.
//
// Rules
// 1. Nothing here calls Python; the Python half (__init__.py) names the backend and
//    registers the device module torch looks up (torch.<name>.get_rng_state, ...).
// 2. A device tensor's memory is owned by FakeAllocator, which counts bytes per device
//    (memory_allocated / max_memory_allocated read those counts).
// 3. An op whose tensors sit on two devices (a device and another device index, or a
//    device and a CPU tensor that is not a 0-dim scalar) fails as CUDA fails: before any
//    kernel runs.
// 4. While the stream log is on (stream_log_start), every copy between a device and host
//    memory, every event recorded and every wait on an event is logged with the stream it was
//    issued on, in issue order: ("d2h" | "h2d", device, stream id, bytes), ("record", device,
//    stream id, event id), ("wait", device, stream id, event id), every record_stream
//    ("record_stream", device, stream id, storage bytes) and every host wait ("sync",
//    device, stream id or -1, event id or 0). Stream 0 is the default.

#include <torch/extension.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/Resize.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/csrc/Generator.h>

#include <array>
#include <atomic>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

namespace fake_device {

constexpr c10::DeviceIndex kDeviceCount = 2;
constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;

thread_local c10::DeviceIndex current_device = 0;

c10::DeviceIndex checked_index(c10::DeviceIndex index) {
  if (index < 0) {
    return current_device;
  }
  TORCH_CHECK(index < kDeviceCount, "fake device: invalid device index ", int(index),
              " (there are ", int(kDeviceCount), " devices)");
  return index;
}

// ---- memory (Rule 2) ------------------------------------------------------------------------

std::array<std::atomic<int64_t>, kDeviceCount> allocated_bytes{};
std::array<std::atomic<int64_t>, kDeviceCount> peak_bytes{};

struct Block {
  void* ptr;
  size_t size;
  c10::DeviceIndex device;
};

void delete_block(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  allocated_bytes[block->device] -= static_cast<int64_t>(block->size);
  c10::free_cpu(block->ptr);
  delete block;
}

// A DeviceAllocator, as CUDA's and NPU's are, so that torch.accelerator's memory API
// (empty_cache, memory_allocated, max_memory_allocated, reset_peak_memory_stats) works on
// it as libraries call it (accelerate empties the cache between steps). There is no cache:
// emptyCache has nothing to release, and reserved bytes are the allocated ones.
struct FakeAllocator final : c10::DeviceAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    c10::DeviceIndex device = current_device;
    void* ptr = nbytes ? c10::alloc_cpu(nbytes) : nullptr;
    auto* block = new Block{ptr, nbytes, device};
    int64_t now = allocated_bytes[device] += static_cast<int64_t>(nbytes);
    int64_t peak = peak_bytes[device].load();
    while (now > peak && !peak_bytes[device].compare_exchange_weak(peak, now)) {
    }
    return {ptr, block, &delete_block, c10::Device(kType, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, size_t count) const override {
    default_copy_data(dest, src, count);
  }
  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t /*mempool_id*/) override {}
  void recordStream(const c10::DataPtr& /*ptr*/, c10::Stream /*stream*/) override {}
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    c10::CachingDeviceAllocator::DeviceStats stats;
    auto& all = stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
    all.current = allocated_bytes[device].load();
    all.peak = peak_bytes[device].load();
    stats.reserved_bytes[0] = stats.active_bytes[0] = stats.requested_bytes[0] = all;
    return stats;
  }
  void resetAccumulatedStats(c10::DeviceIndex /*device*/) override {}
  void resetPeakStats(c10::DeviceIndex device) override {
    peak_bytes[device] = allocated_bytes[device].load();
  }
};

FakeAllocator device_allocator;
// The device type's allocator for torch (c10::GetAllocator, which torch.accelerator reads).
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &device_allocator);

// Pinned host memory: ordinary host memory whose blocks are listed, so is_pinned() can answer.
std::mutex pinned_mutex;
std::map<const char*, size_t> pinned_blocks;  // start -> size

void delete_pinned(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    pinned_blocks.erase(static_cast<const char*>(ptr));
  }
  c10::free_cpu(ptr);
}

bool is_pinned_ptr(const void* data) {
  auto* p = static_cast<const char*>(data);
  std::lock_guard<std::mutex> lock(pinned_mutex);
  auto it = pinned_blocks.upper_bound(p);
  if (it == pinned_blocks.begin()) {
    return false;
  }
  --it;
  return p < it->first + std::max<size_t>(it->second, 1);
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = c10::alloc_cpu(std::max<size_t>(nbytes, 1));
    {
      std::lock_guard<std::mutex> lock(pinned_mutex);
      pinned_blocks[static_cast<const char*>(ptr)] = nbytes;
    }
    return {ptr, ptr, &delete_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &delete_pinned; }
  void copy_data(void* dest, const void* src, size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

PinnedAllocator pinned_allocator;

// ---- generators -----------------------------------------------------------------------------

// A device generator: reports the device, draws through a CPU generator it owns (the fallback
// hands that one to the CPU kernels).
struct FakeGenerator final : c10::GeneratorImpl {
  explicit FakeGenerator(c10::DeviceIndex device, uint64_t seed = c10::default_rng_seed_val)
      : c10::GeneratorImpl(c10::Device(kType, device), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        cpu(at::make_generator<at::CPUGeneratorImpl>(seed)) {}

  void set_current_seed(uint64_t seed) override { cpu.set_current_seed(seed); }
  void set_offset(uint64_t offset) override { cpu.set_offset(offset); }
  uint64_t get_offset() const override { return cpu.get_offset(); }
  uint64_t current_seed() const override { return cpu.current_seed(); }
  uint64_t seed() override { return cpu.seed(); }
  void set_state(const c10::TensorImpl& state) override {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    cpu.unsafeGetGeneratorImpl()->set_state(state);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    return cpu.unsafeGetGeneratorImpl()->get_state();
  }
  FakeGenerator* clone_impl() const override {
    auto* copy = new FakeGenerator(device_.index());
    copy->cpu = cpu.clone();
    return copy;
  }

  mutable at::Generator cpu;  // mutable: get_state locks its mutex
};

std::once_flag default_generators_once;
std::array<at::Generator, kDeviceCount> default_generators;

const at::Generator& default_generator(c10::DeviceIndex index) {
  std::call_once(default_generators_once, [] {
    for (c10::DeviceIndex i = 0; i < kDeviceCount; ++i) {
      default_generators[i] = at::make_generator<FakeGenerator>(i);
    }
  });
  return default_generators[checked_index(index)];
}

// ---- device guard, streams and events --------------------------------------------------------

thread_local std::array<c10::StreamId, kDeviceCount> current_stream{};
std::atomic<c10::StreamId> next_stream_id{1};
std::atomic<intptr_t> next_event_id{1};

// The stream log (Rule 4).
struct LogEntry {
  std::string kind;
  int device;
  int64_t stream;
  int64_t value;  // bytes copied, or the event id
};
std::mutex log_mutex;
std::atomic<bool> log_on{false};
std::vector<LogEntry> stream_log;

void log_entry(const char* kind, c10::DeviceIndex device, int64_t stream, int64_t value) {
  if (!log_on.load()) {
    return;
  }
  std::lock_guard<std::mutex> lock(log_mutex);
  stream_log.push_back({kind, int(device), stream, value});
}

struct FakeGuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    if (d.index() != old.index()) {
      setDevice(d);
    }
    return old;
  }
  c10::Device getDevice() const override { return {kType, current_device}; }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kType, "fake device: expected a ", kType, " device, got ", d);
    current_device = checked_index(d.index());
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < kDeviceCount) {
      current_device = d.index();
    }
  }
  c10::Stream getStream(c10::Device d) const override {
    c10::DeviceIndex i = checked_index(d.index());
    return c10::Stream(c10::Stream::UNSAFE, {kType, i}, current_stream[i]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, {kType, checked_index(d.index())});
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    return getNewStream(d, 0);
  }
  c10::Stream getNewStream(c10::Device d, int) const override {
    return c10::Stream(c10::Stream::UNSAFE, {kType, checked_index(d.index())}, next_stream_id++);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    c10::DeviceIndex i = checked_index(s.device_index());
    c10::Stream old(c10::Stream::UNSAFE, {kType, i}, current_stream[i]);
    current_stream[i] = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return kDeviceCount; }
  // Events are ids; the device runs every op when it is called, so they complete at once.
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex, const c10::EventFlag) const override {
    if (*event == nullptr) {
      *event = reinterpret_cast<void*>(next_event_id++);
    }
    log_entry("record", stream.device_index(), stream.id(), reinterpret_cast<intptr_t>(*event));
  }
  void block(void* event, const c10::Stream& stream) const override {
    log_entry("wait", stream.device_index(), stream.id(), reinterpret_cast<intptr_t>(event));
  }
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream& stream) const override {
    log_entry("sync", stream.device_index(), stream.id(), 0);
  }
  void synchronizeEvent(void* event) const override {
    log_entry("sync", current_device, -1, reinterpret_cast<intptr_t>(event));
  }
  void synchronizeDevice(const c10::DeviceIndex device) const override {
    log_entry("sync", device, -1, 0);
  }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void*, void*, const c10::DeviceIndex) const override { return 0.0; }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, FakeGuardImpl);

// ---- hooks: what torch asks a PrivateUse1 backend ------------------------------------------

struct FakeHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override {
    return default_generator(index);
  }
  at::Generator getNewGenerator(c10::DeviceIndex index) const override {
    return at::make_generator<FakeGenerator>(checked_index(index));
  }
  at::Device getDeviceFromPtr(void*) const override { return {kType, current_device}; }
  bool isPinnedPtr(const void* data) const override { return is_pinned_ptr(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &pinned_allocator; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return kDeviceCount; }
  void setCurrentDevice(c10::DeviceIndex d) const override { current_device = checked_index(d); }
  c10::DeviceIndex getCurrentDevice() const override { return current_device; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    c10::DeviceIndex old = current_device;
    current_device = checked_index(d);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return exchangeDevice(d); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t nbytes) const override {
    c10::DeviceGuard guard(storage.device());
    c10::DataPtr fresh = device_allocator.allocate(nbytes);
    size_t keep = std::min(nbytes, storage.nbytes());
    if (keep) {
      std::memcpy(fresh.get(), storage.data(), keep);
    }
    storage.unsafeGetStorageImpl()->set_data_ptr_noswap(std::move(fresh));
    storage.unsafeGetStorageImpl()->set_nbytes(nbytes);
  }
};

// ---- kernels the fallback cannot be: factories, views, copies, resize ----------------------

// A CPU tensor over the same memory as a device tensor (the device's memory is host memory).
at::Tensor host_alias(const at::Tensor& t) {
  if (!t.defined() || t.device().type() != kType) {
    return t;
  }
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), [](void*) {},
                       t.options().device(c10::kCPU));
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout>, std::optional<c10::Device> device,
                               std::optional<bool>, std::optional<c10::MemoryFormat> memory_format) {
  c10::OptionalDeviceGuard guard(device);
  return at::detail::empty_generic(size, &device_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype, std::optional<c10::Layout>,
                         std::optional<c10::Device> device, std::optional<bool>) {
  c10::OptionalDeviceGuard guard(device);
  return at::detail::empty_strided_generic(size, stride, &device_allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool) {
  bool from_device = self.device().type() == kType;
  bool to_device = dst.device().type() == kType;
  if (from_device != to_device) {  // Rule 4: a copy a real device would make on a stream
    c10::DeviceIndex d = from_device ? self.device().index() : dst.device().index();
    d = checked_index(d);
    log_entry(from_device ? "d2h" : "h2d", d, current_stream[d], int64_t(self.nbytes()));
  }
  host_alias(dst).copy_(host_alias(self));
  return dst;
}

void grow_storage(const at::Tensor& self, size_t nbytes) {
  const c10::Storage& storage = self.storage();
  if (nbytes > storage.nbytes()) {
    at::detail::getPrivateUse1Hooks().resizePrivateUse1Bytes(storage, nbytes);
  }
}

const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format) {
  auto shape = C10_AS_INTARRAYREF_SLOW(size);
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(shape);
  if (memory_format.has_value() && *memory_format != c10::MemoryFormat::Preserve) {
    impl->empty_tensor_restride(*memory_format);
  }
  if (self.numel() > 0) {
    grow_storage(self, at::detail::computeStorageNbytes(self.sizes(), self.strides(),
                                                        self.dtype().itemsize(),
                                                        self.storage_offset()));
  }
  return self;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  resize_(dst, self.sym_sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source, c10::SymInt offset,
                        c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  auto shape = C10_AS_INTARRAYREF_SLOW(size);
  auto strides = C10_AS_INTARRAYREF_SLOW(stride);
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  impl->set_storage_offset(offset.expect_int());
  impl->set_sizes_and_strides(shape, strides);
  if (self.numel() > 0) {
    grow_storage(self, at::detail::computeStorageNbytes(shape, strides, self.dtype().itemsize(),
                                                        self.storage_offset()));
  }
  return self;
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage empty(c10::Storage::use_byte_size_t(), 0, &device_allocator, true);
  return set_storage(self, empty, 0, c10::SymIntArrayRef({0}), c10::SymIntArrayRef({1}));
}

at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  int64_t numel = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  c10::SymInt n(numel);
  c10::SymInt one(1);
  return set_storage(self, std::move(source), 0, c10::SymIntArrayRef(&n, 1), c10::SymIntArrayRef(&one, 1));
}

// Inverted dropout with the device generator (torch's dropout takes no generator, so the
// fallback could not route it to the device's own).
std::tuple<at::Tensor, at::Tensor> native_dropout(const at::Tensor& input, double p,
                                                  std::optional<bool> train) {
  if (train.has_value() && !*train) {
    return {input.clone(), at::ones_like(input, input.options().dtype(at::kBool))};
  }
  c10::DeviceGuard guard(input.device());
  auto* gen = static_cast<FakeGenerator*>(default_generator(input.device().index()).unsafeGetGeneratorImpl());
  at::Tensor cpu_input = host_alias(input);
  at::Tensor keep = at::empty_like(cpu_input).bernoulli_(1 - p, gen->cpu).to(at::kBool);
  double scale = p < 1 ? 1.0 / (1.0 - p) : 0.0;
  at::Tensor out = cpu_input * keep * scale;
  return {out.to(input.device()), keep.to(input.device())};
}

int64_t fused_sdp_choice(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const std::optional<at::Tensor>&, double, bool, std::optional<double>,
                         bool) {
  return 0;  // the math backend: composite ops, with dropout through native_dropout above
}

// ---- the boxed fallback --------------------------------------------------------------------

struct Args {
  std::vector<at::Tensor> originals;  // device tensors met in the arguments, in order
  std::vector<at::Tensor> aliases;    // their host aliases
};

[[noreturn]] void device_mismatch(const c10::FunctionSchema& schema, const std::string& arg,
                                  const c10::Device& got, const c10::Device& first) {
  std::ostringstream msg;
  msg << "Expected all tensors to be on the same device, but got " << arg << " is on " << got
      << ", different from other tensors on " << first << " (when checking argument in method "
      << schema.operator_name() << ")";
  TORCH_CHECK(false, msg.str());
}

// Rule 3: the device of the op, or an error naming the argument on another device.
std::optional<c10::Device> op_device(const c10::FunctionSchema& schema, const torch::jit::Stack& stack,
                                     size_t first) {
  std::optional<c10::Device> device;
  std::string device_arg;
  std::optional<std::pair<std::string, c10::Device>> host;
  auto see = [&](const at::Tensor& t, const std::string& name) {
    if (!t.defined()) {
      return;
    }
    if (t.device().type() == kType) {
      if (!device) {
        device = t.device();
        device_arg = name;
      } else if (*device != t.device()) {
        device_mismatch(schema, name, t.device(), *device);
      }
    } else if (t.dim() > 0 && !host) {
      host.emplace(name, t.device());
    }
  };
  const auto& arguments = schema.arguments();
  for (size_t i = 0; i < arguments.size(); ++i) {
    const c10::IValue& v = stack[first + i];
    const std::string& name = arguments[i].name();
    if (v.isTensor()) {
      see(v.toTensor(), name);
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorVector()) {
        see(t, name);
      }
    } else if (v.isList()) {
      for (const c10::IValue& e : v.toListRef()) {
        if (e.isTensor()) {
          see(e.toTensor(), name);
        }
      }
    }
  }
  if (device && host) {
    device_mismatch(schema, host->first, host->second, *device);
  }
  return device;
}

at::Tensor alias_arg(const at::Tensor& t, Args& args) {
  if (!t.defined() || t.device().type() != kType) {
    return t;
  }
  args.originals.push_back(t);
  args.aliases.push_back(host_alias(t));
  return args.aliases.back();
}

bool is_generator_arg(const c10::Argument& a) {
  auto opt = a.type()->cast<c10::OptionalType>();
  return opt && opt->getElementType()->kind() == c10::TypeKind::GeneratorType;
}

// A host result back on the device: a view of the device tensor it aliases, else a copy.
at::Tensor to_device(const at::Tensor& out, const Args& args, c10::Device device) {
  if (!out.defined() || out.device().type() != c10::kCPU) {
    return out;
  }
  for (size_t i = 0; i < args.aliases.size(); ++i) {
    if (out.is_alias_of(args.aliases[i])) {
      const at::Tensor& base = args.originals[i];
      return base.as_strided(out.sizes(), out.strides(), base.storage_offset() + out.storage_offset());
    }
  }
  c10::DeviceGuard guard(device);
  at::Tensor result = empty_strided(out.sizes(), out.strides(), out.scalar_type(), std::nullopt,
                                    device, std::nullopt);
  host_alias(result).copy_(out);
  return result;
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& arguments = schema.arguments();
  const size_t n_args = arguments.size();
  const size_t first = stack->size() - n_args;
  std::optional<c10::Device> maybe_device = op_device(schema, *stack, first);
  c10::Device device = maybe_device.value_or(c10::Device(kType, current_device));
  c10::DeviceGuard guard(device);

  Args args;
  std::vector<std::optional<at::Tensor>> written(n_args);  // in-place / out= arguments
  for (size_t i = 0; i < n_args; ++i) {
    c10::IValue& v = (*stack)[first + i];
    const c10::Argument& a = arguments[i];
    if (v.isTensor()) {
      const at::Tensor t = v.toTensor();
      if (a.alias_info() && a.alias_info()->isWrite()) {
        written[i] = t;
        if (a.is_out() && t.defined() && t.device().type() == kType) {
          // An out= argument may be resized by the kernel: it gets a host tensor of its own,
          // copied into the device tensor afterwards.
          v = at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kCPU));
          continue;
        }
      }
      v = alias_arg(t, args);
    } else if (v.isTensorList()) {
      auto tensors = v.toTensorVector();
      for (auto& t : tensors) {
        t = alias_arg(t, args);
      }
      v = c10::IValue(tensors);
    } else if (v.isList() && a.type()->kind() == c10::TypeKind::ListType) {
      c10::List<std::optional<at::Tensor>> items;
      bool tensors = false;
      for (const c10::IValue& e : v.toListRef()) {
        if (e.isTensor()) {
          tensors = true;
          items.push_back(alias_arg(e.toTensor(), args));
        } else if (e.isNone()) {
          items.push_back(std::nullopt);
        }
      }
      if (tensors) {
        v = c10::IValue(items);
      }
    } else if (is_generator_arg(a)) {
      // Rule: random ops draw from the device's generator (the given one, or the default).
      at::Generator gen = v.isNone() ? default_generator(device.index()) : v.toGenerator();
      if (gen.device().type() == kType) {
        v = c10::IValue(static_cast<FakeGenerator*>(gen.unsafeGetGeneratorImpl())->cpu);
      }
    } else if (v.isDevice() && v.toDevice().type() == kType) {
      v = c10::IValue(c10::Device(c10::kCPU));
    }
  }

  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);

  const auto& returns = schema.returns();
  const size_t first_ret = stack->size() - returns.size();
  for (size_t r = 0; r < returns.size(); ++r) {
    c10::IValue& v = (*stack)[first_ret + r];
    const auto* alias = returns[r].alias_info();
    if (alias && alias->isWrite()) {
      // An in-place or out= result is the argument itself (resized in place if it had to be).
      for (size_t i = 0; i < n_args; ++i) {
        const auto* arg_alias = arguments[i].alias_info();
        if (written[i] && arg_alias && arg_alias->beforeSets() == alias->beforeSets()) {
          const at::Tensor& original = *written[i];
          const at::Tensor host = v.toTensor();
          if (host.data_ptr() != original.data_ptr()) {  // an out= argument's own host tensor
            if (host.sizes() != original.sizes()) {
              resize_(original, host.sym_sizes(), std::nullopt);
            }
            host_alias(original).copy_(host);
          }
          v = c10::IValue(original);
          break;
        }
      }
    } else if (v.isTensor()) {
      v = c10::IValue(to_device(v.toTensor(), args, device));
    } else if (v.isTensorList()) {
      auto tensors = v.toTensorVector();
      for (auto& t : tensors) {
        t = to_device(t, args, device);
      }
      v = c10::IValue(tensors);
    }
  }
}

// Tensor.record_stream: the allocator would not reuse the memory before the work queued on
// the stream when it is freed has run; here every op has run when called (Rule 4 logs it).
void record_stream(at::Tensor& self, c10::Stream stream) {
  log_entry("record_stream", stream.device_index(), stream.id(), int64_t(self.storage().nbytes()));
}

}  // namespace fake_device

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fake_device::fallback>());
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", &fake_device::empty_memory_format);
  m.impl("empty_strided", &fake_device::empty_strided);
  m.impl("_copy_from", &fake_device::copy_from);
  m.impl("_copy_from_and_resize", &fake_device::copy_from_and_resize);
  m.impl("record_stream", &fake_device::record_stream);
  m.impl("resize_", &fake_device::resize_);
  m.impl("set_.source_Storage_storage_offset", &fake_device::set_storage);
  m.impl("set_.source_Storage", &fake_device::set_source_storage);
  m.impl("set_", &fake_device::set_empty);
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("unfold", TORCH_FN(at::native::unfold));
  m.impl("native_dropout", &fake_device::native_dropout);
  m.impl("_fused_sdp_choice", &fake_device::fused_sdp_choice);
}

// Device autocast: torch registers the op lists only for its own backends; a PrivateUse1
// backend registers them itself (with torch's public lists and wrappers).
#define FAKE_LOWER(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define FAKE_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define FAKE_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define FAKE_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)

// Every other op passes through autocast untouched, as on torch's own backends.
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

namespace at::autocast {  // the wrappers name ATen types unqualified
TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  AT_FORALL_LOWER_PRECISION_FP(FAKE_LOWER)
  AT_FORALL_FP32(FAKE_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(FAKE_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(FAKE_PROMOTE)
}
}  // namespace at::autocast

namespace {
struct RegisterHooks {
  RegisterHooks() { at::RegisterPrivateUse1HooksInterface(new fake_device::FakeHooks()); }
} register_hooks;
}  // namespace

// ---- what the Python half calls -------------------------------------------------------------

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("device_count", [] { return int(fake_device::kDeviceCount); });
  module.def("current_device", [] { return int(fake_device::current_device); });
  module.def("set_device", [](int index) {
    fake_device::current_device = fake_device::checked_index(static_cast<c10::DeviceIndex>(index));
  });
  module.def("default_generator", [](int index) {
    return py::reinterpret_steal<py::object>(THPGenerator_Wrap(
        fake_device::default_generator(static_cast<c10::DeviceIndex>(index))));
  });
  module.def("memory_allocated", [](int index) {
    return fake_device::allocated_bytes[fake_device::checked_index(static_cast<c10::DeviceIndex>(index))].load();
  });
  module.def("max_memory_allocated", [](int index) {
    return fake_device::peak_bytes[fake_device::checked_index(static_cast<c10::DeviceIndex>(index))].load();
  });
  module.def("stream_log_start", [] {
    std::lock_guard<std::mutex> lock(fake_device::log_mutex);
    fake_device::stream_log.clear();
    fake_device::log_on = true;
  });
  module.def("stream_log_stop", [] {
    fake_device::log_on = false;
    std::lock_guard<std::mutex> lock(fake_device::log_mutex);
    py::list out;
    for (const auto& e : fake_device::stream_log) {
      out.append(py::make_tuple(e.kind, e.device, e.stream, e.value));
    }
    fake_device::stream_log.clear();
    return out;
  });
  module.def("reset_peak_memory_stats", [](int index) {
    auto i = fake_device::checked_index(static_cast<c10::DeviceIndex>(index));
    fake_device::peak_bytes[i] = fake_device::allocated_bytes[i].load();
  });
}
