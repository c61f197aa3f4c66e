// Ring and Ulysses attention on cp ranks against the one-rank causal attention on the same data: forward (out and
// lse) and backward (dq, dk, dv) at each rank's zigzag rows, f64 to 1e-12 and f32 to 1e-5, for 1, 2, 4 and 8 ranks,
// grouped and multi-query heads, chunks longer than a kernel tile; the attention blocks alone against a dense
// reference; and the traffic: ring, n - 1 key/value rotations forward, n - 1 more and n gradient rotations backward;
// Ulysses, the all-to-alls of q, k, v, out and the log-sum-exp forward, and of those, dout, dq, dk, dv backward.
#include "catch.hpp"

#include <loom/comm/local.hpp>
#include <loom/config.hpp>
#include <loom/layers/ring_attention.hpp>
#include <loom/layers/ulysses_attention.hpp>

#include <cmath>
#include <random>
#include <vector>

using namespace loom;

namespace {

template <class T>
std::vector<T> random_values(std::size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> d(0.0, 1.0);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(d(gen));
  return v;
}

//! The largest |a - b| over the largest |b|.
template <class T, class U>
double relative_error(const std::vector<T>& a, const std::vector<U>& b) {
  double err = 0, scale = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    err = std::max(err, std::abs(double(a[i]) - double(b[i])));
    scale = std::max(scale, std::abs(double(b[i])));
  }
  return err / std::max(scale, 1e-300);
}

struct Case {
  int B, c, Hq, Hkv, D;
};

enum class Algorithm { ring, ulysses };

