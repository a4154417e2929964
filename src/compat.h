// Every difference between LibTorch 1.13 (Debian, CPU) and 2.x (CUDA/NCCL clusters) lives here.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/string_utils.h>
#include <torch/version.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <chrono>
#include <cstdlib>
#include <string>

namespace shardrl::compat {

// 2.0 split transports out of ProcessGroup into c10d::Backend; the collective methods kept their
// names and signatures, so the rest of the code programs against this alias.
#if TORCH_VERSION_MAJOR >= 2
using Backend = c10d::Backend;
#else
using Backend = c10d::ProcessGroup;
#endif

// Gloo learnt bf16 in 2.2; before that any bf16 tensor throws "Invalid scalar type".
constexpr bool kGlooHasBf16 = TORCH_VERSION_MAJOR > 2 ||
                              (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 2);

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
                                             int size, std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
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

// Gives t's storage `nbytes` fresh bytes (offload restores storages that other tensors view).
inline void alloc_storage(const at::Tensor& t, size_t nbytes) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  if (impl->nbytes() == nbytes) return;
  impl->set_data_ptr_noswap(c10::GetAllocator(t.device().type())->allocate(nbytes));
  impl->set_nbytes(nbytes);
}

inline void alloc_storage(const at::Tensor& t) {
  alloc_storage(t, static_cast<size_t>(t.numel()) * t.element_size());
}

// The whole storage behind t as a flat byte tensor on t's device (empty once freed). Through the
// StorageImpl's DataPtr, whose get() is a mutable pointer in every version (Storage::data() is
// const from 2.1 on).
inline at::Tensor storage_bytes(const at::Tensor& t) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  return at::from_blob(impl->data_ptr().get(), {static_cast<int64_t>(impl->nbytes())},
                       at::TensorOptions().dtype(at::kByte).device(t.device()));
}

// Optimizer::state() is keyed by the parameter's TensorImpl address: printed as a string in 1.x,
// the pointer itself in 2.x. Checkpoints restore optimizer state through this key.
#if TORCH_VERSION_MAJOR >= 2
inline void* optimizer_state_key(const at::Tensor& param) {
  return param.unsafeGetTensorImpl();
}
#else
inline std::string optimizer_state_key(const at::Tensor& param) {
  return c10::guts::to_string(param.unsafeGetTensorImpl());
}
#endif

}  // namespace shardrl::compat
