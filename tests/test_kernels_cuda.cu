// The CUDA kernels against the CPU kernels on seeded random data, for float, double, bf16 and fp16: each case runs
// the device kernel on values of its type and the CPU kernel in double on the very same values, and compares on the
// scale of the reference (max |got - want| <= tol * max |want|): float ~1e-5, bf16 ~1e-2, fp16 ~3e-3, double
// ~1e-12. Dropout must give the CPU's mask bit for bit. Attention runs over lengths on and off the tile sizes, head
// counts, GQA/MQA ratios, head sizes on both kernel paths, and a fused qkv layout. Also the caching allocator's
// accounting and the error messages. Without a CUDA device it prints "SKIPPED: no CUDA device here" and exits with 77.
// It compiles the kernels it tests itself, as a source nvcc builds without loom::cuda_kernels does (header-only):
// Ops<Cuda> from <loom/kernels/cuda/device_ops.cuh> too.
#undef LOOM_EXTERN_CUDA_KERNELS
#include "catch.hpp"
#include "gpu_skip.hpp"

#include <loom/kernels/cpu/ops.hpp>
#include <loom/kernels/cuda/device_ops.cuh>
#include <loom/kernels/cuda/ops.cuh>
#include <loom/kernels/cuda/profile.hpp>
#include <loom/tensor/cuda_allocator.hpp>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace cpu = loom::kernels::cpu;
namespace gpu = loom::kernels::cuda;
using loom::CudaAllocator;
using loom::CudaBuffer;

namespace {

// --- element types -----------------------------------------------------------------------------------------------

template <class T>
T from_double(double x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16(static_cast<float>(x));
  else if constexpr (std::is_same_v<T, __half>) return __float2half(static_cast<float>(x));
  else return static_cast<T>(x);
}
template <class T>
double to_double(T x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(x);
  else if constexpr (std::is_same_v<T, __half>) return __half2float(x);
  else return static_cast<double>(x);
}

//! Tolerance on the scale of the reference for results stored as T.
template <class T>
constexpr double tol() {
  if constexpr (std::is_same_v<T, double>) return 1e-12;
  else if constexpr (std::is_same_v<T, float>) return 1e-5;
  else if constexpr (std::is_same_v<T, __half>) return 3e-3;
  else return 1e-2;
}
//! For results kept in acc_t<T> (layer-norm statistics, cross-entropy partials): float arithmetic on T's values.
template <class T>
constexpr double tol_acc() {
  return std::is_same_v<T, double> ? 1e-12 : 1e-5;
}

//! Whether cuBLASLt took an epilogue that loom offered it (fused_epilogues rose by one). The library's heuristic
//! may decline a combination on a given version, and loom then runs the separate passes (whose values the caller
//! checks), so a decline is reported, not failed; offers loom must not make are checked with CHECK.
inline void report_fusion(long before, const std::string& what) {
  if (loom::kernels::cuda::detail::fused_epilogues() != before + 1) WARN("cuBLASLt declined the epilogue: " << what);
}

//! The CPU kernels' name for T's bytes (for the cases compared bit for bit).
template <class T>
using cpu_t = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, loom::bf16,
                                 std::conditional_t<std::is_same_v<T, __half>, loom::fp16, T>>;

// --- data --------------------------------------------------------------------------------------------------------

cudaStream_t stream() {
  static cudaStream_t s = [] {
    cudaStream_t x = nullptr;
    LOOM_CUDA(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
    return x;
  }();
  return s;
}

//! Values of T, and the same values exactly as double for the CPU reference.
template <class T>
struct Values {
  std::vector<T> t;
  std::vector<double> d;
};

template <class T>
Values<T> rounded(const std::vector<double>& x) {
  Values<T> v;
  v.t.resize(x.size());
  v.d.resize(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    v.t[i] = from_double<T>(x[i]);
    v.d[i] = to_double(v.t[i]);
  }
  return v;
}

struct Rng {
  std::mt19937_64 gen;
  explicit Rng(std::uint64_t seed) : gen(seed) {}
  std::vector<double> uniform(std::size_t n, double lo = -1.0, double hi = 1.0) {
    std::uniform_real_distribution<double> dist(lo, hi);
    std::vector<double> v(n);
    for (auto& x : v) x = dist(gen);
    return v;
  }
  template <class T>
  Values<T> values(std::size_t n, double lo = -1.0, double hi = 1.0) {
    return rounded<T>(uniform(n, lo, hi));
  }
  std::vector<std::int32_t> ints(std::size_t n, int lo, int hi) {  // [lo, hi]
    std::uniform_int_distribution<int> dist(lo, hi);
    std::vector<std::int32_t> v(n);
    for (auto& x : v) x = dist(gen);
    return v;
  }
};

//! A device copy of a host vector, from the caching allocator, on the test stream.
template <class T>
class Dev {
 public:
  explicit Dev(std::size_t n) : buf_(n, stream()) {}
  explicit Dev(const std::vector<T>& h) : buf_(h.size(), stream()) {
    if (!h.empty())
      LOOM_CUDA(cudaMemcpyAsync(buf_.data(), h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice, stream()));
    LOOM_CUDA(cudaStreamSynchronize(stream()));
  }
  T* get() const { return buf_.data(); }
  std::vector<T> host() const {
    std::vector<T> h(buf_.size());
    if (!h.empty())
      LOOM_CUDA(cudaMemcpyAsync(h.data(), buf_.data(), h.size() * sizeof(T), cudaMemcpyDeviceToHost, stream()));
    LOOM_CUDA(cudaStreamSynchronize(stream()));
    return h;
  }

 private:
  CudaBuffer<T> buf_;
};

template <class T>
std::vector<double> doubles(const std::vector<T>& v) {
  std::vector<double> d(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) d[i] = to_double(v[i]);
  return d;
}

//! max |got - want| <= tol * max |want| (NaN fails).
template <class T>
void check_close(const std::vector<T>& got, const std::vector<double>& want, double tolerance,
                 const std::string& what) {
  REQUIRE(got.size() == want.size());
  double scale = 0, err = 0;
  std::size_t worst = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    scale = std::max(scale, std::abs(want[i]));
    double e = std::abs(to_double(got[i]) - want[i]);
    if (std::isnan(e)) e = INFINITY;
    if (e > err) {
      err = e;
      worst = i;
    }
  }
  INFO(what << ": worst element " << worst << " of " << want.size() << ": got "
            << (want.empty() ? 0.0 : to_double(got[worst])) << ", want " << (want.empty() ? 0.0 : want[worst])
            << "; error " << err << " against tolerance " << tolerance << " x scale " << scale);
  CHECK(err <= tolerance * std::max(scale, 1e-300));
}

template <class A, class T>
std::vector<A> cast(const std::vector<T>& v) {
  std::vector<A> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = static_cast<A>(to_double(v[i]));
  return out;
}

//! f() throws E whose message contains `text`.
template <class E, class F>
void check_error(F&& f, const std::string& text) {
  try {
    f();
    FAIL("no exception; expected one saying: " << text);
  } catch (const E& e) {
    const std::string msg = e.what();
    INFO(msg);
    CHECK(msg.rfind("loom: ", 0) == 0);
    CHECK(msg.find(text) != std::string::npos);
  }
}

//! A norm's input gradient with a residual's (backward(out, res): out = res + the gradient; res may be out) against
//! the gradient alone (`own`, n values) then accumulate: the same bits, apart and in place.
template <class T, class F>
void check_residual(std::size_t n, const Dev<T>& own, F&& backward, const std::string& what) {
  Rng rng(99);
  const auto res = rng.values<T>(n, -4.0, 4.0);
  Dev<T> want(res.t), apart(n), in_place(res.t), dres(res.t);
  gpu::accumulate(own.get(), want.get(), n, stream());
  backward(apart.get(), dres.get());
  backward(in_place.get(), in_place.get());
  const auto w = want.host(), a = apart.host(), p = in_place.host();
  INFO(what << " with a residual");
  CHECK(std::memcmp(a.data(), w.data(), n * sizeof(T)) == 0);
  CHECK(std::memcmp(p.data(), w.data(), n * sizeof(T)) == 0);
}

#define LOOM_TYPES float, double, __nv_bfloat16, __half

}  // namespace

