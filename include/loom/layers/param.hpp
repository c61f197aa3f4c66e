// A model's parameter table: every parameter declared once, by name, global shape and placement type, giving its
// local shape and place in the rank's flat buffer, its initialisation and whether weight decay applies.
#pragma once

#include <loom/core/random.hpp>
#include <loom/tensor/placement.hpp>

#include <algorithm>
#include <string>
#include <vector>

namespace loom::layers {

//! One parameter of a rank: its name (Hugging Face's), local shape, offset in the rank's flat buffer, weight decay
//! (matrices and embeddings, not biases or norms), initialisation, and its layout over the tensor-parallel group.
struct ParamSpec {
  std::string name;
  Shape shape;  //!< local
  std::int64_t offset;
  bool decay;
  double init_std;  //!< 0: constant init_value
  double init_value;
  Layout layout;
  bool replicated;    //!< placement Replicate
  std::size_t index;  //!< its number in the whole model's table (a part of a model holds some of them)
  bool expert;        //!< an expert's: held by one rank of the expert-parallel group, its gradient averaged over
                      //!< the expert-data-parallel group
};

//! Builds the table in declaration order, for rank `rank` of a tensor-parallel group of `size`.
class ParamTable {
 public:
  ParamTable(int size, int rank) : size_(size), rank_(rank) {}

  //! Declares the next parameter of the whole model; it is kept unless skipping (a part of a model that does not
  //! hold it), and numbered either way.
  template <PlacementType P>
  void add(std::string name, Shape global, bool decay, double init_std, double init_value = 0,
           std::vector<Segment> segments = {}) {
    const std::size_t index = next_index_++;
    if (skip_) return;
    Layout l(std::move(global), P::dim, std::move(segments), size_, rank_);
    const auto n = l.local_numel();
    specs_.push_back({std::move(name), l.local_shape(), at_, decay, init_std, init_value, std::move(l),
                      std::is_same_v<P, Replicate>, index, expert_});
    at_ += n;
  }
  //! Whether the parameters declared next are left out.
  void skip(bool s) { skip_ = s; }
  bool skipping() const { return skip_; }
  //! Whether the parameters declared next are an expert's (ParamSpec::expert).
  void expert(bool e) { expert_ = e; }

  const std::vector<ParamSpec>& specs() const { return specs_; }
  std::vector<ParamSpec> take() { return std::move(specs_); }
  std::int64_t numel() const { return at_; }

 private:
  int size_, rank_;
  std::vector<ParamSpec> specs_;
  std::int64_t at_ = 0;
  std::size_t next_index_ = 0;
  bool skip_ = false, expert_ = false;
};

//! Elements of a flat buffer laid out by `specs`: where its last parameter ends (for the whole model's table, the
//! whole model's parameter count).
inline std::int64_t numel_of_table(const std::vector<ParamSpec>& specs) {
  std::int64_t n = 0;
  for (const auto& s : specs) n = std::max(n, s.offset + numel_of(s.shape));
  return n;
}

//! Fills a rank's flat buffer: element i (global, row-major) of parameter p (its index in the whole model) is a
//! function of (seed, p, i) alone, so every layout starts from the same model.
//! Only elements [lo, hi) of the flat buffer when given (what a rank holds of a sharded buffer), the same values;
//! `params` holds the flat buffer from element `origin` on (origin <= lo: a buffer of [lo, hi) alone, origin = lo).
template <class T>
void initialise(const std::vector<ParamSpec>& specs, T* params, std::uint64_t seed, std::int64_t lo = 0,
                std::int64_t hi = -1, std::int64_t origin = 0) {
  for (const auto& s : specs) {
    const auto k = random::key(seed, s.index);
    s.layout.for_each_piece([&](std::int64_t l, std::int64_t g, std::int64_t n) {
      const std::int64_t at = s.offset + l;
      const std::int64_t a = std::max<std::int64_t>(0, lo - at), z = hi < 0 ? n : std::min<std::int64_t>(n, hi - at);
      for (std::int64_t i = a; i < z; ++i)
        params[at + i - origin] = static_cast<T>(
            s.init_std > 0 ? s.init_std * random::normal(k, static_cast<std::uint64_t>(g + i)) : s.init_value);
    });
  }
}

}  // namespace loom::layers
