// flopwise's dry run (flopwise/tune/): the CUDA pieces a CPU-only build of torch lacks, as no-ops,
// so that tensors on device "cuda" under FakeTensorMode can go through the code paths that take a
// device guard (indexing and slicing, autograd's engine, DDP's and FSDP2's stream bookkeeping).
// Nothing here links CUDA, allocates device memory or launches a kernel. Built by shim.py against
// the torch it is loaded into, and preloaded (LD_PRELOAD) so that it registers before torch asks
// for its CUDA hooks.
#include <array>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/reducer_timer.hpp>

namespace {
using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;
using c10::Stream;
using c10::StreamId;

constexpr DeviceIndex kDevices = 8;  // what a fake device count may claim; streams are per device
thread_local DeviceIndex current = 0;
thread_local std::array<StreamId, kDevices> current_stream{};

DeviceIndex index_of(Device d) { return d.index() < 0 ? current : d.index(); }

// The device guard: the device is a thread-local number, every stream is the default one, events
// are always complete and synchronisation returns at once.
struct NoOpCudaGuard final : public c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device d) const override {
    Device old(DeviceType::CUDA, current);
    current = index_of(d);
    return old;
  }
  Device getDevice() const override { return Device(DeviceType::CUDA, current); }
  void setDevice(Device d) const override { current = index_of(d); }
  void uncheckedSetDevice(Device d) const noexcept override { current = index_of(d); }
  Stream getStream(Device d) const override {
    auto i = index_of(d);
    return Stream(Stream::UNSAFE, Device(DeviceType::CUDA, i), current_stream[i]);
  }
  Stream getDefaultStream(Device d) const override {
    return Stream(Stream::UNSAFE, Device(DeviceType::CUDA, index_of(d)), 0);
  }
  Stream getStreamFromGlobalPool(Device d, bool) const override { return getDefaultStream(d); }
  Stream getNewStream(Device d, int) const override { return getDefaultStream(d); }
  Stream exchangeStream(Stream s) const override {
    auto old = current_stream[s.device_index()];
    current_stream[s.device_index()] = s.id();
    return Stream(Stream::UNSAFE, s.device(), old);
  }
  DeviceIndex deviceCount() const noexcept override { return kDevices; }
  void record(void**, const Stream&, const DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
  bool queryStream(const Stream&) const override { return true; }
  void synchronizeStream(const Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const Stream&) const override {}
};

// CUDA hooks that say "built and available": the autograd engine and torch.accelerator accept
// cuda tensors only when the hooks do.
struct NoOpCudaHooks : public at::CUDAHooksInterface {
  explicit NoOpCudaHooks(at::CUDAHooksArgs) {}
  void init() const override {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasCUDART() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  DeviceIndex deviceCount() const override { return kDevices; }
  int getNumGPUs() const override { return kDevices; }
  DeviceIndex current_device() const override { return current; }
  DeviceIndex getCurrentDevice() const override { return current; }
  void setCurrentDevice(DeviceIndex d) const override { current = d; }
  DeviceIndex exchangeDevice(DeviceIndex d) const override { auto old = current; current = d; return old; }
  DeviceIndex maybeExchangeDevice(DeviceIndex d) const override { return exchangeDevice(d); }
  void deviceSynchronize(DeviceIndex) const override {}
};

// DDP's reducer asks for a timer of its parameters' device type; the CUDA one lives in
// libtorch_cuda. A host-clock timer, like the CPU one.
struct HostClockTimer : public c10d::Timer {
  explicit HostClockTimer(Device) {}
  std::optional<int64_t> measureDifference(Event start, Event end) override {
    auto s = getTimestamp(start), e = getTimestamp(end);
    if (!s || !e) return std::nullopt;
    return *e - *s;
  }
};
}  // namespace

C10_REGISTER_GUARD_IMPL(CUDA, NoOpCudaGuard);
namespace at { C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", NoOpCudaHooks); }
namespace c10d { C10_REGISTER_TYPED_CLASS(TimerRegistry, c10::kCUDA, HostClockTimer); }

// A symbol the loader can check for: the dry run's worker refuses to start without it.
extern "C" int flopwise_fake_cuda_shim() { return 1; }