//! Ring or Ulysses attention on n cp ranks (threads) against causal attention over the whole sequence of 2nc tokens.
template <int N, class T, Algorithm Alg = Algorithm::ring>
void check_ring(const Case& k, double tolerance, layers::SeqSplit split = layers::SeqSplit::zigzag) {
  using A = acc_t<T>;
  const int T_ = 2 * N * k.c, wq = k.Hq * k.D, wkv = k.Hkv * k.D;
  const kernels::AttentionShape whole{k.B, T_, k.Hq, k.Hkv, k.D, wq, wkv, wq, 1.0 / std::sqrt(double(k.D))};
  const auto q = random_values<T>(std::size_t(k.B) * T_ * wq, 1);
  const auto kk = random_values<T>(std::size_t(k.B) * T_ * wkv, 2);
  const auto v = random_values<T>(std::size_t(k.B) * T_ * wkv, 3), dout = random_values<T>(q.size(), 4);
  std::vector<T> out(q.size()), dq(q.size()), dk(kk.size()), dv(kk.size());
  std::vector<A> lse(std::size_t(k.B) * k.Hq * T_);
  kernels::cpu::attention_forward(q.data(), kk.data(), v.data(), out.data(), lse.data(), whole);
  kernels::cpu::attention_backward(dout.data(), q.data(), kk.data(), v.data(), out.data(), lse.data(), dq.data(),
                                   dk.data(), dv.data(), whole);
  // Each rank's rows of a B x T_ x w tensor, in zigzag order.
  auto rows_of = [&](const auto& x, int w, int r) {
    std::vector<std::decay_t<decltype(x[0])>> mine(std::size_t(k.B) * 2 * k.c * w);
    for (int b = 0; b < k.B; ++b)
      for (int t = 0; t < 2 * k.c; ++t) {
        const int g = layers::split_position(t, r, N, k.c, split);
        std::copy_n(x.begin() + (std::ptrdiff_t(b) * T_ + g) * w, w,
                    mine.begin() + (std::ptrdiff_t(b) * 2 * k.c + t) * w);
      }
    return mine;
  };
  auto lse_of = [&](int r) {
    std::vector<A> mine(std::size_t(k.B) * k.Hq * 2 * k.c);
    for (int b = 0; b < k.B; ++b)
      for (int h = 0; h < k.Hq; ++h)
        for (int t = 0; t < 2 * k.c; ++t)
          mine[(std::size_t(b) * k.Hq + h) * 2 * k.c + t] =
              lse[(std::size_t(b) * k.Hq + h) * T_ + layers::split_position(t, r, N, k.c, split)];
    return mine;
  };
  std::vector<double> errors(5 * static_cast<std::size_t>(N));
  std::vector<comm::Traffic> forward(N), backward(N);
  run_local<Parallel<CP<N>>>([&](auto& ctx) {
    auto& cp = ctx.template comm<Axis::cp>();
    const int r = cp.rank();
    const auto ql = rows_of(q, wq, r), kl = rows_of(kk, wkv, r), vl = rows_of(v, wkv, r), dol = rows_of(dout, wq, r);
    const kernels::AttentionShape local{k.B, 2 * k.c, k.Hq, k.Hkv, k.D, wq, wkv, wq, whole.scale};
    std::vector<T> o(ql.size()), gq(ql.size()), gk(kl.size()), gv(kl.size());
    std::vector<A> l(std::size_t(k.B) * k.Hq * 2 * k.c);
    cp.reset_traffic();
    if constexpr (Alg == Algorithm::ring)
      layers::ring_attention_forward(cp, ql.data(), kl.data(), vl.data(), o.data(), l.data(), local, split);
    else
      layers::ulysses_attention_forward(cp, ql.data(), kl.data(), vl.data(), o.data(), l.data(), local);
    forward[std::size_t(r)] = cp.traffic();
    cp.reset_traffic();
    if constexpr (Alg == Algorithm::ring)
      layers::ring_attention_backward(cp, dol.data(), ql.data(), kl.data(), vl.data(), o.data(), l.data(), gq.data(),
                                      gk.data(), gv.data(), local, split);
    else
      layers::ulysses_attention_backward(cp, dol.data(), ql.data(), kl.data(), vl.data(), o.data(), l.data(),
                                         gq.data(), gk.data(), gv.data(), local);
    backward[std::size_t(r)] = cp.traffic();
    double* e = errors.data() + 5 * r;
    e[0] = relative_error(o, rows_of(out, wq, r));
    e[1] = relative_error(l, lse_of(r));
    e[2] = relative_error(gq, rows_of(dq, wq, r));
    e[3] = relative_error(gk, rows_of(dk, wkv, r));
    e[4] = relative_error(gv, rows_of(dv, wkv, r));
  });
  const char* what[] = {"out", "lse", "dq", "dk", "dv"};
  for (int r = 0; r < N; ++r) {
    for (int i = 0; i < 5; ++i) {
      INFO("cp" << N << " rank " << r << " " << what[i] << ": B=" << k.B << " c=" << k.c << " Hq=" << k.Hq
                << " Hkv=" << k.Hkv << " D=" << k.D);
      CHECK(errors[std::size_t(5 * r + i)] <= tolerance);
    }
    INFO("cp" << N << " rank " << r);
    if constexpr (Alg == Algorithm::ring) {
      // Forward: n - 1 rotations of the two chunks' keys and values; backward: as many, and n of their gradient.
      const double block = 4.0 * k.B * k.c * wkv;
      CHECK(forward[std::size_t(r)].count(comm::Collective::send_recv) == N - 1);
      CHECK(forward[std::size_t(r)].elements == block * (N - 1));
      CHECK(forward[std::size_t(r)].bytes == block * (N - 1) * sizeof(T));
      CHECK(backward[std::size_t(r)].elements == block * (N - 1) + (N > 1 ? block * N : 0));
    } else {
      // Each all-to-all sends (n - 1)/n of the rank's 2c rows of a tensor: q and out of width Hq D, k and v of
      // Hkv D, the log-sum-exp of Hq; backward also dout, and dq, dk, dv back.
      const double rows = 2.0 * k.B * k.c * (N - 1) / N, qw = rows * wq, kvw = rows * wkv, lw = rows * k.Hq;
      CHECK(forward[std::size_t(r)].count(comm::Collective::all_to_all) == 5);
      CHECK(forward[std::size_t(r)].elements == 2 * qw + 2 * kvw + lw);
      CHECK(backward[std::size_t(r)].count(comm::Collective::all_to_all) == 9);
      CHECK(backward[std::size_t(r)].elements == 4 * qw + 4 * kvw + lw);
    }
  }
}

}  // namespace

