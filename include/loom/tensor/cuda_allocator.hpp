// A caching allocator for CUDA device memory: blocks come in size classes and go back to per-device, per-stream free
// lists, so that a training step in steady state never calls cudaMalloc or cudaFree. Reports bytes in use and their
// peak per device; thread-safe. CudaBuffer<T> owns one allocation.
#pragma once

#if !defined(LOOM_HAS_CUDA)
#error "loom: <loom/tensor/cuda_allocator.hpp> needs LOOM_HAS_CUDA: link loom::cuda (configure -DLOOM_WITH_CUDA=ON)"
#endif

#include <loom/core/error.hpp>

#include <cuda_runtime_api.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace loom {

//! One device's memory as the allocator sees it, in bytes.
struct CudaMemoryStats {
  std::size_t in_use = 0;     //!< held by live allocations, each counted at its size class
  std::size_t requested = 0;  //!< what the live allocations asked for
  std::size_t peak = 0;       //!< the most in_use has been since start or reset_peak()
  std::size_t reserved = 0;   //!< obtained from cudaMalloc and not yet returned: in use plus cached
  std::size_t cached = 0;     //!< reserved but free, waiting in a free list
  std::size_t mallocs = 0;    //!< cudaMalloc calls so far (constant in steady state)
  std::size_t frees = 0;      //!< cudaFree calls so far (empty_cache, or a retry after running out)
};

namespace detail {

inline void cuda_allocator_check(cudaError_t rc, std::string_view call) {
  if (rc == cudaSuccess) return;
  throw BackendError(cat("loom: ", call.substr(0, call.find('(')), " failed: ", cudaGetErrorString(rc), " (",
                         cudaGetErrorName(rc), ")"));
}

}  // namespace detail

//! The process-wide caching allocator (CudaAllocator::instance()).
//!
//! A freed block goes back to the free list of the device and stream it was allocated for, and only allocations for
//! that stream reuse it: stream order then guarantees that the kernels which used it are done, without a sync. A
//! block handed to work on another stream must be ordered by the caller (an event) before it is freed.
class CudaAllocator {
 public:
  //! Size classes: multiples of `granule` up to 8 KiB, then 8 steps per octave (at most 12.5% over the request).
  static constexpr std::size_t granule = 512;
  static constexpr int steps_per_octave_log2 = 3;

  static CudaAllocator& instance() {
    // Never destroyed: blocks outlive static destruction order, and the driver reclaims them at exit.
    static CudaAllocator* a = new CudaAllocator;
    return *a;
  }

  //! The bytes a request of `bytes` occupies (its size class).
  static constexpr std::size_t size_class(std::size_t bytes) {
    if (bytes == 0) return 0;
    const int octave = std::bit_width(bytes) - 1;  // 2^octave <= bytes < 2^(octave+1)
    const std::size_t fine = octave > steps_per_octave_log2 ? std::size_t{1} << (octave - steps_per_octave_log2) : 1;
    const std::size_t step = fine > granule ? fine : granule;
    return (bytes + step - 1) / step * step;
  }

  //! Device memory for `bytes` on the current device, to be used on `stream` (nullptr for 0 bytes). Throws
  //! loom::BackendError when the device is out of memory even after the cache is returned to it.
  [[nodiscard]] void* allocate(std::size_t bytes, cudaStream_t stream = nullptr) {
    if (bytes == 0) return nullptr;
    int device = 0;
    detail::cuda_allocator_check(cudaGetDevice(&device), "cudaGetDevice");
    const std::size_t size = size_class(bytes);
    std::lock_guard lock(mutex_);
    DeviceState& d = state(device);
    void* p = nullptr;
    if (auto it = free_.find(Key{device, stream, size}); it != free_.end() && !it->second.empty()) {
      p = it->second.back();
      it->second.pop_back();
      d.stats.cached -= size;
    } else {
      p = device_malloc(device, size, bytes);
    }
    live_.emplace(p, Block{device, stream, size, bytes});
    d.stats.in_use += size;
    d.stats.requested += bytes;
    if (d.stats.in_use > d.stats.peak) d.stats.peak = d.stats.in_use;
    return p;
  }

  //! Returns p (from allocate, or nullptr) to its free list; the memory stays reserved for later allocations.
  void deallocate(void* p) {
    if (p == nullptr) return;
    std::lock_guard lock(mutex_);
    auto it = live_.find(p);
    LOOM_CHECK(it != live_.end(), "CudaAllocator::deallocate of a pointer it did not allocate (", p, ")");
    const Block b = it->second;
    live_.erase(it);
    DeviceState& d = state(b.device);
    d.stats.in_use -= b.size;
    d.stats.requested -= b.requested;
    d.stats.cached += b.size;
    free_[Key{b.device, b.stream, b.size}].push_back(p);
  }

