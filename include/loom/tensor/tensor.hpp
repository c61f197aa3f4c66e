// Tensor<T, Device>: an owning, reference-counted n-dimensional array on the host or a CUDA device, and its views
// (shape, strides, offset into the same storage); devices Host and Cuda; memory accounting per device.
#pragma once

#include <loom/core/device.hpp>
#include <loom/core/half.hpp>
#include <loom/core/error.hpp>
#include <loom/core/memory.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace loom {

//! Bytes in use and the peak since start (or since reset_peak) for one kind of memory.
class MemoryStats {
 public:
  void add(std::size_t b) {
    const auto now = in_use_.fetch_add(b) + b;
    auto p = peak_.load();
    while (now > p && !peak_.compare_exchange_weak(p, now)) {
    }
  }
  void sub(std::size_t b) { in_use_.fetch_sub(b); }
  std::size_t in_use() const { return in_use_.load(); }
  std::size_t peak() const { return peak_.load(); }
  void reset_peak() { peak_.store(in_use_.load()); }

 private:
  std::atomic<std::size_t> in_use_{0}, peak_{0};
};

//! Host memory: 64-byte aligned, counted in host_memory().
inline MemoryStats& host_memory() {
  static MemoryStats s;
  return s;
}

namespace detail {

template <class Device>
struct DeviceMemory;

template <>
struct DeviceMemory<Host> {
  static void* allocate(std::size_t bytes) {
    if (bytes == 0) return nullptr;
    const std::size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    if (!p) throw Error(loom::detail::cat("loom: out of host memory allocating ", bytes, " bytes"));
    host_memory().add(rounded);
    return p;
  }
  static void release(void* p, std::size_t bytes) {
    if (!p) return;
    host_memory().sub((bytes + 63) / 64 * 64);
    std::free(p);
  }
};

}  // namespace detail

using Shape = std::vector<std::int64_t>;

inline std::int64_t numel_of(const Shape& s) {
  return std::accumulate(s.begin(), s.end(), std::int64_t{1}, std::multiplies<>());
}
inline std::string to_string(const Shape& s) {
  std::string r = "[";
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (i) r += ", ";
    r += std::to_string(s[i]);
  }
  return r + "]";
}
inline Shape contiguous_strides(const Shape& s) {
  Shape st(s.size());
  std::int64_t acc = 1;
  for (std::size_t i = s.size(); i-- > 0;) {
    st[i] = acc;
    acc *= s[i];
  }
  return st;
}

//! An n-dimensional array. Copies share storage (like torch.Tensor); clone() copies the data. Views made by
//! view(), slice() and select() share the storage too.
template <class T, class Device = Host>
class Tensor {
 public:
  using value_type = T;
  using device = Device;

  Tensor() = default;
  //! Uninitialised storage of the given shape, contiguous. On the host it is charged to the rank's ledger
  //! (rank_memory()) under the thread's current use (MemoryUseScope), and refused beyond the rank's cap; unless the
  //! use is uncounted there (UncountedMemoryScope).
  explicit Tensor(Shape shape) : shape_(std::move(shape)), strides_(contiguous_strides(shape_)) {
    for (auto d : shape_) LOOM_CHECK(d >= 0, "a tensor dimension must not be negative: shape ", to_string(shape_));
    const std::size_t bytes = static_cast<std::size_t>(numel_of(shape_)) * sizeof(T);
    if constexpr (std::is_same_v<Device, Host>) {
      const MemoryUse use = current_memory_use();
      std::shared_ptr<MemoryLedger> ledger = memory_counted(use) ? rank_memory_ledger() : nullptr;
      if (ledger) ledger->debit(use, bytes);
      T* p = nullptr;
      try {
        p = static_cast<T*>(detail::DeviceMemory<Device>::allocate(bytes));
      } catch (...) {
        if (ledger) ledger->credit(use, bytes);
        throw;
      }
      storage_ = std::shared_ptr<T>(p, [bytes, ledger = std::move(ledger), use](T* q) {
        detail::DeviceMemory<Device>::release(q, bytes);
        if (ledger) ledger->credit(use, bytes);
      });
    } else {
      T* p = static_cast<T*>(detail::DeviceMemory<Device>::allocate(bytes));
      storage_ = std::shared_ptr<T>(p, [bytes](T* q) { detail::DeviceMemory<Device>::release(q, bytes); });
    }
  }
  Tensor(std::initializer_list<std::int64_t> shape) : Tensor(Shape(shape)) {}

  static Tensor zeros(Shape shape) {
    Tensor t(std::move(shape));
    t.fill(T(0));
    return t;
  }