// --- matrix products ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("matmul matches the CPU: transposes, alpha/beta, shapes off the tile sizes", "[cuda][matmul]",
                   LOOM_TYPES) {
  using T = TestType;
  Rng rng(1);
  struct Shape {
    int M, N, K;
  };
  // The last two are large enough for rows of 1001 elements (not a multiple of 16 bytes) to run on padded copies,
  // for some of the transposes of every type (C alone padded, copied in and back: K / (2 sizeof(T)) FLOPs a byte
  // moved; A alone: N / sizeof(T)).
  static_assert(2.0 * 136 * 1001 * 1040 >= gpu::detail::pad_min_flops);
  static_assert(1040.0 / (2 * sizeof(T)) >= gpu::detail::pad_min_intensity<T>);
  for (const Shape sh : {Shape{1, 1, 1}, Shape{37, 53, 29}, Shape{64, 128, 96}, Shape{130, 7, 257},
                         Shape{136, 1001, 1040}, Shape{136, 1040, 1001}}) {
    const long padded_before = gpu::detail::padded_products();
    for (const bool ta : {false, true}) {
      for (const bool tb : {false, true}) {
        const auto a = rng.values<T>(std::size_t(sh.M) * sh.K);
        const auto b = rng.values<T>(std::size_t(sh.K) * sh.N);
        const auto c = rng.values<T>(std::size_t(sh.M) * sh.N);
        const float alpha = 0.75f, beta = 0.5f;
        std::vector<double> want = c.d;
        cpu::matmul(a.d.data(), b.d.data(), want.data(), sh.M, sh.N, sh.K, ta, tb, alpha, beta);
        Dev<T> da(a.t), db(b.t), dc(c.t);
        gpu::matmul(da.get(), db.get(), dc.get(), sh.M, sh.N, sh.K, ta, tb, alpha, beta, stream());
        check_close(dc.host(), want, tol<T>(),
                    "matmul M=" + std::to_string(sh.M) + " N=" + std::to_string(sh.N) + " K=" +
                        std::to_string(sh.K) + " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb));
      }
    }
    INFO("M=" << sh.M << " N=" << sh.N << " K=" << sh.K);
    CHECK((gpu::detail::padded_products() > padded_before) == (sh.M == 136));
  }
}

TEMPLATE_TEST_CASE("matmul_ld: row strides of their own, on whole lines (no padded copies) or not; the gaps stay",
                   "[cuda][matmul]", LOOM_TYPES) {
  using T = TestType;
  Rng rng(21);
  const int M = 136, N = 1001, K = 1040;
  for (const int gap : {1024 - N, 3}) {  // 1024: whole 128-byte lines for every type
    const long padded_before = gpu::detail::padded_products();
    for (const bool ta : {false, true}) {
      for (const bool tb : {false, true}) {
        const int ra = ta ? K : M, ca = ta ? M : K, rb = tb ? N : K, cb = tb ? K : N;
        // Row strides: A's and B's their widths plus gap where N is their width, C's N + gap.
        const std::ptrdiff_t lda = ca + (ca == N ? gap : 0), ldb = cb + (cb == N ? gap : 0), ldc = N + gap;
        const auto a = rng.values<T>(std::size_t(ra) * lda);
        const auto b = rng.values<T>(std::size_t(rb) * ldb);
        const auto c = rng.values<T>(std::size_t(M) * ldc);
        std::vector<double> want = c.d;
        cpu::matmul_ld(a.d.data(), lda, b.d.data(), ldb, want.data(), ldc, M, N, K, ta, tb, 0.75f, 0.5f);
        Dev<T> da(a.t), db(b.t), dc(c.t);
        gpu::matmul_ld(da.get(), lda, db.get(), ldb, dc.get(), ldc, M, N, K, ta, tb, 0.75f, 0.5f, stream());
        check_close(dc.host(), want, tol<T>(),
                    "matmul_ld gap=" + std::to_string(gap) + " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb));
      }
    }
    if (gap == 1024 - N) CHECK(gpu::detail::padded_products() == padded_before);
  }
}

TEMPLATE_TEST_CASE("matmul_bias adds the bias to every row, matmul_residual the bias (or none) and a residual read "
                   "apart from the output; bf16, fp16 and float fuse them",
                   "[cuda][matmul]", LOOM_TYPES) {
  using T = TestType;
  Rng rng(22);
  struct Shape {
    int M, N, K;
  };
  for (const Shape sh : {Shape{64, 96, 128}, Shape{37, 200, 72}, Shape{5, 13, 7}}) {
    for (const bool ta : {false, true}) {
      for (const bool tb : {false, true}) {
        const auto a = rng.values<T>(std::size_t(sh.M) * sh.K);
        const auto b = rng.values<T>(std::size_t(sh.K) * sh.N);
        const auto bias = rng.values<T>(std::size_t(sh.N));
        const auto res = rng.values<T>(std::size_t(sh.M) * sh.N);
        const auto c = rng.values<T>(std::size_t(sh.M) * sh.N);  // overwritten
        std::vector<double> product(c.d.size());
        cpu::matmul(a.d.data(), b.d.data(), product.data(), sh.M, sh.N, sh.K, ta, tb);
        const std::string what = " M=" + std::to_string(sh.M) + " N=" + std::to_string(sh.N) + " K=" +
                                 std::to_string(sh.K) + " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb);
        // Rows of 16-byte multiples in a type with an epilogue: the bias and the residual ride on the product.
        const auto line = [](int n) { return n * sizeof(T) % 16 == 0; };
        const bool rows16 = line(sh.M) && line(sh.N) && line(sh.K), fusable = !std::is_same_v<T, double>;
        Dev<T> da(a.t), db(b.t), dbias(bias.t), dres(res.t);
        // kind 0: matmul_bias; 1, 2: matmul_residual with the bias and without.
        for (int kind = 0; kind < 3; ++kind) {
          std::vector<double> want = product;
          for (int r = 0; r < sh.M; ++r)
            for (int n = 0; n < sh.N; ++n) {
              const std::size_t i = std::size_t(r) * sh.N + n;
              want[i] += (kind < 2 ? bias.d[std::size_t(n)] : 0.0) + (kind > 0 ? res.d[i] : 0.0);
            }
          Dev<T> dc(c.t);
          const long fused_before = gpu::detail::fused_epilogues();
          if (kind == 0) {
            gpu::matmul_bias(da.get(), db.get(), dbias.get(), dc.get(), sh.M, sh.N, sh.K, ta, tb, stream());
          } else {
            gpu::matmul_residual(da.get(), db.get(), kind == 1 ? dbias.get() : nullptr, dres.get(), dc.get(), sh.M,
                                 sh.N, sh.K, ta, tb, stream());
          }
          const char* names[] = {"matmul_bias", "matmul_residual", "matmul_residual without a bias"};
          const std::string name = names[kind] + what;
          // The residual: one rounding where fused (summed in the accumulator), two apart.
          check_close(dc.host(), want, (kind == 0 ? 1 : 2) * tol<T>(), name);
          if (rows16 && fusable) report_fusion(fused_before, name);
          if (!fusable || !line(sh.N)) CHECK(gpu::detail::fused_epilogues() == fused_before);
        }
        const auto kept = dres.host();  // the residual is read, not written
        CHECK(std::memcmp(kept.data(), res.t.data(), kept.size() * sizeof(T)) == 0);
      }
    }
  }
  Dev<T> d(std::size_t{64 * 64});
  const T* no_bias = nullptr;
  check_error<loom::Error>(
      [&] { gpu::matmul_residual(d.get(), d.get(), no_bias, d.get(), d.get(), 64, 64, 64, false, false, stream()); },
      "the residual must not be the output");
}

TEMPLATE_TEST_CASE("matmul_bgrad: a weight's gradient and its bias's (B's column sums, accumulated) in one product; "
                   "bf16, fp16 and float sum the bias's in the epilogue",
                   "[cuda][matmul]", LOOM_TYPES) {
  using T = TestType;
  Rng rng(25);
  struct Shape {
    int M, N, K;
  };
  const auto line = [](int n) { return n * sizeof(T) % 16 == 0; };
  for (const Shape sh : {Shape{64, 96, 128}, Shape{40, 72, 304}, Shape{5, 13, 7}}) {
    for (const bool ta : {true, false}) {
      const auto a = rng.values<T>(std::size_t(sh.M) * sh.K), b = rng.values<T>(std::size_t(sh.K) * sh.N);
      const auto c = rng.values<T>(std::size_t(sh.M) * sh.N), bias = rng.values<T>(std::size_t(sh.N));
      std::vector<double> want = c.d, want_bias = bias.d;
      cpu::matmul(a.d.data(), b.d.data(), want.data(), sh.M, sh.N, sh.K, ta, false, 1.0f, 1.0f);
      cpu::bias_backward(b.d.data(), want_bias.data(), sh.K, sh.N);
      Dev<T> da(a.t), db(b.t), dc(c.t), dbias(bias.t);
      const long before = gpu::detail::fused_epilogues();
      gpu::matmul_bgrad(da.get(), db.get(), dc.get(), dbias.get(), sh.M, sh.N, sh.K, ta, 1.0f, 1.0f, stream());
      const std::string what = "matmul_bgrad M=" + std::to_string(sh.M) + " N=" + std::to_string(sh.N) + " K=" +
                               std::to_string(sh.K) + " ta=" + std::to_string(ta);
      check_close(dc.host(), want, tol<T>(), what + ", the product");
      check_close(dbias.host(), want_bias, tol<T>(), what + ", the bias's gradient");
      if (line(sh.M) && line(sh.N) && line(sh.K) && !std::is_same_v<T, double>) report_fusion(before, what);
      if (std::is_same_v<T, double> || !line(sh.N)) CHECK(gpu::detail::fused_epilogues() == before);
    }
  }
  // A scaled product: the bias's sums are not scaled, so the epilogue (whose sums may take alpha) is not offered.
  const int M = 64, N = 96, K = 128;
  const auto a = rng.values<T>(std::size_t(M) * K), b = rng.values<T>(std::size_t(K) * N);
  const auto bias = rng.values<T>(std::size_t(N));
  std::vector<double> want(std::size_t(M) * N), want_bias = bias.d;
  cpu::matmul(a.d.data(), b.d.data(), want.data(), M, N, K, true, false, 0.5f, 0.0f);
  cpu::bias_backward(b.d.data(), want_bias.data(), K, N);
  Dev<T> da(a.t), db(b.t), dc(std::size_t(M) * N), dbias(bias.t);
  const long before = gpu::detail::fused_epilogues();
  gpu::matmul_bgrad(da.get(), db.get(), dc.get(), dbias.get(), M, N, K, true, 0.5f, 0.0f, stream());
  check_close(dc.host(), want, tol<T>(), "matmul_bgrad with alpha 0.5, the product");
  check_close(dbias.host(), want_bias, tol<T>(), "matmul_bgrad with alpha 0.5, the bias's gradient");
  CHECK(gpu::detail::fused_epilogues() == before);
}

TEMPLATE_TEST_CASE("matmul_bias_gelu and matmul_dgelu equal the product, bias and GELU (or its derivative) apart; "
                   "bf16 and fp16 fuse them",
                   "[cuda][matmul]", LOOM_TYPES) {
  using T = TestType;
  Rng rng(23);
  constexpr bool fuses = sizeof(T) == 2;
  for (const bool with_bias : {true, false}) {
    for (const bool tb : {false, true}) {
      const int M = 48, N = 80, K = 64;  // whole 16-byte rows for every type
      const auto a = rng.values<T>(std::size_t(M) * K);
      const auto b = rng.values<T>(std::size_t(K) * N);
      const auto bias = rng.values<T>(std::size_t(N));
      const auto junk = rng.values<T>(std::size_t(M) * N);  // what the outputs overwrite
      std::vector<double> pre(junk.d.size()), out(junk.d.size());
      cpu::matmul(a.d.data(), b.d.data(), pre.data(), M, N, K, false, tb);
      if (with_bias) cpu::bias_add(pre.data(), bias.d.data(), pre.data(), M, N);
      cpu::gelu_forward(pre.data(), out.data(), pre.size());
      Dev<T> da(a.t), db(b.t), dbias(bias.t), dpre(junk.t), dout(junk.t);
      const std::string what = std::string(with_bias ? " with bias" : " without bias") + (tb ? " Bt" : "");
      long before = gpu::detail::fused_epilogues();
      gpu::matmul_bias_gelu(da.get(), db.get(), with_bias ? dbias.get() : nullptr, dpre.get(), dout.get(), M, N, K,
                            false, tb, stream());
      check_close(dpre.host(), pre, tol<T>(), "matmul_bias_gelu's input to the GELU" + what);
      check_close(dout.host(), out, tol<T>(), "matmul_bias_gelu" + what);
      if (fuses || (with_bias && !std::is_same_v<T, double>)) report_fusion(before, "matmul_bias_gelu" + what);
      else CHECK(gpu::detail::fused_epilogues() == before);

      // Backward: a product of the GELU's output's shape (here dy (M x K) times op(b)), times GELU'(pre).
      const auto dy = rng.values<T>(std::size_t(M) * K), pre_t = rounded<T>(pre);
      std::vector<double> want(junk.d.size());
      cpu::matmul(dy.d.data(), b.d.data(), want.data(), M, N, K, false, tb);
      cpu::gelu_backward(pre_t.d.data(), want.data(), want.data(), want.size());
      Dev<T> ddy(dy.t), dpre_t(pre_t.t), dgrad(junk.t);
      before = gpu::detail::fused_epilogues();
      gpu::matmul_dgelu(ddy.get(), db.get(), dpre_t.get(), dgrad.get(), M, N, K, false, tb, stream());
      check_close(dgrad.host(), want, tol<T>(), "matmul_dgelu" + what);
      if (fuses) report_fusion(before, "matmul_dgelu" + what);
      else CHECK(gpu::detail::fused_epilogues() == before);
    }
  }
}

TEMPLATE_TEST_CASE("matmul: batches by strides, a shared operand (stride 0), odd alignment, K = 0",
                   "[cuda][matmul]", LOOM_TYPES) {
  using T = TestType;
  Rng rng(2);
  const int M = 19, N = 24, K = 33, batch = 3;
  // Strides with 5 spare elements: every batch after the first starts off the 16-byte alignment of the first.
  const std::ptrdiff_t sa = std::ptrdiff_t(M) * K + 5, sc = std::ptrdiff_t(M) * N + 5;
  for (const bool tb : {false, true}) {
    const auto a = rng.values<T>(std::size_t(sa) * batch);
    const auto b = rng.values<T>(std::size_t(K) * N);  // one B for every batch: stride 0
    const auto c = rng.values<T>(std::size_t(sc) * batch);
    std::vector<double> want = c.d;
    cpu::matmul(a.d.data(), b.d.data(), want.data(), M, N, K, false, tb, 1.0f, 1.0f, batch, sa, 0, sc);
    Dev<T> da(a.t), db(b.t), dc(c.t);
    gpu::matmul(da.get(), db.get(), dc.get(), M, N, K, false, tb, 1.0f, 1.0f, batch, sa, 0, sc, stream());
    check_close(dc.host(), want, tol<T>(), "batched matmul, tb=" + std::to_string(tb));
  }
  // K = 0: C = beta C.
  const auto c = rng.values<T>(std::size_t(M) * N);
  Dev<T> dc(c.t);
  gpu::matmul(dc.get(), dc.get(), dc.get(), M, N, 0, false, false, 1.0f, 0.5f, stream());
  std::vector<double> want = c.d;
  for (auto& x : want) x *= 0.5;
  check_close(dc.host(), want, tol<T>(), "matmul with K = 0");
}

TEMPLATE_TEST_CASE("matmul_group matches the CPU: a mixture of experts' products, rows and inner sizes of their own, "
                   "equal sizes sharing a group, empty products, K = 0, accumulation",
                   "[cuda][matmul]", LOOM_TYPES) {
  using T = TestType;
  using Product = loom::kernels::Product<T>;
  Rng rng(24);
  // Five experts' rows in one buffer (one expert without rows, two with 64 each: consecutive equal sizes share a
  // group of cuBLAS's call), d = 40 features in, n = 48 out.
  const int rows[] = {37, 0, 64, 64, 5}, d = 40, n = 48, total = 170;
  for (const bool tb : {false, true}) {
    for (const float beta : {0.0f, 1.0f}) {
      const std::string what = std::string("tb=") + (tb ? "1" : "0") + " beta=" + std::to_string(beta);
      // The layer: out_e (rows x n) = x_e (rows x d) op(w_e).
      const auto x = rng.values<T>(std::size_t(total) * d), w = rng.values<T>(std::size_t(5) * d * n);
      const auto out = rng.values<T>(std::size_t(total) * n);
      // Its weights' gradient: dw_e (d x n) += x_e^T dy_e, an inner size of each expert's rows (zero for one).
      const auto dy = rng.values<T>(std::size_t(total) * n), dw = rng.values<T>(std::size_t(5) * d * n);
      // And a product with no inner size, which scales its C by beta.
      const auto lone = rng.values<T>(std::size_t(6) * 7);
      std::vector<double> want_out = out.d, want_dw = dw.d, want_lone = lone.d;
      Dev<T> dx(x.t), dw_(w.t), dout(out.t), ddy(dy.t), ddw(dw.t), dlone(lone.t);
      std::vector<Product> layer, grads;
      for (int e = 0, at = 0; e < 5; at += rows[e], ++e) {
        const std::size_t xa = std::size_t(at) * d, wa = std::size_t(e) * d * n, oa = std::size_t(at) * n;
        cpu::matmul(x.d.data() + xa, w.d.data() + wa, want_out.data() + oa, rows[e], n, d, false, tb, 1.0f, beta);
        cpu::matmul(x.d.data() + xa, dy.d.data() + oa, want_dw.data() + wa, d, n, rows[e], true, false, 1.0f, 1.0f);
        layer.push_back({dx.get() + xa, dw_.get() + wa, dout.get() + oa, rows[e], n, d});
        grads.push_back({dx.get() + xa, ddy.get() + oa, ddw.get() + wa, d, n, rows[e]});
      }
      layer.push_back({nullptr, nullptr, dlone.get(), 6, 7, 0});
      for (auto& v : want_lone) v *= beta;
      long before = gpu::detail::grouped_products();
      gpu::matmul_group(layer.data(), layer.size(), false, tb, 1.0f, beta, stream());
      CHECK(gpu::detail::grouped_products() == before + 1);
      check_close(dout.host(), want_out, tol<T>(), "matmul_group, a layer's products, " + what);
      check_close(dlone.host(), want_lone, tol<T>(), "matmul_group, a product with K = 0, " + what);
      before = gpu::detail::grouped_products();
      gpu::matmul_group(grads.data(), grads.size(), true, false, 1.0f, 1.0f, stream());
      CHECK(gpu::detail::grouped_products() == before + 1);
      check_close(ddw.host(), want_dw, tol<T>(), "matmul_group, the weights' gradients, " + what);
    }
  }
  // Rows of 13 elements (26 bytes for bf16 and fp16, off the 16 bytes the grouped kernels read): the group goes
  // product by product for 16-bit types, grouped for the others, with the same values.
  {
    const int m0 = 9, m1 = 11, k = 13, nn = 13;
    const auto x = rng.values<T>(std::size_t(m0 + m1) * k), w = rng.values<T>(std::size_t(2) * k * nn);
    std::vector<double> want(std::size_t(m0 + m1) * nn);
    cpu::matmul(x.d.data(), w.d.data(), want.data(), m0, nn, k, false, false);
    cpu::matmul(x.d.data() + std::size_t(m0) * k, w.d.data() + std::size_t(k) * nn, want.data() + std::size_t(m0) * nn,
                m1, nn, k, false, false);
    Dev<T> dx(x.t), dw(w.t), dy(want.size());
    const Product odd[] = {{dx.get(), dw.get(), dy.get(), m0, nn, k},
                           {dx.get() + std::size_t(m0) * k, dw.get() + std::size_t(k) * nn,
                            dy.get() + std::size_t(m0) * nn, m1, nn, k}};
    const long before = gpu::detail::grouped_products();
    gpu::matmul_group(odd, 2, false, false, 1.0f, 0.0f, stream());
    CHECK(gpu::detail::grouped_products() == before + (sizeof(T) == 2 ? 0 : 1));
    check_close(dy.host(), want, tol<T>(), "matmul_group on rows of 13 elements");
  }
  // A group with one product left to compute runs as matmul; negative sizes are refused by name.
  const auto a = rng.values<T>(12), b = rng.values<T>(12);
  std::vector<double> want(9);
  cpu::matmul(a.d.data(), b.d.data(), want.data(), 3, 3, 4, false, false);
  Dev<T> da(a.t), db(b.t), dc(std::size_t(9));
  const Product one[] = {{da.get(), db.get(), dc.get(), 3, 3, 4}, {da.get(), db.get(), dc.get(), 0, 3, 4}};
  const long before = gpu::detail::grouped_products();
  gpu::matmul_group(one, 2, false, false, 1.0f, 0.0f, stream());
  CHECK(gpu::detail::grouped_products() == before);
  check_close(dc.host(), want, tol<T>(), "matmul_group of one product");
  const Product negative{da.get(), db.get(), dc.get(), 3, -3, 4};
  check_error<loom::Error>([&] { gpu::matmul_group(&negative, 1, false, false, 1.0f, 0.0f, stream()); },
                           "matmul_group: product 0 has a negative size (m=3, n=-3, k=4)");
}

// --- element-wise ------------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("bias, sums and GELU match the CPU", "[cuda][elementwise]", LOOM_TYPES) {
  using T = TestType;
  Rng rng(3);
  for (const int C : {64, 77}) {  // packs of 16 bytes, and one element at a time
    const int R = 33;
    const auto x = rng.values<T>(std::size_t(R) * C), bias = rng.values<T>(C);
    std::vector<double> want(x.d.size());
    cpu::bias_add(x.d.data(), bias.d.data(), want.data(), R, C);
    Dev<T> dx(x.t), db(bias.t);
    gpu::bias_add(dx.get(), db.get(), dx.get(), R, C, stream());  // in place
    check_close(dx.host(), want, tol<T>(), "bias_add C=" + std::to_string(C));
  }
  for (const int R : {5, 3000}) {  // one chunk of rows, and partial sums over several
    const int C = 77;
    const auto dout = rng.values<T>(std::size_t(R) * C), dbias = rng.values<T>(C);
    std::vector<double> want = dbias.d;
    cpu::bias_backward(dout.d.data(), want.data(), R, C);
    Dev<T> dd(dout.t), db(dbias.t);
    gpu::bias_backward(dd.get(), db.get(), R, C, stream());
    check_close(db.host(), want, tol<T>(), "bias_backward R=" + std::to_string(R));
  }
  for (const std::size_t n : {std::size_t{1}, std::size_t{10007}}) {
    const auto a = rng.values<T>(n), b = rng.values<T>(n);
    std::vector<double> sum(n), acc = b.d;
    cpu::add(a.d.data(), b.d.data(), sum.data(), n);
    cpu::accumulate(a.d.data(), acc.data(), n);
    Dev<T> da(a.t), db(b.t), ds(n);
    gpu::add(da.get(), db.get(), ds.get(), n, stream());
    check_close(ds.host(), sum, tol<T>(), "add");
    gpu::accumulate(da.get(), db.get(), n, stream());
    check_close(db.host(), acc, tol<T>(), "accumulate");

    const auto x = rng.values<T>(n, -4.0, 4.0), g = rng.values<T>(n);
    std::vector<double> y(n), dx(n);
    cpu::gelu_forward(x.d.data(), y.data(), n);
    cpu::gelu_backward(x.d.data(), g.d.data(), dx.data(), n);
    Dev<T> dxv(x.t), dg(g.t), dy(n), ddx(n);
    gpu::gelu_forward(dxv.get(), dy.get(), n, stream());
    gpu::gelu_backward(dxv.get(), dg.get(), ddx.get(), n, stream());
    check_close(dy.host(), y, tol<T>(), "gelu_forward");
    check_close(ddx.host(), dx, tol<T>(), "gelu_backward");
  }
  // An offset pointer takes the one-element path.
  const std::size_t n = 1001;
  const auto a = rng.values<T>(n + 1), b = rng.values<T>(n + 1);
  std::vector<double> sum(n);
  cpu::add(a.d.data() + 1, b.d.data() + 1, sum.data(), n);
  Dev<T> da(a.t), db(b.t), ds(n);
  gpu::add(da.get() + 1, db.get() + 1, ds.get(), n, stream());
  check_close(ds.host(), sum, tol<T>(), "add, unaligned");
}

// --- layer norm --------------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("layer norm forward and backward match the CPU", "[cuda][layernorm]", LOOM_TYPES) {
  using T = TestType;
  using A = gpu::acc_t<T>;
  Rng rng(4);
  struct Shape {
    int R, C;
  };
  // Every block size, and rows of one warp each (whole 16-byte packs, up to 1024 columns: 64, 48, 768, 1024).
  for (const Shape sh : {Shape{7, 64}, Shape{33, 769}, Shape{5, 5000}, Shape{300, 48}, Shape{9, 768}, Shape{6, 1024}}) {
    const std::size_t n = std::size_t(sh.R) * sh.C;
    const auto x = rng.values<T>(n, -2.0, 3.0), w = rng.values<T>(sh.C, 0.5, 1.5), b = rng.values<T>(sh.C);
    std::vector<double> out(n), mean(sh.R), rstd(sh.R);
    cpu::layernorm_forward(x.d.data(), w.d.data(), b.d.data(), out.data(), mean.data(), rstd.data(), sh.R, sh.C);
    Dev<T> dx(x.t), dw(w.t), db(b.t), dout(n);
    Dev<A> dmean(sh.R), drstd(sh.R);
    gpu::layernorm_forward(dx.get(), dw.get(), db.get(), dout.get(), dmean.get(), drstd.get(), sh.R, sh.C, 1e-5,
                           stream());
    const std::string what = " R=" + std::to_string(sh.R) + " C=" + std::to_string(sh.C);
    check_close(dout.host(), out, tol<T>(), "layernorm_forward out" + what);
    check_close(dmean.host(), mean, tol_acc<T>(), "layernorm_forward mean" + what);
    check_close(drstd.host(), rstd, tol_acc<T>(), "layernorm_forward rstd" + what);

    // Backward from the reference statistics as the device type holds them.
    const auto m = rounded<A>(mean), r = rounded<A>(rstd);
    const auto g = rng.values<T>(n), dw0 = rng.values<T>(sh.C), db0 = rng.values<T>(sh.C);
    std::vector<double> dxr(n), dwr = dw0.d, dbr = db0.d;
    cpu::layernorm_backward_input(g.d.data(), x.d.data(), w.d.data(), m.d.data(), r.d.data(), dxr.data(), sh.R, sh.C);
    cpu::layernorm_backward_weight(g.d.data(), x.d.data(), m.d.data(), r.d.data(), dwr.data(), dbr.data(), sh.R,
                                   sh.C);
    Dev<T> dg(g.t), ddx(n), ddw(dw0.t), ddb(db0.t);
    Dev<A> dm(m.t), dr(r.t);
    gpu::layernorm_backward_input(dg.get(), dx.get(), dw.get(), dm.get(), dr.get(), ddx.get(), sh.R, sh.C, stream());
    gpu::layernorm_backward_weight(dg.get(), dx.get(), dm.get(), dr.get(), ddw.get(), ddb.get(), sh.R, sh.C,
                                   stream());
    check_close(ddx.host(), dxr, tol<T>(), "layernorm_backward_input" + what);
    check_residual(n, ddx, [&](T* out, const T* res) {
      gpu::layernorm_backward_input(dg.get(), dx.get(), dw.get(), dm.get(), dr.get(), out, sh.R, sh.C, stream(), res);
    }, "layernorm_backward_input" + what);
    check_close(ddw.host(), dwr, tol<T>(), "layernorm_backward_weight dw" + what);
    check_close(ddb.host(), dbr, tol<T>(), "layernorm_backward_weight db" + what);
  }
}