TEST_CASE("attention blocks: keys all before the queries, and the causal diagonal, against a dense softmax",
          "[attention][cp]") {
  // One sequence, 70 queries over 90 keys (more than a 64-wide tile each), grouped heads.
  const int B = 1, Tq = 70, Tk = 90, Hq = 4, Hkv = 2, D = 8;
  const auto q = random_values<double>(std::size_t(B) * Tq * Hq * D, 5);
  const auto k = random_values<double>(std::size_t(B) * Tk * Hkv * D, 6), v = random_values<double>(k.size(), 7);
  const double scale = 0.3;
  for (bool causal : {false, true}) {
    const int keys = causal ? Tq : Tk;
    const kernels::AttentionShape s{B, Tq, Hq, Hkv, D, Hq * D, Hkv * D, Hq * D, scale, keys, causal};
    std::vector<double> out(q.size()), lse(std::size_t(B) * Hq * Tq);
    kernels::cpu::attention_forward(q.data(), k.data(), v.data(), out.data(), lse.data(), s);
    double err = 0;
    for (int h = 0; h < Hq; ++h)
      for (int i = 0; i < Tq; ++i) {
        const int kh = h / (Hq / Hkv), last = causal ? i : keys - 1;
        std::vector<double> p(std::size_t(last) + 1);
        double m = -1e300, sum = 0;
        for (int j = 0; j <= last; ++j) {
          double dot = 0;
          for (int d = 0; d < D; ++d)
            dot += q[(std::size_t(i) * Hq + h) * D + d] * k[(std::size_t(j) * Hkv + kh) * D + d];
          p[std::size_t(j)] = dot * scale;
          m = std::max(m, p[std::size_t(j)]);
        }
        for (auto& x : p) sum += (x = std::exp(x - m));
        err = std::max(err, std::abs(lse[std::size_t(h) * Tq + i] - (m + std::log(sum))));
        for (int d = 0; d < D; ++d) {
          double o = 0;
          for (int j = 0; j <= last; ++j) o += p[std::size_t(j)] / sum * v[(std::size_t(j) * Hkv + kh) * D + d];
          err = std::max(err, std::abs(out[(std::size_t(i) * Hq + h) * D + d] - o));
        }
      }
    INFO((causal ? "causal diagonal" : "full block"));
    CHECK(err < 1e-12);
  }
  CHECK_THROWS_WITH(kernels::cpu::attention_forward(q.data(), k.data(), v.data(), std::vector<double>(q.size()).data(),
                                                    std::vector<double>(std::size_t(Hq) * Tq).data(),
                                                    kernels::AttentionShape{B, Tq, Hq, Hkv, D, Hq * D, Hkv * D, Hq * D,
                                                                            scale, Tk, true}),
                    Catch::Contains("causal attention needs as many keys as queries (T=70 Tk=90)"));
}

TEST_CASE("ring attention equals causal attention over the whole sequence, f64", "[attention][cp]") {
  check_ring<1, double>({2, 5, 4, 2, 8}, 1e-12);
  check_ring<2, double>({2, 7, 4, 2, 8}, 1e-12);
  check_ring<4, double>({2, 5, 4, 4, 8}, 1e-12);
  check_ring<8, double>({1, 3, 2, 1, 8}, 1e-12);  // multi-query: one key/value head travels
  check_ring<2, double>({1, 70, 2, 2, 16}, 1e-12);  // chunks longer than a 64-row tile
  check_ring<4, double>({2, 5, 4, 2, 8}, 1e-12, layers::SeqSplit::contiguous);  // the unbalanced split, as bench/ runs
}

TEST_CASE("ring attention equals causal attention over the whole sequence, f32", "[attention][cp]") {
  check_ring<2, float>({2, 9, 4, 2, 8}, 1e-5);
  check_ring<4, float>({1, 6, 4, 1, 16}, 1e-5);
}