  T* data() const { return storage_.get() + offset_; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  std::int64_t shape(int i) const { return shape_.at(i < 0 ? i + dim() : i); }
  int dim() const { return static_cast<int>(shape_.size()); }
  std::int64_t numel() const { return numel_of(shape_); }
  std::size_t bytes() const { return static_cast<std::size_t>(numel()) * sizeof(T); }
  bool defined() const { return storage_ != nullptr || numel() == 0; }
  bool is_contiguous() const { return strides_ == contiguous_strides(shape_); }
  //! The elements as one span; the tensor must be contiguous.
  std::span<T> span() const {
    LOOM_CHECK(is_contiguous(), "span() of a non-contiguous tensor of shape ", to_string(shape_));
    return {data(), static_cast<std::size_t>(numel())};
  }

  //! Element access on the host: t(i, j, k).
  template <class... I>
  T& operator()(I... idx) const
    requires std::is_same_v<Device, Host>
  {
    static_assert(sizeof...(I) > 0, "loom: index a tensor with one integer per dimension");
    const std::array<std::int64_t, sizeof...(I)> ix{static_cast<std::int64_t>(idx)...};
    LOOM_CHECK(static_cast<int>(ix.size()) == dim(), "indexing a ", dim(), "-d tensor with ", ix.size(), " indices");
    std::int64_t at = 0;
    for (std::size_t d = 0; d < ix.size(); ++d) at += ix[d] * strides_[d];
    return data()[at];
  }

  //! The same elements with another shape (one dimension may be -1); the tensor must be contiguous.
  Tensor view(Shape shape) const {
    LOOM_CHECK(is_contiguous(), "view of a non-contiguous tensor of shape ", to_string(shape_));
    std::int64_t known = 1;
    int infer = -1;
    for (std::size_t i = 0; i < shape.size(); ++i) {
      if (shape[i] == -1) {
        LOOM_CHECK(infer < 0, "view: more than one -1 in ", to_string(shape));
        infer = static_cast<int>(i);
      } else {
        known *= shape[i];
      }
    }
    if (infer >= 0) shape[infer] = known ? numel() / known : 0;
    LOOM_CHECK(numel_of(shape) == numel(), "view: shape ", to_string(shape), " does not hold the ", numel(),
               " elements of ", to_string(shape_));
    Tensor t = *this;
    t.shape_ = std::move(shape);
    t.strides_ = contiguous_strides(t.shape_);
    return t;
  }
  //! Elements [begin, end) along dimension d.
  Tensor slice(int d, std::int64_t begin, std::int64_t end) const {
    LOOM_CHECK(d >= 0 && d < dim() && begin >= 0 && begin <= end && end <= shape_[d], "slice [", begin, ", ", end,
               ") of dimension ", d, " of shape ", to_string(shape_));
    Tensor t = *this;
    t.offset_ += begin * strides_[d];
    t.shape_[d] = end - begin;
    return t;
  }
  //! Index i of dimension d, which is dropped.
  Tensor select(int d, std::int64_t i) const {
    Tensor t = slice(d, i, i + 1);
    t.shape_.erase(t.shape_.begin() + d);
    t.strides_.erase(t.strides_.begin() + d);
    return t;
  }

  void fill(T value) const;
  //! A contiguous copy on the same device.
  Tensor clone() const {
    Tensor t(shape_);
    copy(*this, t);
    return t;
  }

  template <class U, class D>
  friend class Tensor;

 private:
  std::shared_ptr<T> storage_;
  Shape shape_, strides_;
  std::int64_t offset_ = 0;
};

namespace detail {
//! Calls f(offset_src, offset_dst, n) for each contiguous run of a copy between two same-shaped views.
template <class F>
void for_each_run(const Shape& shape, const Shape& s_src, const Shape& s_dst, F&& f) {
  const int d = static_cast<int>(shape.size());
  if (numel_of(shape) == 0) return;
  // The innermost dimensions that are contiguous in both form one run.
  int inner = d;
  std::int64_t run = 1;
  while (inner > 0 && s_src[inner - 1] == run && s_dst[inner - 1] == run) run *= shape[--inner];
  std::vector<std::int64_t> idx(inner, 0);
  for (;;) {
    std::int64_t a = 0, b = 0;
    for (int i = 0; i < inner; ++i) a += idx[i] * s_src[i], b += idx[i] * s_dst[i];
    f(a, b, run);
    int i = inner - 1;
    while (i >= 0 && ++idx[i] == shape[i]) idx[i--] = 0;
    if (i < 0) return;
  }
}
}  // namespace detail

//! dst = src element-wise; same shape; either may be a strided view. Host to host here; device copies come with
//! <loom/tensor/cuda.hpp>.
template <class T>
void copy(const Tensor<T, Host>& src, const Tensor<T, Host>& dst) {
  LOOM_CHECK(src.shape() == dst.shape(), "copy from shape ", to_string(src.shape()), " to shape ",
             to_string(dst.shape()));
  detail::for_each_run(src.shape(), src.strides(), dst.strides(), [&](auto a, auto b, auto n) {
    std::memmove(dst.data() + b, src.data() + a, static_cast<std::size_t>(n) * sizeof(T));
  });
}

//! Sets every element of a host tensor (device tensors: <loom/tensor/cuda.hpp>).
template <class T>
void fill_elements(const Tensor<T, Host>& t, T value) {
  detail::for_each_run(t.shape(), t.strides(), t.strides(),
                       [&](auto, auto b, auto n) { std::fill_n(t.data() + b, n, value); });
}

template <class T, class Device>
void Tensor<T, Device>::fill(T value) const {
  fill_elements(*this, value);  // found by argument-dependent lookup, also in <loom/tensor/cuda.hpp>
}

}  // namespace loom