// --- Llama's parts: RMS norm, rotary positions, SwiGLU ----------------------------------------------------------

TEMPLATE_TEST_CASE("RMS norm forward and backward match the CPU", "[cuda][rmsnorm]", LOOM_TYPES) {
  using T = TestType;
  using A = gpu::acc_t<T>;
  Rng rng(14);
  struct Shape {
    int R, C;
  };
  for (const Shape sh : {Shape{7, 64}, Shape{33, 769}, Shape{5, 5000}}) {  // every block size
    const std::size_t n = std::size_t(sh.R) * sh.C;
    const auto x = rng.values<T>(n, -2.0, 3.0), w = rng.values<T>(sh.C, 0.5, 1.5);
    std::vector<double> out(n), rstd(sh.R);
    cpu::rmsnorm_forward(x.d.data(), w.d.data(), out.data(), rstd.data(), sh.R, sh.C, 1e-6);
    Dev<T> dx(x.t), dw(w.t), dout(n);
    Dev<A> drstd(sh.R);
    gpu::rmsnorm_forward(dx.get(), dw.get(), dout.get(), drstd.get(), sh.R, sh.C, 1e-6, stream());
    const std::string what = " R=" + std::to_string(sh.R) + " C=" + std::to_string(sh.C);
    check_close(dout.host(), out, tol<T>(), "rmsnorm_forward out" + what);
    check_close(drstd.host(), rstd, tol_acc<T>(), "rmsnorm_forward rstd" + what);
    const auto r = rounded<A>(rstd);
    const auto g = rng.values<T>(n), dw0 = rng.values<T>(sh.C);
    std::vector<double> dxr(n), dwr = dw0.d;
    cpu::rmsnorm_backward_input(g.d.data(), x.d.data(), w.d.data(), r.d.data(), dxr.data(), sh.R, sh.C);
    cpu::rmsnorm_backward_weight(g.d.data(), x.d.data(), r.d.data(), dwr.data(), sh.R, sh.C);
    Dev<T> dg(g.t), ddx(n), ddw(dw0.t);
    Dev<A> dr(r.t);
    gpu::rmsnorm_backward_input(dg.get(), dx.get(), dw.get(), dr.get(), ddx.get(), sh.R, sh.C, stream());
    gpu::rmsnorm_backward_weight(dg.get(), dx.get(), dr.get(), ddw.get(), sh.R, sh.C, stream());
    check_close(ddx.host(), dxr, tol<T>(), "rmsnorm_backward_input" + what);
    check_residual(n, ddx, [&](T* out, const T* res) {
      gpu::rmsnorm_backward_input(dg.get(), dx.get(), dw.get(), dr.get(), out, sh.R, sh.C, stream(), res);
    }, "rmsnorm_backward_input" + what);
    check_close(ddw.host(), dwr, tol<T>(), "rmsnorm_backward_weight" + what);
  }
}

