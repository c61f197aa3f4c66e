// Collective test cases written once and run on every backend: every collective x dtype x reduction x group of a
// Parallel configuration, at awkward sizes, against a serial reference that each rank computes for itself.
// Cases run inside rank threads or processes, so they report by throwing, never through Catch2 macros.
#pragma once

#include <loom/comm/communicator.hpp>
#include <loom/core/half.hpp>
#include <loom/config.hpp>

#include <array>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

namespace loom::test {

using comm::Reduce;

template <class... Args>
void expect(bool ok, Args&&... args) {
  if (!ok) throw Error(loom::detail::cat("check failed: ", std::forward<Args>(args)...));
}

inline constexpr std::array<Reduce, 5> all_reductions{Reduce::sum, Reduce::avg, Reduce::max, Reduce::min,
                                                      Reduce::prod};
inline constexpr std::array<std::size_t, 5> awkward_counts{0, 1, 7, 1000, 4099};

//! The input of global rank g at index i: small integers, so that every algorithm's order of operations gives
//! the same exact result in every dtype (products stay powers of two up to 2^8).
template <class T>
T input(int g, std::size_t i, Reduce op, int salt = 0) {
  if (op == Reduce::prod) return static_cast<T>(1 + (g + i + salt) % 2);
  return static_cast<T>((g * 7 + i * 3 + salt) % 5);
}

template <class T>
std::vector<T> inputs(int g, std::size_t n, Reduce op, int salt = 0) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = input<T>(g, i, op, salt);
  return v;
}

//! The reduction over the group's members of input(member, i), computed the way the result is defined.
template <class T>
T reference(const std::vector<int>& members, std::size_t i, Reduce op, int salt = 0) {
  T acc = input<T>(members[0], i, op, salt);
  for (std::size_t q = 1; q < members.size(); ++q) {
    const T x = input<T>(members[q], i, op, salt);
    switch (op) {
      case Reduce::sum: case Reduce::avg: acc = acc + x; break;
      case Reduce::prod: acc = acc * x; break;
      case Reduce::max: acc = acc < x ? x : acc; break;
      case Reduce::min: acc = x < acc ? x : acc; break;
    }
  }
  if (op == Reduce::avg) acc = acc / static_cast<T>(static_cast<int>(members.size()));
  return acc;
}

template <class T>
double as_double(T x) { return static_cast<double>(x); }

template <class Comm, class T>
void check_equal(Comm& c, const char* what, const std::vector<T>& got, std::size_t at, T want, std::size_t i) {
  expect(got[at] == want, what, " on group ", c.group().describe(), " dtype ", name_of(dtype_of<T>), " at ", i,
         ": got ", as_double(got[at]), ", want ", as_double(want), " (group rank ", c.rank(), ")");
}

template <class T, class Comm>
void all_reduce_cases(Comm& c, Reduce op, std::size_t n) {
  const int me = c.group().ranks[c.rank()];
  const auto& members = c.group().ranks;
  auto send = inputs<T>(me, n, op);
  std::vector<T> recv(n, T(99));
  c.all_reduce(send, recv, op);
  for (std::size_t i = 0; i < n; ++i) check_equal(c, "all_reduce", recv, i, reference<T>(members, i, op), i);
  expect(send == inputs<T>(me, n, op), "all_reduce changed its send buffer");
  // In place, and asynchronously.
  auto buf = inputs<T>(me, n, op, 1);
  auto h = c.all_reduce_async(buf, op);
  h.wait();
  for (std::size_t i = 0; i < n; ++i) check_equal(c, "all_reduce in place", buf, i, reference<T>(members, i, op, 1), i);
}

template <class T, class Comm>
void reduce_scatter_case(Comm& c, Reduce op, std::size_t n) {
  const int me = c.group().ranks[c.rank()];
  const auto& members = c.group().ranks;
  const std::size_t total = n * c.size();
  auto send = inputs<T>(me, total, op);
  std::vector<T> recv(n, T(99));
  c.reduce_scatter(send, recv, op);
  for (std::size_t i = 0; i < n; ++i)
    check_equal(c, "reduce_scatter", recv, i, reference<T>(members, c.rank() * n + i, op), c.rank() * n + i);
}

template <class T, class Comm>
void reduce_case(Comm& c, Reduce op, std::size_t n, int root) {
  const int me = c.group().ranks[c.rank()];
  auto send = inputs<T>(me, n, op, 2);
  std::vector<T> recv(c.rank() == root ? n : 0, T(99));
  c.reduce(send, recv, op, root);
  if (c.rank() == root)
    for (std::size_t i = 0; i < n; ++i) check_equal(c, "reduce", recv, i, reference<T>(c.group().ranks, i, op, 2), i);
}