  //! Counts for one device (default: the current one).
  CudaMemoryStats stats(int device = -1) const {
    if (device < 0) detail::cuda_allocator_check(cudaGetDevice(&device), "cudaGetDevice");
    std::lock_guard lock(mutex_);
    auto it = devices_.find(device);
    return it == devices_.end() ? CudaMemoryStats{} : it->second.stats;
  }
  std::size_t bytes_in_use(int device = -1) const { return stats(device).in_use; }
  std::size_t peak_bytes(int device = -1) const { return stats(device).peak; }

  //! Starts the peak over from the bytes in use now.
  void reset_peak(int device = -1) {
    if (device < 0) detail::cuda_allocator_check(cudaGetDevice(&device), "cudaGetDevice");
    std::lock_guard lock(mutex_);
    DeviceState& d = state(device);
    d.stats.peak = d.stats.in_use;
  }

  //! Returns every cached block on every device to the driver (cudaFree waits for the device to be idle).
  void empty_cache() {
    std::lock_guard lock(mutex_);
    release_cached(-1);
  }

  //! Live allocations (for leak checks in tests).
  std::size_t live_blocks() const {
    std::lock_guard lock(mutex_);
    return live_.size();
  }

 private:
  struct Block {
    int device;
    cudaStream_t stream;
    std::size_t size, requested;
  };
  struct Key {
    int device;
    cudaStream_t stream;
    std::size_t size;
    bool operator<(const Key& o) const {
      return std::tie(device, stream, size) < std::tie(o.device, o.stream, o.size);
    }
  };
  struct DeviceState {
    CudaMemoryStats stats;
  };

  CudaAllocator() = default;

  DeviceState& state(int device) { return devices_[device]; }

  // Called with the lock held. Out of memory: give the cache back to this device and try once more.
  void* device_malloc(int device, std::size_t size, std::size_t bytes) {
    void* p = nullptr;
    cudaError_t rc = cudaMalloc(&p, size);
    if (rc == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // the failed cudaMalloc left its error as this thread's last one
      release_cached(device);
      rc = cudaMalloc(&p, size);
    }
    if (rc == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      const CudaMemoryStats& s = state(device).stats;
      throw BackendError(detail::cat("loom: out of device memory on device ", device, " allocating ", bytes,
                                     " bytes (size class ", size, "; in use ", s.in_use, ", cached ", s.cached,
                                     ")"));
    }
    detail::cuda_allocator_check(rc, "cudaMalloc");
    DeviceState& d = state(device);
    d.stats.reserved += size;
    ++d.stats.mallocs;
    return p;
  }

  // Called with the lock held; device -1 means all devices.
  void release_cached(int device) {
    int current = 0;
    detail::cuda_allocator_check(cudaGetDevice(&current), "cudaGetDevice");
    for (auto it = free_.begin(); it != free_.end();) {
      if (device >= 0 && it->first.device != device) {
        ++it;
        continue;
      }
      if (!it->second.empty()) {
        detail::cuda_allocator_check(cudaSetDevice(it->first.device), "cudaSetDevice");
        DeviceState& d = state(it->first.device);
        for (void* p : it->second) {
          detail::cuda_allocator_check(cudaFree(p), "cudaFree");
          d.stats.reserved -= it->first.size;
          d.stats.cached -= it->first.size;
          ++d.stats.frees;
        }
      }
      it = free_.erase(it);
    }
    detail::cuda_allocator_check(cudaSetDevice(current), "cudaSetDevice");
  }

  mutable std::mutex mutex_;
  std::map<Key, std::vector<void*>> free_;
  std::unordered_map<void*, Block> live_;
  std::map<int, DeviceState> devices_;
};

//! n elements of T in device memory from the caching allocator, for one stream; move-only, freed on destruction.
template <class T>
class CudaBuffer {
 public:
  CudaBuffer() = default;
  explicit CudaBuffer(std::size_t n, cudaStream_t stream = nullptr)
      : data_(static_cast<T*>(CudaAllocator::instance().allocate(n * sizeof(T), stream))), size_(n) {}
  CudaBuffer(CudaBuffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  CudaBuffer& operator=(CudaBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  CudaBuffer(const CudaBuffer&) = delete;
  CudaBuffer& operator=(const CudaBuffer&) = delete;
  ~CudaBuffer() { reset(); }

  T* data() const { return data_; }
  std::size_t size() const { return size_; }
  std::size_t bytes() const { return size_ * sizeof(T); }
  void reset() {
    CudaAllocator::instance().deallocate(data_);
    data_ = nullptr;
    size_ = 0;
  }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace loom