TEMPLATE_TEST_CASE("rotary positions and SwiGLU match the CPU", "[cuda][rope][swiglu]", LOOM_TYPES) {
  using T = TestType;
  using A = gpu::acc_t<T>;
  Rng rng(15);
  const int n = 37, heads = 3, hd = 16, ld = heads * hd + 8, t0 = 5, positions = n + t0;
  const auto cos = rng.values<A>(std::size_t(positions) * hd / 2), sin = rng.values<A>(cos.d.size());
  for (const bool inverse : {false, true}) {
    const auto x = rng.values<T>(std::size_t(n) * ld);
    auto ref = x.d;
    cpu::rope_rotate(ref.data(), cos.d.data(), sin.d.data(), n, ld, heads, hd, t0, inverse);
    Dev<T> dx(x.t);
    Dev<A> dc(cos.t), ds(sin.t);
    gpu::rope_rotate(dx.get(), dc.get(), ds.get(), n, ld, heads, hd, t0, inverse, stream());
    check_close(dx.host(), ref, tol<T>(), inverse ? "rope_rotate inverse" : "rope_rotate");
  }
  for (const auto [R, F] : {std::pair{29, 75}, std::pair{9, 64}}) {  // one by one, and 16 bytes at a time
    const auto h = rng.values<T>(std::size_t(R) * 2 * F, -3.0, 3.0), dy = rng.values<T>(std::size_t(R) * F);
    std::vector<double> out(std::size_t(R) * F), dh(std::size_t(R) * 2 * F);
    cpu::swiglu_forward(h.d.data(), out.data(), R, F);
    cpu::swiglu_backward(h.d.data(), dy.d.data(), dh.data(), R, F);
    Dev<T> dev_h(h.t), dev_dy(dy.t), dev_out(out.size()), dev_dh(dh.size());
    gpu::swiglu_forward(dev_h.get(), dev_out.get(), R, F, stream());
    gpu::swiglu_backward(dev_h.get(), dev_dy.get(), dev_dh.get(), R, F, stream());
    check_close(dev_out.host(), out, tol<T>(), "swiglu_forward F=" + std::to_string(F));
    check_close(dev_dh.host(), dh, tol<T>(), "swiglu_backward F=" + std::to_string(F));
  }
}

// --- cross-entropy -----------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("cross-entropy matches the CPU, whole and over two vocabulary slices", "[cuda][cross_entropy]",
                   LOOM_TYPES) {
  using T = TestType;
  using A = gpu::acc_t<T>;
  Rng rng(5);
  const int R = 37, V = 5003, split = 2500;
  const auto logits = rng.values<T>(std::size_t(R) * V, -5.0, 5.0);
  const auto targets = rng.ints(R, 0, V - 1);
  const Dev<std::int32_t> dtargets(targets);

  // The whole vocabulary in one call.
  std::vector<double> losses(R), mx(R), se(R);
  cpu::cross_entropy_forward(logits.d.data(), targets.data(), losses.data(), mx.data(), se.data(), R, V);
  Dev<T> dlogits(logits.t), dlosses(R);
  Dev<A> dmx(R), dse(R);
  gpu::cross_entropy_forward(dlogits.get(), dtargets.get(), dlosses.get(), dmx.get(), dse.get(), R, V, stream());
  check_close(dlosses.host(), losses, tol<T>(), "cross_entropy_forward losses");
  check_close(dmx.host(), mx, tol_acc<T>(), "cross_entropy_forward max");
  check_close(dse.host(), se, tol_acc<T>(), "cross_entropy_forward sumexp");

  // Two slices [0, split) and [split, V): each function against the CPU on the same inputs, and the combination
  // (as the vocabulary-parallel layer does it across ranks) against the whole. The slices' rows lie further apart
  // than their widths, the gaps holding 99: the first's on whole 128-byte lines (16-byte loads), the second's not.
  const int widths[2] = {split, V - split}, starts[2] = {0, split};
  const int pitch[2] = {(split + 63) / 64 * 64, V - split + 13};
  std::vector<Values<T>> slices;
  std::vector<std::vector<double>> smax(2, std::vector<double>(R)), ssum(2, std::vector<double>(R)),
      stgt(2, std::vector<double>(R));
  std::vector<Dev<A>> dsmax, dssum, dstgt;
  std::vector<Dev<T>> dslices;
  for (int s = 0; s < 2; ++s) {
    std::vector<double> part(std::size_t(R) * pitch[s], 99.0);
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < widths[s]; ++v)
        part[std::size_t(r) * pitch[s] + v] = logits.d[std::size_t(r) * V + starts[s] + v];
    slices.push_back(rounded<T>(part));
    const auto& sl = slices.back();
    cpu::ce_partials(sl.d.data(), smax[s].data(), ssum[s].data(), R, widths[s], pitch[s]);
    cpu::ce_target_logit(sl.d.data(), targets.data(), stgt[s].data(), R, widths[s], starts[s], pitch[s]);
    dslices.emplace_back(sl.t);
    dsmax.emplace_back(R);
    dssum.emplace_back(R);
    dstgt.emplace_back(R);
    gpu::ce_partials(dslices[s].get(), dsmax[s].get(), dssum[s].get(), R, widths[s], pitch[s], stream());
    gpu::ce_target_logit(dslices[s].get(), dtargets.get(), dstgt[s].get(), R, widths[s], starts[s], pitch[s],
                         stream());
    check_close(dsmax[s].host(), smax[s], tol_acc<T>(), "ce_partials max, slice " + std::to_string(s));
    check_close(dssum[s].host(), ssum[s], tol_acc<T>(), "ce_partials sumexp, slice " + std::to_string(s));
    check_close(dstgt[s].host(), stgt[s], tol_acc<T>(), "ce_target_logit, slice " + std::to_string(s));
  }
  // The combination: global max, rescaled sums, summed target logits (from the reference partials, as A).
  std::vector<double> gmax(R), gsum(R, 0.0), gtgt(R);
  for (int r = 0; r < R; ++r) {
    gmax[r] = std::max(smax[0][r], smax[1][r]);
    gtgt[r] = stgt[0][r] + stgt[1][r];
  }
  const auto gmax_a = rounded<A>(gmax);
  Dev<A> dgmax(gmax_a.t);
  for (int s = 0; s < 2; ++s) {
    const auto lm = rounded<A>(smax[s]), ls = rounded<A>(ssum[s]);
    std::vector<double> want = ls.d;
    cpu::ce_rescale<double>(lm.d.data(), gmax_a.d.data(), want.data(), R);
    Dev<A> dlm(lm.t), dls(ls.t);
    gpu::ce_rescale<T>(dlm.get(), dgmax.get(), dls.get(), R, stream());
    check_close(dls.host(), want, tol_acc<T>(), "ce_rescale, slice " + std::to_string(s));
    for (int r = 0; r < R; ++r) gsum[r] += want[r];
  }
  const auto gsum_a = rounded<A>(gsum), gtgt_a = rounded<A>(gtgt);
  std::vector<double> combined(R);
  cpu::ce_losses(gmax_a.d.data(), gsum_a.d.data(), gtgt_a.d.data(), combined.data(), R);
  Dev<A> dgsum(gsum_a.t), dgtgt(gtgt_a.t);
  Dev<T> dcombined(R);
  gpu::ce_losses(dgmax.get(), dgsum.get(), dgtgt.get(), dcombined.get(), R, stream());
  check_close(dcombined.host(), combined, tol<T>(), "ce_losses");
  check_close(dcombined.host(), losses, tol<T>(), "ce_losses over two slices against the whole");

  // Backward on each slice with the global partials, written over the logits (dlogits == logits); the gaps stay.
  const auto dloss = rng.values<T>(R);
  const Dev<T> ddloss(dloss.t);
  for (int s = 0; s < 2; ++s) {
    std::vector<double> want = slices[s].d;
    cpu::ce_backward(slices[s].d.data(), targets.data(), gmax_a.d.data(), gsum_a.d.data(), dloss.d.data(),
                     want.data(), R, widths[s], starts[s], pitch[s]);
    gpu::ce_backward(dslices[s].get(), dtargets.get(), dgmax.get(), dgsum.get(), ddloss.get(), dslices[s].get(), R,
                     widths[s], starts[s], pitch[s], stream());
    check_close(dslices[s].host(), want, tol<T>(), "ce_backward in place, slice " + std::to_string(s));
  }

  // A NaN logit makes its row's loss NaN, as on the host: one NaN in row 3, and row 5 NaN throughout (every thread's
  // share of it NaN alone). A slice whose sum is NaN keeps it through the rescale.
  std::vector<double> bad = logits.d;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  bad[std::size_t(3) * V + 1234] = nan;
  for (int v = 0; v < V; ++v) bad[std::size_t(5) * V + v] = nan;
  const auto b = rounded<T>(bad);
  Dev<T> dbad(b.t), dbad_losses(R);
  Dev<A> dbad_max(R), dbad_sum(R);
  gpu::cross_entropy_forward(dbad.get(), dtargets.get(), dbad_losses.get(), dbad_max.get(), dbad_sum.get(), R, V,
                             stream());
  gpu::ce_partials(dbad.get(), dbad_max.get(), dbad_sum.get(), R, V, V, stream());
  const auto bad_losses = doubles(dbad_losses.host()), bad_sums = doubles(dbad_sum.host());
  for (const int r : {3, 5}) {
    INFO("row " << r);
    CHECK(std::isnan(bad_losses[std::size_t(r)]));
    CHECK(std::isnan(bad_sums[std::size_t(r)]));
  }
  CHECK(bad_losses[4] == Approx(losses[4]).epsilon(tol<T>()));
  std::vector<A> nan_max{A(-INFINITY), A(2)}, nan_sum{A(NAN), A(0)};
  const std::vector<A> top{A(1), A(2)};
  Dev<A> dnan_max(nan_max), dnan_sum(nan_sum), dtop(top);
  gpu::ce_rescale<T>(dnan_max.get(), dtop.get(), dnan_sum.get(), 2, stream());
  const auto rescaled = dnan_sum.host();
  CHECK(std::isnan(rescaled[0]));
  CHECK(rescaled[1] == 0);
}