TEST_CASE("the zigzag split gives rank i chunks i and 2n-1-i and refuses a sequence it cannot cut",
          "[attention][cp]") {
  CHECK(layers::zigzag_chunks(0, 4) == std::array<int, 2>{0, 7});
  CHECK(layers::zigzag_chunks(3, 4) == std::array<int, 2>{3, 4});
  CHECK(layers::zigzag_position(0, 1, 2, 5) == 5);
  CHECK(layers::zigzag_position(7, 1, 2, 5) == 2 * 5 + 2);
  CHECK_NOTHROW(layers::check_zigzag(16, 4));
  CHECK_THROWS_WITH(layers::check_zigzag(30, 4), "loom: context parallelism over 4 ranks cuts each sequence into 2 x 4 "
                                                 "= 8 chunks, but the sequence of 30 tokens is not a multiple of 8");
}

TEST_CASE("under the zigzag split every rank computes the same blocks; under the contiguous one the last 2n - 1 times "
          "the first's", "[attention][cp]") {
  using layers::detail::Block;
  for (int n : {1, 2, 3, 4, 8}) {
    for (auto split : {layers::SeqSplit::zigzag, layers::SeqSplit::contiguous}) {
      std::vector<int> causal(std::size_t(n), 0), full(std::size_t(n), 0);
      for (int r = 0; r < n; ++r)
        for (int step = 0; step < n; ++step)  // the block of rank r - step, as ring_attention_forward holds it
          for (int qi = 0; qi < 2; ++qi)
            for (int kj = 0; kj < 2; ++kj) {
              const Block b = layers::detail::block_of(r, (r + n - step) % n, n, qi, kj, split);
              causal[std::size_t(r)] += b == Block::causal, full[std::size_t(r)] += b == Block::full;
            }
      INFO("n = " << n << (split == layers::SeqSplit::zigzag ? ", zigzag" : ", contiguous"));
      for (int r = 0; r < n; ++r) {
        CHECK(causal[std::size_t(r)] == 2);  // each chunk's diagonal
        // Work in causal halves: a full block is two, the diagonal one; a rank holds two chunks of 2n.
        const int halves = 2 * full[std::size_t(r)] + causal[std::size_t(r)];
        if (split == layers::SeqSplit::zigzag) CHECK(halves == 2 * (2 * n - 1) + 2);
        else CHECK(halves == 2 * (4 * r + 1) + 2);  // chunks 2r and 2r + 1 see 2r and 2r + 1 chunks before them
      }
    }
  }
}

TEST_CASE("Ulysses attention equals causal attention over the whole sequence", "[attention][cp]") {
  check_ring<1, double, Algorithm::ulysses>({2, 5, 4, 2, 8}, 1e-12);
  check_ring<2, double, Algorithm::ulysses>({2, 7, 4, 2, 8}, 1e-12);
  check_ring<4, double, Algorithm::ulysses>({2, 5, 4, 4, 8}, 1e-12);
  check_ring<2, float, Algorithm::ulysses>({2, 9, 4, 2, 8}, 1e-5);
}

TEST_CASE("Ulysses attention refuses heads that do not split over the cp ranks", "[attention][cp]") {
  std::string what;
  run_local<Parallel<CP<4>>>([&](auto& ctx) {
    auto& cp = ctx.template comm<Axis::cp>();
    const kernels::AttentionShape s{1, 4, 4, 2, 8, 32, 16, 32, 0.5};
    std::vector<double> x(128), y(64), l(16);
    try {
      layers::ulysses_attention_forward(cp, x.data(), y.data(), y.data(), x.data(), l.data(), s);
    } catch (const std::exception& e) {
      if (cp.rank() == 0) what = e.what();
    }
  });
  CHECK(what == "loom: Ulysses attention splits the heads over the 4 cp ranks: it needs heads (4) and key/value heads "
                "(2) divisible by 4 (ring attention takes any)");
}
