// The LibTorch internals ShardRL relies on beyond the C++ frontend's public API (c10d backends,
// raw storages, optimizer state keys), in one place so that a LibTorch upgrade is checked here.
// LibTorch 2.x only.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>
#include <torch/optim/optimizer.h>
#include <torch/version.h>
// at::accelerator's memory counters, device-generic, exist from LibTorch 2.9 on.
#define SHARDRL_ACCELERATOR_MEMORY_STATS (TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 9)
#if SHARDRL_ACCELERATOR_MEMORY_STATS
#include <ATen/DeviceAccelerator.h>
#elif defined(USE_C10D_NCCL)
#include <c10/cuda/CUDACachingAllocator.h>
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <chrono>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>

static_assert(TORCH_VERSION_MAJOR >= 2, "ShardRL needs LibTorch 2.x");

namespace shardrl::compat {

using Backend = c10d::Backend;

inline std::shared_ptr<::gloo::transport::Device> gloo_device(const std::string& master_addr) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  if (master_addr == "127.0.0.1" || master_addr == "localhost") {
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

inline c10::intrusive_ptr<Backend> make_gloo(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                             int size, std::chrono::milliseconds timeout,
                                             const std::string& master_addr) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(gloo_device(master_addr));
  // Two worker threads let a prefetched all-gather progress while another collective waits.
  options->threads = 2;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

#ifdef USE_C10D_NCCL
inline c10::intrusive_ptr<Backend> make_nccl(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                             int size, std::chrono::milliseconds timeout,
                                             const at::Device& device) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  // The host waits with `timeout` where it needs a result (ProcessGroup's blocking collectives,
  // at least one per optimizer step), so a hang ends in the same CollectiveError naming the rank
  // as on Gloo. NCCL's watchdog, which tears the process down without that diagnosis, is only
  // the backstop: its clock starts at the hung collective, earlier than the host's wait, so it
  // gets twice the timeout plus a minute.
  options->timeout = 2 * timeout + std::chrono::minutes(1);
  auto backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
  // Bound to this rank's GPU: the communicator is created eagerly there, not guessed later.
  backend->setBoundDeviceId(device);
  return backend;
}
#endif

// FSDP frees an unsharded parameter by dropping its storage's bytes while keeping the tensor (and
// every view autograd saved of it) alive; re-allocating the same StorageImpl revives those views.
inline void free_storage(const at::Tensor& t) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  if (impl->nbytes() == 0) return;
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  impl->set_nbytes(0);
}

// Gives t's storage `nbytes` fresh bytes on t's device (the CUDA allocator allocates on the
// current device, hence the guard), for storages that other tensors view.
inline void alloc_storage(const at::Tensor& t, size_t nbytes) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  if (impl->nbytes() == nbytes) return;
  c10::DeviceGuard on_device(t.device());
  impl->set_data_ptr_noswap(c10::GetAllocator(t.device().type())->allocate(nbytes));
  impl->set_nbytes(nbytes);
}

// Points t's storage at `nbytes` that `data` owns (memory the tensor's allocator did not make).
inline void set_storage(const at::Tensor& t, at::DataPtr data, size_t nbytes) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(std::move(data));
  impl->set_nbytes(nbytes);
}

inline void alloc_storage(const at::Tensor& t) {
  alloc_storage(t, static_cast<size_t>(t.numel()) * t.element_size());
}

// The whole storage behind t as a flat byte tensor on t's device (empty once freed). Through the
// StorageImpl's DataPtr, whose get() is a mutable pointer (Storage::data() is const).
inline at::Tensor storage_bytes(const at::Tensor& t) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  return at::from_blob(impl->data_ptr().get(), {static_cast<int64_t>(impl->nbytes())},
                       at::TensorOptions().dtype(at::kByte).device(t.device()));
}

// Optimizer::state() is keyed by the parameter's TensorImpl: the pointer itself since LibTorch
// 2.2, its address printed as a string before. The key type is read off the map, not the version.
using OptimizerStateKey =
    typename std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;

template <class Key = OptimizerStateKey>
Key optimizer_state_key(const at::Tensor& param) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream address;
    address << param.unsafeGetTensorImpl();
    return address.str();
  } else {
    return param.unsafeGetTensorImpl();
  }
}

// The device caching allocator's counters (torch.cuda.memory_stats) and the reset of their peaks
// (torch.cuda.reset_peak_memory_stats). at::accelerator has both from LibTorch 2.9 on, for any
// accelerator; before, CUDA's allocator does, which only the CUDA build links.
inline c10::CachingDeviceAllocator::DeviceStats device_memory_stats(c10::DeviceIndex index) {
#if SHARDRL_ACCELERATOR_MEMORY_STATS
  return at::accelerator::getDeviceStats(index);
#elif defined(USE_C10D_NCCL)
  return c10::cuda::CUDACachingAllocator::getDeviceStats(index);
#else
  (void)index;
  throw std::runtime_error("device memory statistics need LibTorch 2.9 or a CUDA build");
#endif
}

inline void reset_peak_device_memory(c10::DeviceIndex index) {
#if SHARDRL_ACCELERATOR_MEMORY_STATS
  at::accelerator::resetPeakStats(index);
#elif defined(USE_C10D_NCCL)
  c10::cuda::CUDACachingAllocator::resetPeakStats(index);
#else
  (void)index;
  throw std::runtime_error("device memory statistics need LibTorch 2.9 or a CUDA build");
#endif
}

}  // namespace shardrl::compat