TEMPLATE_TEST_CASE("ce_loss_grad: the loss and, over the logits, its gradient in one kernel, as forward and backward "
                   "with a loss gradient of one",
                   "[cuda][cross_entropy]", LOOM_TYPES) {
  using T = TestType;
  using A = gpu::acc_t<T>;
  Rng rng(6);
  const int R = 23, V = 5003;
  auto targets = rng.ints(R, 0, V - 1);
  targets[4] = -1;  // a row left out of the loss: no target to subtract
  const Dev<std::int32_t> dtargets(targets);
  for (const int pitch : {(V + 63) / 64 * 64, V + 3}) {  // rows on 128-byte lines (16-byte packs), and off them
    std::vector<double> rows(std::size_t(R) * pitch, 99.0);
    const auto logits = rng.values<T>(std::size_t(R) * V, -5.0, 5.0);
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) rows[std::size_t(r) * pitch + v] = logits.d[std::size_t(r) * V + v];
    const auto in = rounded<T>(rows);
    std::vector<double> losses(R), mx(R), se(R), want = in.d;
    const std::vector<double> ones(R, 1.0);
    cpu::cross_entropy_forward(logits.d.data(), targets.data(), losses.data(), mx.data(), se.data(), R, V);
    cpu::ce_backward(in.d.data(), targets.data(), mx.data(), se.data(), ones.data(), want.data(), R, V, 0, pitch);
    Dev<T> dl(in.t), dlosses(R);
    Dev<A> dmx(R), dse(R);
    gpu::ce_loss_grad(dl.get(), dtargets.get(), dmx.get(), dse.get(), dlosses.get(), R, V, pitch, stream());
    const std::string what = " pitch " + std::to_string(pitch);
    check_close(dlosses.host(), losses, tol<T>(), "ce_loss_grad losses" + what);
    check_close(dmx.host(), mx, tol_acc<T>(), "ce_loss_grad max" + what);
    check_close(dse.host(), se, tol_acc<T>(), "ce_loss_grad sumexp" + what);
    // The gradients on their own scale (the gaps' 99 would widen the tolerance a hundredfold), the gaps exactly.
    const auto got = dl.host();
    std::vector<T> got_rows;
    std::vector<double> want_rows;
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < pitch; ++v) {
        const std::size_t i = std::size_t(r) * pitch + v;
        if (v < V) got_rows.push_back(got[i]), want_rows.push_back(want[i]);
        else CHECK(to_double(got[i]) == 99.0);
      }
    check_close(got_rows, want_rows, tol<T>(), "ce_loss_grad gradient" + what);
  }
}

// --- embeddings --------------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("embeddings and positions match the CPU", "[cuda][embedding]", LOOM_TYPES) {
  using T = TestType;
  Rng rng(6);
  const int v0 = 10, V_local = 40;
  for (const int C : {24, 37}) {
    const int n = 300;
    // Ids below, inside and above the slice; many repeats inside, so the scatter-add adds into shared rows.
    const auto ids = rng.ints(n, v0 - 3, v0 + V_local + 2);
    const auto table = rng.values<T>(std::size_t(V_local) * C);
    std::vector<double> out(std::size_t(n) * C);
    cpu::embedding_forward(ids.data(), table.d.data(), out.data(), n, C, v0, V_local);
    const Dev<std::int32_t> dids(ids);
    Dev<T> dtable(table.t), dout(std::size_t(n) * C);
    gpu::embedding_forward(dids.get(), dtable.get(), dout.get(), n, C, v0, V_local, stream());
    check_close(dout.host(), out, tol<T>(), "embedding_forward C=" + std::to_string(C));

    const auto g = rng.values<T>(std::size_t(n) * C, -0.1, 0.1);
    std::vector<double> dtab = table.d;
    cpu::embedding_backward(ids.data(), g.d.data(), dtab.data(), n, C, v0, V_local);
    Dev<T> dg(g.t);
    gpu::embedding_backward(dids.get(), dg.get(), dtable.get(), n, C, v0, V_local, stream());
    // Each id's rows summed in acc_t and added once: one rounding on the table's scale.
    check_close(dtable.host(), dtab, tol<T>(), "embedding_backward C=" + std::to_string(C));

    const int B = 3, T_ = 11, t0 = 5;
    const auto wpe = rng.values<T>(std::size_t(t0 + T_) * C), x = rng.values<T>(std::size_t(B) * T_ * C);
    std::vector<double> y = x.d;
    cpu::add_positions(wpe.d.data(), y.data(), B, T_, C, t0);
    Dev<T> dwpe(wpe.t), dy(x.t);
    gpu::add_positions(dwpe.get(), dy.get(), B, T_, C, t0, stream());
    check_close(dy.host(), y, tol<T>(), "add_positions C=" + std::to_string(C));

    std::vector<double> dw = wpe.d;
    cpu::positions_backward(x.d.data(), dw.data(), B, T_, C, t0);
    Dev<T> dx(x.t);
    gpu::positions_backward(dx.get(), dwpe.get(), B, T_, C, t0, stream());
    check_close(dwpe.host(), dw, tol<T>(), "positions_backward C=" + std::to_string(C));
  }
}

TEMPLATE_TEST_CASE("the embedding's backward gives the same bits every run, a few ids repeated thousands of times",
                   "[cuda][embedding]", LOOM_TYPES) {
  using T = TestType;
  Rng rng(7);
  const int n = 6000, C = 768, v0 = 0, V = 50;
  auto ids = rng.ints(n, 0, 3);  // four ids, about 1500 positions each
  ids[17] = 49, ids[4000] = 60;  // one position alone, and one outside the slice
  const auto table = rng.values<T>(std::size_t(V) * C);
  const auto g = rng.values<T>(std::size_t(n) * C, -0.1, 0.1);
  std::vector<double> want = table.d;
  cpu::embedding_backward(ids.data(), g.d.data(), want.data(), n, C, v0, V);
  const Dev<std::int32_t> dids(ids);
  const Dev<T> dg(g.t);
  std::vector<std::vector<T>> runs;
  for (int run = 0; run < 3; ++run) {
    Dev<T> dtable(table.t);
    gpu::embedding_backward(dids.get(), dg.get(), dtable.get(), n, C, v0, V, stream());
    runs.push_back(dtable.host());
  }
  check_close(runs[0], want, tol<T>(), "embedding_backward, 1500 repeats");
  for (int run = 1; run < 3; ++run)
    CHECK(std::memcmp(runs[std::size_t(run)].data(), runs[0].data(), runs[0].size() * sizeof(T)) == 0);
  // Rows no id names keep their values.
  CHECK(std::memcmp(runs[0].data() + std::size_t(10) * C, table.t.data() + std::size_t(10) * C, C * sizeof(T)) == 0);
}

