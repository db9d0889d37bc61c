// A CUDA device for FakeTensorMode on a CPU-only build of PyTorch (simulation only).
//
// Fake CUDA tensors can be created on a CPU-only torch, but autograd cannot run on them: every
// autograd node records the current stream of its inputs' device through the device-guard
// registry (c10/core/impl/DeviceGuardImplInterface.h), which has no CUDA entry in a CPU build
// (the process aborts), and the engine asks for "the accelerator" (ATen/DeviceAccelerator.cpp),
// which it finds through the CUDA hooks (ATen/detail/CUDAHooksInterface.h, registry key
// "CUDAHooks") that a CPU build leaves at their default ("no CUDA").
//
// This library registers both: a guard with one device, one default stream whose operations
// complete at once, and events that are always complete; and hooks that say CUDA is built and
// available with one device. Nothing here allocates or computes: under FakeTensorMode no kernel
// runs. It must be loaded before torch (the hooks are created once, on first use, which
// `import torch` already makes), and only into processes that simulate (bench.stackmodel.simcuda).
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {
using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;
using c10::Stream;

Device the_device() { return Device(DeviceType::CUDA, 0); }
Stream the_stream() { return Stream(Stream::DEFAULT, the_device()); }

struct SimulatedCudaGuard final : public c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device) const override { return the_device(); }
  Device getDevice() const override { return the_device(); }
  void setDevice(Device) const override {}
  void uncheckedSetDevice(Device) const noexcept override {}
  Stream getStream(Device) const noexcept override { return the_stream(); }
  Stream getDefaultStream(Device) const override { return the_stream(); }
  Stream getNewStream(Device, int) const override { return the_stream(); }
  Stream exchangeStream(Stream) const noexcept override { return the_stream(); }
  DeviceIndex deviceCount() const noexcept override { return 1; }
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

struct SimulatedCudaHooks final : public at::CUDAHooksInterface {
  explicit SimulatedCudaHooks(at::CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  DeviceIndex current_device() const override { return 0; }
  DeviceIndex deviceCount() const override { return 1; }
  DeviceIndex getCurrentDevice() const override { return 0; }
  int getNumGPUs() const override { return 1; }
  bool isPinnedPtr(const void*) const override { return false; }
};
}  // namespace

C10_REGISTER_GUARD_IMPL(CUDA, SimulatedCudaGuard);
namespace at {
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", SimulatedCudaHooks)
}