template <class T, class Comm>
void movement_cases(Comm& c, std::size_t n) {
  const int me = c.group().ranks[c.rank()];
  const auto& members = c.group().ranks;
  const int size = c.size();
  // all_gather, out of place and in place
  auto mine = inputs<T>(me, n, Reduce::sum, 3);
  std::vector<T> all(n * size, T(99));
  c.all_gather(mine, all);
  for (int q = 0; q < size; ++q)
    for (std::size_t i = 0; i < n; ++i)
      check_equal(c, "all_gather", all, q * n + i, input<T>(members[q], i, Reduce::sum, 3), i);
  std::vector<T> inplace(n * size, T(99));
  std::copy(mine.begin(), mine.end(), inplace.begin() + c.rank() * n);
  c.all_gather(std::span<const T>(inplace.data() + c.rank() * n, n), inplace);
  expect(inplace == all, "in-place all_gather differs from out-of-place on group ", c.group().describe());
  // broadcast from every root
  for (int root = 0; root < size; ++root) {
    auto b = c.rank() == root ? inputs<T>(me, n, Reduce::sum, 4) : std::vector<T>(n, T(99));
    c.broadcast(b, root);
    for (std::size_t i = 0; i < n; ++i) check_equal(c, "broadcast", b, i, input<T>(members[root], i, Reduce::sum, 4), i);
  }
  // all_to_all: block q of rank p holds value(p, q, i)
  std::vector<T> send(n * size), recv(n * size, T(99));
  for (int q = 0; q < size; ++q)
    for (std::size_t i = 0; i < n; ++i) send[q * n + i] = input<T>(me, i, Reduce::sum, q);
  c.all_to_all(send, recv);
  for (int q = 0; q < size; ++q)
    for (std::size_t i = 0; i < n; ++i)
      check_equal(c, "all_to_all", recv, q * n + i, input<T>(members[q], i, Reduce::sum, c.rank()), i);
  // all_to_all_v: rank p sends (p + q + n) % 5 elements to rank q, with a gap of one between blocks.
  auto len = [&](int p, int q) { return static_cast<std::size_t>((p + q + n) % 5); };
  std::vector<std::size_t> sc(size), sd(size), rc(size), rd(size);
  std::size_t s_at = 0, r_at = 0;
  for (int q = 0; q < size; ++q) {
    sc[q] = len(c.rank(), q), sd[q] = s_at, s_at += sc[q] + 1;
    rc[q] = len(q, c.rank()), rd[q] = r_at, r_at += rc[q] + 1;
  }
  std::vector<T> vs(s_at), vr(r_at, T(99));
  for (int q = 0; q < size; ++q)
    for (std::size_t i = 0; i < sc[q]; ++i) vs[sd[q] + i] = input<T>(me, i, Reduce::sum, 10 + q);
  c.all_to_all_v(vs, sc, sd, vr, rc, rd);
  for (int q = 0; q < size; ++q) {
    for (std::size_t i = 0; i < rc[q]; ++i)
      check_equal(c, "all_to_all_v", vr, rd[q] + i, input<T>(members[q], i, Reduce::sum, 10 + c.rank()), i);
    check_equal(c, "all_to_all_v gap", vr, rd[q] + rc[q], T(99), rd[q] + rc[q]);
  }
}

template <class T, class Comm>
void p2p_cases(Comm& c, std::size_t n) {
  const int size = c.size();
  if (size == 1) return;
  const int me = c.group().ranks[c.rank()];
  const int right = (c.rank() + 1) % size, left = (c.rank() + size - 1) % size;
  // A ring shift, receive listed first: a batch must not deadlock whatever its order.
  auto out = inputs<T>(me, n, Reduce::sum, 5);
  std::vector<T> in(n, T(99));
  c.exchange({comm::recv_op(in, left), comm::send_op(out, right)});
  for (std::size_t i = 0; i < n; ++i)
    check_equal(c, "exchange", in, i, input<T>(c.group().ranks[left], i, Reduce::sum, 5), i);
  // Two messages to the same peer arrive in order; asynchronous sends complete once received.
  auto a = inputs<T>(me, n, Reduce::sum, 6), b = inputs<T>(me, n + 1, Reduce::sum, 7);
  std::vector<T> ra(n), rb(n + 1);
  if (c.rank() % 2 == 0 && c.rank() + 1 < size) {
    auto h1 = c.send_async(a, c.rank() + 1);
    auto h2 = c.send_async(b, c.rank() + 1);
    h1.wait();
    h2.wait();
  } else if (c.rank() % 2 == 1) {
    c.recv(ra, c.rank() - 1);
    c.recv(rb, c.rank() - 1);
    const int from = c.group().ranks[c.rank() - 1];
    for (std::size_t i = 0; i < n; ++i) check_equal(c, "send/recv 1st", ra, i, input<T>(from, i, Reduce::sum, 6), i);
    for (std::size_t i = 0; i < n + 1; ++i) check_equal(c, "send/recv 2nd", rb, i, input<T>(from, i, Reduce::sum, 7), i);
  }
  c.barrier();
}

//! Every collective on one communicator for one element type.
template <class T, class Comm>
void collective_cases(Comm& c) {
  constexpr bool integral = std::is_integral_v<T>;
  for (std::size_t n : awkward_counts) {
    for (Reduce op : all_reductions) {
      all_reduce_cases<T>(c, op, n);
      reduce_scatter_case<T>(c, op, n);
      if (n == 7 || n == 0) reduce_case<T>(c, op, n, static_cast<int>(n) % c.size());
    }
    if (!integral || n == 1000) movement_cases<T>(c, n);
    p2p_cases<T>(c, n);
  }
  for (int root = 0; root < c.size(); ++root) reduce_case<T>(c, Reduce::sum, 33, root);
}

template <class Comm>
void collective_cases_all_types(Comm& c) {
  collective_cases<float>(c);
  collective_cases<double>(c);
  collective_cases<bf16>(c);
  collective_cases<fp16>(c);
  collective_cases<std::int32_t>(c);
  collective_cases<std::int64_t>(c);
}

//! Every group of a configuration: each axis, dp x cp, tp x pp, and the world.
template <class Ctx>
void all_groups(Ctx& ctx) {
  collective_cases_all_types(ctx.template comm<Axis::tp>());
  collective_cases_all_types(ctx.template comm<Axis::dp>());
  collective_cases_all_types(ctx.template comm<Axis::pp>());
  collective_cases_all_types(ctx.template comm<Axis::cp>());
  collective_cases_all_types(ctx.template comm<Axis::dp, Axis::cp>());
  collective_cases_all_types(ctx.template comm<Axis::tp, Axis::pp>());
  collective_cases_all_types(ctx.world());
}

}  // namespace loom::test