// --- dropout -----------------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("dropout gives the CPU's mask and values bit for bit", "[cuda][dropout]", LOOM_TYPES) {
  using T = TestType;
  using C = cpu_t<T>;
  Rng rng(7);
  for (std::uint64_t i = 0; i < 100000; i += 7)
    REQUIRE(gpu::dropout_uniform(42, i) == cpu::dropout_uniform(42, i));

  const std::size_t n = 10007;
  const std::uint64_t seed = 1234, index0 = 77;
  const auto x = rng.values<T>(n);
  std::vector<C> xc(n);
  std::memcpy(static_cast<void*>(xc.data()), x.t.data(), n * sizeof(T));
  for (const float p : {0.0f, 0.3f, 1.0f}) {
    std::vector<C> want(n), back(n);
    cpu::dropout_forward(xc.data(), want.data(), n, p, seed, index0);
    cpu::dropout_backward(xc.data(), back.data(), n, p, seed, index0);
    Dev<T> dx(x.t), dy(n), dback(n);
    gpu::dropout_forward(dx.get(), dy.get(), n, p, seed, index0, stream());
    gpu::dropout_backward(dx.get(), dback.get(), n, p, seed, index0, stream());
    const auto got = dy.host(), got_back = dback.host();
    std::size_t kept = 0;
    for (std::size_t i = 0; i < n; ++i) kept += to_double(got[i]) != 0.0;
    INFO("p = " << p << ", kept " << kept << " of " << n);
    CHECK(std::memcmp(got.data(), want.data(), n * sizeof(T)) == 0);
    CHECK(std::memcmp(got_back.data(), back.data(), n * sizeof(T)) == 0);
    if (p == 0.3f) CHECK(std::abs(double(kept) / n - 0.7) < 0.03);
  }
  // In place, on a slice that starts elsewhere in the global index space.
  Dev<T> dx(x.t);
  gpu::dropout_forward(dx.get() + 1, dx.get() + 1, n - 1, 0.5f, seed, index0 + 1, stream());
  std::vector<C> want(xc);
  cpu::dropout_forward(xc.data() + 1, want.data() + 1, n - 1, 0.5f, seed, index0 + 1);
  const auto got = dx.host();
  CHECK(std::memcmp(got.data(), want.data(), n * sizeof(T)) == 0);
}

// --- attention ---------------------------------------------------------------------------------------------------

namespace {

struct AttnCase {
  int B, T, Hq, Hkv, D;
  bool fused;           // q, k, v (and dq, dk, dv) in one buffer, rows of (Hq + 2 Hkv) D
  int Tk = -1;          // keys per sequence (-1: T), for a block that every query sees
  bool causal = true;   // false: every query sees every key of the block (ring attention's other ranks' blocks)
  int spare = 8;        // elements past the heads in each row of out and its gradient (1: rows off 16 bytes)
};

template <class T>
void attention_case(const AttnCase& c, Rng& rng) {
  using A = gpu::acc_t<T>;
  loom::kernels::AttentionShape s{c.B, c.T, c.Hq, c.Hkv, c.D, 0, 0, 0, float(1.0 / std::sqrt(double(c.D))),
                                  c.Tk, c.causal};
  const std::size_t rows = std::size_t(c.B) * c.T, key_rows = std::size_t(c.B) * s.keys();
  std::size_t q_at = 0, k_at = 0, v_at = 0, size = 0;
  if (c.fused) {
    s.ldq = s.ldkv = std::ptrdiff_t(c.Hq + 2 * c.Hkv) * c.D;
    k_at = std::size_t(c.Hq) * c.D;
    v_at = std::size_t(c.Hq + c.Hkv) * c.D;
    size = rows * s.ldq;
  } else {
    s.ldq = std::ptrdiff_t(c.Hq) * c.D;
    s.ldkv = std::ptrdiff_t(c.Hkv) * c.D;
    k_at = rows * s.ldq;
    v_at = k_at + key_rows * s.ldkv;
    size = v_at + key_rows * s.ldkv;
  }
  s.ldo = std::ptrdiff_t(c.Hq) * c.D + c.spare;  // spare elements per row: they must stay as they are
  const std::size_t out_size = rows * s.ldo, lse_size = std::size_t(c.B) * c.Hq * c.T;
  const std::string what = " B=" + std::to_string(c.B) + " T=" + std::to_string(c.T) + " Hq=" + std::to_string(c.Hq) +
                           " Hkv=" + std::to_string(c.Hkv) + " D=" + std::to_string(c.D) +
                           " Tk=" + std::to_string(s.keys()) + (c.causal ? " causal" : " full") +
                           (c.fused ? " fused" : "");

  const auto in = rng.values<T>(size, -2.0, 2.0);
  const auto out0 = rng.values<T>(out_size);
  std::vector<double> out = out0.d, lse(lse_size);
  cpu::attention_forward(in.d.data() + q_at, in.d.data() + k_at, in.d.data() + v_at, out.data(), lse.data(), s);
  Dev<T> din(in.t), dout(out0.t);
  Dev<A> dlse(lse_size);
  gpu::attention_forward(din.get() + q_at, din.get() + k_at, din.get() + v_at, dout.get(), dlse.get(), s, stream());
  // At low precision the probabilities go through T before they weight V.
  check_close(dout.host(), out, 2 * tol<T>(), "attention_forward out" + what);
  // lse: float arithmetic on T's values (the rounding of P does not enter it).
  check_close(dlse.host(), lse, std::is_same_v<A, T> ? 2 * tol<T>() : 1e-4, "attention_forward lse" + what);

  // Backward, both sides from the reference forward as T (out) and acc_t<T> (lse) hold it.
  const auto o = rounded<T>(out);
  const auto l = rounded<A>(lse);
  const auto g = rng.values<T>(out_size);
  const auto grad0 = rng.values<T>(size);  // what the gradients overwrite
  std::vector<double> grad = grad0.d;
  cpu::attention_backward(g.d.data(), in.d.data() + q_at, in.d.data() + k_at, in.d.data() + v_at, o.d.data(),
                          l.d.data(), grad.data() + q_at, grad.data() + k_at, grad.data() + v_at, s);
  Dev<T> dg(g.t), dgrad(grad0.t), dobuf(o.t);
  Dev<A> dl(l.t);
  gpu::attention_backward(dg.get(), din.get() + q_at, din.get() + k_at, din.get() + v_at, dobuf.get(), dl.get(),
                          dgrad.get() + q_at, dgrad.get() + k_at, dgrad.get() + v_at, s, stream());
  // dS goes through T too before it multiplies K and Q: twice the forward's tolerance at low precision.
  check_close(dgrad.host(), grad, 2 * tol<T>(), "attention_backward dq, dk, dv" + what);
}

}  // namespace

TEMPLATE_TEST_CASE("attention forward and backward match the CPU: lengths, heads, GQA/MQA, head sizes, fused qkv, "
                   "blocks of keys of their own count, full or causal",
                   "[cuda][attention]", LOOM_TYPES) {
  using T = TestType;
  Rng rng(8);
  const AttnCase cases[] = {
      {2, 1, 2, 2, 16, false},   {2, 17, 4, 2, 16, false},  {2, 64, 4, 1, 64, false}, {1, 100, 4, 4, 64, true},
      {2, 130, 6, 2, 32, true},  {1, 130, 2, 1, 24, false}, {1, 70, 2, 2, 128, false}, {1, 200, 8, 1, 64, true},
      {3, 33, 3, 1, 48, false},  {1, 65, 2, 2, 40, true},
      // Longer sequences through every tile position of the register-resident kernels (bf16/fp16, D = 64 or 128).
      {2, 300, 4, 2, 64, true},  {1, 197, 4, 1, 128, false},
      // Ring attention's blocks: every query over another rank's keys, fewer, more or as many as the queries.
      {2, 33, 4, 2, 16, false, 17, false}, {1, 64, 2, 1, 64, false, 130, false}, {2, 70, 4, 4, 32, false, 70, false},
      {1, 1, 2, 2, 16, false, 65, false},  {2, 96, 4, 2, 64, false, 32, false},
      {1, 100, 4, 2, 128, false, 150, false},
      // Output rows off 16 bytes: 16-byte loads of out and its gradient are not possible.
      {1, 40, 2, 1, 64, false, -1, true, 1},
  };
  for (const AttnCase& c : cases) attention_case<T>(c, rng);
}

TEST_CASE("attention rejects shapes it cannot run, naming the values", "[cuda][attention]") {
  cpu::AttentionShape s{1, 8, 3, 2, 16, 48, 32, 48, 0.25f};
  float* p = nullptr;
  check_error<loom::Error>([&] { gpu::attention_forward(p, p, p, p, p, s, stream()); },
                           "(B=1 T=8 Hq=3 Hkv=2 D=16)");
  s = {1, 8, 1, 1, 2048, 2048, 2048, 2048, 0.1f};
  double* d = nullptr;
  check_error<loom::Error>([&] { gpu::attention_forward(d, d, d, d, d, s, stream()); }, "D=2048 needs");
}

// --- the parallel layers' row operations ---------------------------------------------------------------------------

TEMPLATE_TEST_CASE("the parallel layers' row operations match the host's: widen, narrow, copy_rows, lse_merge, "
                   "transpose, gather, scatter and combine by index, row dot products",
                   "[cuda][rows]", float, double) {
  using T = TestType;
  using A = loom::acc_t<T>;
  const loom::kernels::Ops<loom::Host> host{};
  loom::kernels::Ops<loom::Cuda> dev;
  dev.stream = stream();
  Rng rng(21);
  const auto vals = [&](std::size_t n) { return cast<T>(rng.uniform(n, -2.0, 2.0)); };
  const auto as_doubles = [](const auto& v) { return doubles(v); };
  // widen, narrow, accumulate_wide
  {
    const std::size_t n = 1000;
    const auto x = vals(n);
    std::vector<A> wide(n), acc = cast<A>(rng.uniform(n));
    std::vector<T> back(n);
    Dev<T> dx(x);
    Dev<A> dwide(n), dacc(acc);
    Dev<T> dback(n);
    host.widen(x.data(), wide.data(), n), dev.widen(dx.get(), dwide.get(), n);
    host.narrow(wide.data(), back.data(), n), dev.narrow(dwide.get(), dback.get(), n);
    host.accumulate_wide(x.data(), acc.data(), n), dev.accumulate_wide(dx.get(), dacc.get(), n);
    check_close(dwide.host(), as_doubles(wide), 0, "widen");
    check_close(dback.host(), as_doubles(back), 0, "narrow");
    check_close(dacc.host(), as_doubles(acc), tol_acc<T>(), "accumulate_wide");
  }
  // copy_rows: 7 rows of 5 from a stride of 9 to one of 6, in T and from acc_t<T>
  {
    const int rows = 7, w = 5;
    const auto src = vals(std::size_t(rows) * 9);
    const auto wsrc = cast<A>(rng.uniform(std::size_t(rows) * 9));
    std::vector<T> dst = vals(std::size_t(rows) * 6), dst2 = dst;
    Dev<T> dsrc(src), ddst(dst), ddst2(dst2);
    Dev<A> dwsrc(wsrc);
    host.copy_rows(src.data(), 9, dst.data(), 6, rows, w), dev.copy_rows(dsrc.get(), 9, ddst.get(), 6, rows, w);
    host.copy_rows(wsrc.data(), 9, dst2.data(), 6, rows, w), dev.copy_rows(dwsrc.get(), 9, ddst2.get(), 6, rows, w);
    check_close(ddst.host(), as_doubles(dst), 0, "copy_rows");
    check_close(ddst2.host(), as_doubles(dst2), 0, "copy_rows from acc_t");
  }
  // lse_merge: B = 2 sequences of c = 3 rows, H = 2 heads of D = 4 (rows of ld = 8)
  {
    const int B = 2, H = 2, c = 3, D = 4;
    const std::size_t on = std::size_t(B) * c * H * D, ln = std::size_t(B) * H * c;
    auto O = cast<A>(rng.uniform(on)), L = cast<A>(rng.uniform(ln, -3, 3));
    const auto Ob = vals(on);
    const auto Lb = cast<A>(rng.uniform(ln, -3, 3));
    Dev<A> dO(O), dL(L), dLb(Lb);
    Dev<T> dOb(Ob);
    host.lse_merge(O.data(), L.data(), Ob.data(), Lb.data(), B, H, c, D, H * D);
    dev.lse_merge(dO.get(), dL.get(), dOb.get(), dLb.get(), B, H, c, D, H * D);
    check_close(dO.host(), as_doubles(O), tol_acc<T>(), "lse_merge out");
    check_close(dL.host(), as_doubles(L), tol_acc<T>(), "lse_merge lse");
  }
  // transpose: 3 batches of 4 x 7 (Ulysses' log-sum-exp between B x H x T and B x T x H), exactly
  {
    const int batches = 3, rows = 4, cols = 7;
    const auto src = cast<A>(rng.uniform(std::size_t(batches) * rows * cols));
    std::vector<A> dst(src.size());
    Dev<A> dsrc(src), ddst(dst.size());
    host.transpose(src.data(), dst.data(), batches, rows, cols);
    dev.transpose(dsrc.get(), ddst.get(), batches, rows, cols);
    check_close(ddst.host(), as_doubles(dst), 0, "transpose");
    CHECK(dst[(std::size_t(2) * cols + 5) * rows + 1] == src[(std::size_t(2) * rows + 1) * cols + 5]);
  }
  // gather (weighted or not), scatter, combine by slots, row dots: 6 tokens of d = 5, 9 sent rows, k = 2
  {
    const int d = 5, k = 2;
    const std::size_t tokens = 6, sent = 9;
    const std::vector<std::int32_t> source{0, 3, 5, 1, 0, 2, 4, 3, 5};
    std::vector<std::int32_t> slots(tokens * k, -1);
    for (std::size_t s2 = 0; s2 < sent; ++s2) {
      std::int32_t* at = slots.data() + std::size_t(source[s2]) * k;
      while (*at >= 0) ++at;
      *at = static_cast<std::int32_t>(s2);
    }
    const std::vector<std::int32_t> into{4, 0, 7, 2, 8, 1, 6, 3, 5};  // a permutation of the sent rows
    const auto x = vals(tokens * d), weights = vals(sent), rows = vals(sent * d);
    std::vector<T> g(sent * d), gw(sent * d), sc(sent * d), y = vals(tokens * d), yu = y;
    std::vector<double> dots(sent);
    Dev<std::int32_t> dsource(source), dslots(slots), dinto(into);
    Dev<T> dx(x), dweights(weights), drows(rows), dg(sent * d), dgw(sent * d), dsc(sent * d), dy(y), dyu(yu);
    Dev<double> ddots(sent);
    host.gather_rows(x.data(), source.data(), static_cast<const T*>(nullptr), g.data(), sent, d);
    dev.gather_rows(dx.get(), dsource.get(), static_cast<const T*>(nullptr), dg.get(), sent, d);
    host.gather_rows(x.data(), source.data(), weights.data(), gw.data(), sent, d);
    dev.gather_rows(dx.get(), dsource.get(), dweights.get(), dgw.get(), sent, d);
    host.scatter_rows(rows.data(), into.data(), sc.data(), sent, d);
    dev.scatter_rows(drows.get(), dinto.get(), dsc.get(), sent, d);
    host.combine_rows(rows.data(), slots.data(), k, weights.data(), y.data(), tokens, d);
    dev.combine_rows(drows.get(), dslots.get(), k, dweights.get(), dy.get(), tokens, d);
    host.combine_rows(rows.data(), slots.data(), k, static_cast<const T*>(nullptr), yu.data(), tokens, d);
    dev.combine_rows(drows.get(), dslots.get(), k, static_cast<const T*>(nullptr), dyu.get(), tokens, d);
    host.row_dots(x.data(), source.data(), rows.data(), dots.data(), sent, d);
    dev.row_dots(dx.get(), dsource.get(), drows.get(), ddots.get(), sent, d);
    check_close(dg.host(), as_doubles(g), 0, "gather_rows");
    check_close(dgw.host(), as_doubles(gw), 0, "gather_rows weighted");
    check_close(dsc.host(), as_doubles(sc), 0, "scatter_rows");
    check_close(dy.host(), as_doubles(y), tol_acc<T>(), "combine_rows weighted");  // the device may fuse y + w x
    check_close(dyu.host(), as_doubles(yu), 0, "combine_rows");
    check_close(ddots.host(), dots, 1e-12, "row_dots");
  }
}

// --- optimizers --------------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("adamw_runs updates every run as adamw_step does, bit for bit: decay or not, starts off the "
                   "packs, runs over several blocks' chunks, an empty one, state apart from the parameters, master "
                   "weights",
                   "[cuda][optim]", LOOM_TYPES) {
  using T = TestType;
  using A = gpu::acc_t<T>;
  using Run = loom::kernels::UpdateRun;
  Rng rng(31);
  // A run within one chunk, one over three (8192 elements each), an empty one, three elements from an odd start
  // (one by one), and a run whose state lies 40 elements further than its parameters (a shard's layout).
  const std::vector<Run> runs = {{0, 0, 768, false},           {768, 768, 16389, true}, {17157, 17157, 0, true},
                                 {17157, 17157, 3, false},     {17160, 17200, 8000, true}};
  const std::size_t n = 25160, state = 25200;
  constexpr bool with_master = !std::is_same_v<T, A>;
  const auto p0 = rng.values<T>(n);
  Dev<T> pa(p0.t), pb(p0.t);
  const std::vector<A> zeros(state, A(0));
  Dev<A> ma(zeros), va(zeros), wa(zeros), mb(zeros), vb(zeros), wb(zeros);
  for (int t = 1; t <= 2; ++t) {  // the first step takes the master weights from the parameters
    const auto g = rng.values<T>(n);
    Dev<T> dg(g.t);
    gpu::adamw_runs(pa.get(), dg.get(), ma.get(), va.get(), with_master ? wa.get() : nullptr, runs.data(), runs.size(),
                    1e-2, 0.9, 0.999, 1e-8, 0.1, t, stream());
    for (const Run& r : runs)
      gpu::adamw_step(pb.get() + r.param, dg.get() + r.param, mb.get() + r.at, vb.get() + r.at, std::size_t(r.n), 1e-2,
                      0.9, 0.999, 1e-8, r.decay ? 0.1 : 0.0, t, with_master ? wb.get() + r.at : nullptr, stream());
  }
  const auto same = [](const auto& a, const auto& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
  };
  CHECK(same(pa.host(), pb.host()));
  CHECK(same(ma.host(), mb.host()));
  CHECK(same(va.host(), vb.host()));
  CHECK(same(wa.host(), wb.host()));
  CHECK_FALSE(same(pa.host(), p0.t));
  const Run negative{0, 0, -1, false};
  check_error<loom::Error>([&] {
    gpu::adamw_runs(pa.get(), pa.get(), ma.get(), va.get(), static_cast<A*>(nullptr), &negative, 1, 1e-2, 0.9, 0.999,
                    1e-8, 0.1, 3, stream());
  }, "adamw_runs: run 0 has a negative place or size (param=0, at=0, n=-1)");
}

TEMPLATE_TEST_CASE("AdamW and SGD steps match the CPU", "[cuda][optim]", LOOM_TYPES) {
  using T = TestType;
  using A = gpu::acc_t<T>;
  Rng rng(9);
  const std::size_t n = 1001;
  // Each step starts both sides from the device's state, so that rounding of bf16 parameters does not compound.
  auto p = rng.values<T>(n);
  auto m = rounded<A>(std::vector<double>(n, 0.0)), v = m;
  Dev<T> dp(p.t);
  Dev<A> dm(m.t), dv(v.t);
  for (int t = 1; t <= 3; ++t) {
    const auto g = rng.values<T>(n);
    std::vector<double> pr = p.d, mr = m.d, vr = v.d;
    cpu::adamw_step(pr.data(), g.d.data(), mr.data(), vr.data(), n, 1e-2, 0.9, 0.999, 1e-8, 0.1, t);
    Dev<T> dg(g.t);
    gpu::adamw_step(dp.get(), dg.get(), dm.get(), dv.get(), n, 1e-2, 0.9, 0.999, 1e-8, 0.1, t, nullptr, stream());
    const auto ph = dp.host();
    const auto mh = dm.host(), vh = dv.host();
    check_close(ph, pr, tol<T>(), "adamw param, step " + std::to_string(t));
    check_close(mh, mr, tol_acc<T>(), "adamw m, step " + std::to_string(t));
    check_close(vh, vr, tol_acc<T>(), "adamw v, step " + std::to_string(t));
    p = rounded<T>(doubles(ph));
    m = rounded<A>(doubles(mh));
    v = rounded<A>(doubles(vh));
  }

  if constexpr (!std::is_same_v<T, A>) {  // fp32 master weights: the update is made on them, unrounded
    const auto p0 = rng.values<T>(n);
    std::vector<double> pr = p0.d, mr(n, 0.0), vr(n, 0.0);
    Dev<T> dp2(p0.t);
    Dev<A> dm2(n), dv2(n), dw(n);
    LOOM_CUDA(cudaMemsetAsync(dm2.get(), 0, n * sizeof(A), stream()));
    LOOM_CUDA(cudaMemsetAsync(dv2.get(), 0, n * sizeof(A), stream()));
    for (int t = 1; t <= 3; ++t) {
      const auto g = rng.values<T>(n);
      cpu::adamw_step(pr.data(), g.d.data(), mr.data(), vr.data(), n, 1e-2, 0.9, 0.999, 1e-8, 0.1, t);
      Dev<T> dg(g.t);
      gpu::adamw_step(dp2.get(), dg.get(), dm2.get(), dv2.get(), n, 1e-2, 0.9, 0.999, 1e-8, 0.1, t, dw.get(),
                      stream());
    }
    check_close(dw.host(), pr, tol_acc<T>(), "adamw master weights after 3 steps");
    check_close(dp2.host(), pr, tol<T>(), "adamw parameters: the master weights rounded");
  }

  for (const double momentum : {0.0, 0.9}) {
    auto q = rng.values<T>(n);
    auto buf = rounded<A>(std::vector<double>(n, 0.0));
    Dev<T> dq(q.t);
    Dev<A> dbuf(buf.t);
    for (int step = 0; step < 3; ++step) {
      const auto g = rng.values<T>(n);
      std::vector<double> qr = q.d, br = buf.d;
      cpu::sgd_step(qr.data(), g.d.data(), br.data(), n, 0.05, momentum, 0.01, step == 0);
      Dev<T> dg(g.t);
      gpu::sgd_step(dq.get(), dg.get(), dbuf.get(), n, 0.05, momentum, 0.01, step == 0, nullptr, stream());
      const auto qh = dq.host();
      const auto bh = dbuf.host();
      const std::string what = " momentum " + std::to_string(momentum) + ", step " + std::to_string(step);
      check_close(qh, qr, tol<T>(), "sgd param" + what);
      check_close(bh, br, tol_acc<T>(), "sgd buffer" + what);
      q = rounded<T>(doubles(qh));
      buf = rounded<A>(doubles(bh));
    }
  }
  // Momentum 0 needs no buffer.
  const auto q = rng.values<T>(n), g = rng.values<T>(n);
  std::vector<double> qr = q.d;
  cpu::sgd_step<double>(qr.data(), g.d.data(), nullptr, n, 0.05, 0.0, 0.0, true);
  Dev<T> dq(q.t), dg(g.t);
  gpu::sgd_step(dq.get(), dg.get(), static_cast<A*>(nullptr), n, 0.05, 0.0, 0.0, true, nullptr, stream());
  check_close(dq.host(), qr, tol<T>(), "sgd without a buffer");
}

TEST_CASE("loom::bf16 and loom::fp16 pointers go to the same kernels", "[cuda][elementwise]") {
  Rng rng(10);
  const std::size_t n = 100;
  const auto a = rng.values<__nv_bfloat16>(n), b = rng.values<__nv_bfloat16>(n);
  Dev<__nv_bfloat16> da(a.t), db(b.t), ds(n);
  gpu::add(reinterpret_cast<const loom::bf16*>(da.get()), reinterpret_cast<const loom::bf16*>(db.get()),
           reinterpret_cast<loom::bf16*>(ds.get()), n, stream());
  std::vector<double> want(n);
  for (std::size_t i = 0; i < n; ++i) want[i] = a.d[i] + b.d[i];
  check_close(ds.host(), want, tol<__nv_bfloat16>(), "add on loom::bf16");
}

TEMPLATE_TEST_CASE("Ops<Cuda> fills, scales and sums device memory, header-only", "[cuda][ops]", float, double,
                   loom::bf16) {
  const loom::kernels::Ops<loom::Cuda> ops{stream()};
  const std::size_t n = 1001;  // not a multiple of a pack
  CudaBuffer<TestType> x(n, stream());
  ops.fill(x.data(), n, static_cast<TestType>(1.5f));
  ops.scale(x.data() + 1, n - 1, 2.0f);
  REQUIRE(ops.sum(x.data(), n) == 1.5 + 3.0 * 1000);
  REQUIRE(ops.sum_squares(x.data(), n) == 2.25 + 9.0 * 1000);
  // Several pieces at once, an empty one among them: each piece's sum as sum_squares gives it, bit for bit.
  const std::int64_t at[] = {0, 1, 500, 7, 300}, len[] = {1, 999, 0, 600, 701};
  double sums[5];
  ops.sums_of_squares(x.data(), at, len, 5, sums);
  for (int i = 0; i < 5; ++i) {
    INFO("piece " << i);
    CHECK(sums[i] == ops.sum_squares(x.data() + at[i], std::size_t(len[i])));
  }
  CHECK(sums[0] == 2.25);
  CHECK(sums[1] == 9.0 * 999);
  CHECK(sums[2] == 0.0);
  std::vector<TestType> h(n);
  ops.to_host(x.data(), h.data(), n);
  REQUIRE(static_cast<double>(h[0]) == 1.5);
  REQUIRE(static_cast<double>(h[n - 1]) == 3.0);
}

TEST_CASE("a profile times each operation of its thread: calls, device time, a product's shape and FLOPs",
          "[cuda][profile]") {
  const loom::kernels::Ops<loom::Cuda> ops{stream()};
  const int M = 256, N = 128, K = 512;
  CudaBuffer<float> a(std::size_t(M) * K, stream()), b(std::size_t(K) * N, stream()), c(std::size_t(M) * N, stream());
  ops.fill(a.data(), a.size(), 1.0f);  // before the profile: not counted
  std::vector<loom::kernels::cuda::Profile::Row> rows;
  {
    loom::kernels::cuda::Profile profile;
    ops.fill(b.data(), b.size(), 0.5f);
    ops.matmul(a.data(), b.data(), c.data(), M, N, K, false, false);
    ops.matmul(a.data(), b.data(), c.data(), M, N, K, false, false);
    ops.matmul(b.data(), a.data(), c.data(), N, M, K, true, true);
    rows = profile.rows();
  }
  ops.fill(c.data(), c.size(), 0.0f);  // after it: not counted either
  auto row = [&](const std::string& op) {
    const auto it = std::find_if(rows.begin(), rows.end(), [&](const auto& r) { return r.op == op; });
    REQUIRE(it != rows.end());
    return *it;
  };
  REQUIRE(rows.size() == 3);
  CHECK(row("fill").calls == 1);
  const auto mm = row("matmul 256x128x512");
  CHECK(mm.calls == 2);
  CHECK(mm.flops == 2 * 2.0 * M * N * K);
  CHECK(mm.ms > 0);
  CHECK(mm.tflops() > 0);
  CHECK(row("matmul 128x256x512 At Bt").calls == 1);
  CHECK(rows.front().ms >= rows.back().ms);  // the most time first
  CHECK(loom::kernels::cuda::Profile::current() == nullptr);
  std::vector<float> h(std::size_t(M) * N);
  ops.to_host(c.data(), h.data(), h.size());
  CHECK(h[0] == 0.0f);
}

TEST_CASE("attention's FLOPs count the pairs a query sees", "[cuda][profile]") {
  loom::kernels::AttentionShape s{2, 4, 3, 3, 8, 24, 24, 24, 1.0};
  CHECK(loom::kernels::cuda::attention_flops(s) == 4.0 * 2 * 3 * 8 * (1 + 2 + 3 + 4));
  s.causal = false, s.Tk = 6;
  CHECK(loom::kernels::cuda::attention_flops(s) == 4.0 * 2 * 3 * 8 * 4 * 6);
}

// --- the caching allocator ---------------------------------------------------------------------------------------

static_assert(CudaAllocator::size_class(0) == 0);
static_assert(CudaAllocator::size_class(1) == 512);
static_assert(CudaAllocator::size_class(513) == 1024);
static_assert(CudaAllocator::size_class(4097) == 4608);
static_assert(CudaAllocator::size_class(8193) == 9216);
static_assert(CudaAllocator::size_class(std::size_t{1} << 20) == std::size_t{1} << 20);
static_assert(CudaAllocator::size_class((std::size_t{1} << 20) + 1) == (std::size_t{1} << 20) + (std::size_t{1} << 17));
static_assert(CudaAllocator::size_class((std::size_t{3} << 30) - 1) == std::size_t{3} << 30);

TEST_CASE("the allocator counts bytes in use, the peak and the cache, and reuses blocks per stream",
          "[cuda][allocator]") {
  CudaAllocator& alloc = CudaAllocator::instance();
  LOOM_CUDA(cudaDeviceSynchronize());
  const auto base = alloc.stats();
  alloc.reset_peak();

  void* p = alloc.allocate(1000, stream());
  auto s = alloc.stats();
  CHECK(s.in_use == base.in_use + 1024);
  CHECK(s.requested == base.requested + 1000);
  CHECK(s.peak == s.in_use);
  alloc.deallocate(p);
  s = alloc.stats();
  CHECK(s.in_use == base.in_use);
  CHECK(s.peak == base.in_use + 1024);
  CHECK(s.cached >= 1024);
  CHECK(s.reserved == s.in_use + s.cached);

  // The same size class on the same stream takes the block back without cudaMalloc.
  const auto mallocs = alloc.stats().mallocs;
  void* again = alloc.allocate(700, stream());
  CHECK(again == p);
  CHECK(alloc.stats().mallocs == mallocs);
  // Another stream does not take a block the first may still be using.
  cudaStream_t other = nullptr;
  LOOM_CUDA(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  alloc.deallocate(again);
  void* elsewhere = alloc.allocate(700, other);
  CHECK(elsewhere != p);
  alloc.deallocate(elsewhere);
  LOOM_CUDA(cudaStreamSynchronize(other));
  LOOM_CUDA(cudaStreamDestroy(other));

  // A large block: counted at its size class, and the peak stays after it is freed.
  alloc.reset_peak();
  {
    CudaBuffer<float> big((std::size_t{5} << 20) + 3, stream());
    CudaBuffer<float> moved = std::move(big);
    CHECK(big.data() == nullptr);
    CHECK(moved.size() == (std::size_t{5} << 20) + 3);
    CHECK(alloc.stats().in_use ==
          base.in_use + CudaAllocator::size_class(((std::size_t{5} << 20) + 3) * sizeof(float)));
  }
  CHECK(alloc.stats().in_use == base.in_use);
  CHECK(alloc.stats().peak >= base.in_use + (std::size_t{20} << 20));

  LOOM_CUDA(cudaStreamSynchronize(stream()));
  alloc.empty_cache();
  s = alloc.stats();
  CHECK(s.cached == 0);
  CHECK(s.reserved == s.in_use);
  CHECK(s.frees > base.frees);
}

TEST_CASE("the allocator is thread-safe and returns to its starting counts", "[cuda][allocator]") {
  CudaAllocator& alloc = CudaAllocator::instance();
  const auto base = alloc.stats();
  const auto live = alloc.live_blocks();
  int device = 0;
  LOOM_CUDA(cudaGetDevice(&device));
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < 8; ++w) {
    threads.emplace_back([&, w] {
      try {
        LOOM_CUDA(cudaSetDevice(device));
        std::mt19937 gen(w);
        std::uniform_int_distribution<std::size_t> size(1, 3 << 18);
        std::vector<void*> held;
        for (int i = 0; i < 500; ++i) {
          held.push_back(alloc.allocate(size(gen), stream()));
          if (held.size() > 4) {
            alloc.deallocate(held.front());
            held.erase(held.begin());
          }
        }
        for (void* p : held) alloc.deallocate(p);
      } catch (...) {
        ++errors;
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(errors == 0);
  CHECK(alloc.live_blocks() == live);
  CHECK(alloc.stats().in_use == base.in_use);
  CHECK(alloc.stats().requested == base.requested);
}

TEST_CASE("a training-like step reaches a steady state without cudaMalloc", "[cuda][allocator]") {
  CudaAllocator& alloc = CudaAllocator::instance();
  Rng rng(11);
  const int R = 4096, C = 256;  // bias_backward over several chunks takes scratch memory; matmul a workspace
  const auto x = rng.values<float>(std::size_t(R) * C), w = rng.values<float>(std::size_t(C) * C);
  Dev<float> dx(x.t), dw(w.t), dy(std::size_t(R) * C), db(C);
  auto step = [&] {
    gpu::matmul(dx.get(), dw.get(), dy.get(), R, C, C, false, true, stream());
    gpu::bias_backward(dy.get(), db.get(), R, C, stream());
    cpu::AttentionShape s{2, 128, 4, 2, 64, 4 * 64, 2 * 64, 4 * 64, 0.125f};
    Dev<float> lse(2 * 4 * 128);
    LOOM_CUDA(cudaMemsetAsync(lse.get(), 0, 2 * 4 * 128 * sizeof(float), stream()));
    gpu::attention_backward(dx.get(), dx.get(), dx.get(), dx.get(), dx.get(), lse.get(), dy.get(), dy.get(),
                            dy.get(), s, stream());
  };
  step();
  LOOM_CUDA(cudaStreamSynchronize(stream()));
  const auto mallocs = alloc.stats().mallocs;
  for (int i = 0; i < 3; ++i) step();
  LOOM_CUDA(cudaStreamSynchronize(stream()));
  CHECK(alloc.stats().mallocs == mallocs);
}

TEST_CASE("errors name the call, the library's text and the code", "[cuda][errors]") {
  check_error<loom::BackendError>([] { LOOM_CUDA(cudaSetDevice(1 << 20)); }, "cudaSetDevice failed: ");
  check_error<loom::BackendError>([] { LOOM_CUDA(cudaSetDevice(1 << 20)); }, "(cudaErrorInvalidDevice)");
  (void)cudaGetLastError();
  const auto unsupported = [] { return CUBLAS_STATUS_NOT_SUPPORTED; };
  check_error<loom::BackendError>([&] { LOOM_CUBLAS(unsupported()); }, "unsupported failed: ");
  check_error<loom::BackendError>([&] { LOOM_CUBLAS(unsupported()); }, "(CUBLAS_STATUS_NOT_SUPPORTED)");
  check_error<loom::BackendError>([] { (void)CudaAllocator::instance().allocate(std::size_t{1} << 52, stream()); },
                                  "out of device memory");
}
