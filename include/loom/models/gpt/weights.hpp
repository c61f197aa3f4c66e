// The GPT's parameters as one rank holds them: its part of each, in one flat buffer on its device, initialised from
// a seed so that every layout starts from the same whole model; their gradients; their views by name; the global
// gradient norm; and the whole model gathered from, or scattered to, the tensor-parallel group.
#pragma once

#include <loom/comm/any.hpp>
#include <loom/config.hpp>
#include <loom/kernels/ops.hpp>
#include <loom/layers/tp.hpp>
#include <loom/models/gpt/param_table.hpp>
#include <loom/models/gpt/shape.hpp>
#include <loom/models/sharding.hpp>
#include <loom/tensor/tensor.hpp>

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <span>
#include <string_view>
#include <vector>

namespace loom::models {

//! The parameters and gradients of a GPT (or of a pipeline part of it) on this rank of the tensor-parallel group of
//! layout Cfg, on device Dev; its shape is a value, so that the code is compiled once for every shape.
//! models::GptModel computes with them.
template <class T, class Cfg, class Dev>
class GptWeights {
  static_assert(DeviceRules<Dev, Cfg>::ok);
  static_assert(Cfg::template size<Axis::ep> == 1,
                "loom: a model's layout is ModelLayout<Cfg>, without EP: its experts split over the expert-parallel "
                "communicator it is given");

 protected:
  using Buf = Tensor<T, Dev>;

 public:
  using acc = loom::acc_t<T>;
  static constexpr std::size_t no_param = models::no_param;
  static constexpr int tp_size = Cfg::template size<Axis::tp>;
  static constexpr bool sequence_parallel = Cfg::sequence_parallel;
  //! The context-parallel degree and algorithm: each rank holds 1/cp_size of every sequence (ring_attention.hpp).
  static constexpr int cp_size = Cfg::template size<Axis::cp>;
  static constexpr CpAlgorithm cp_algorithm = Cfg::cp_algorithm;
  //! The tensor-parallel group the layers are compiled for.
  using tensor_parallel = layers::TensorParallel<tp_size, sequence_parallel>;

  //! The parameters of tensor-parallel rank tp_rank (and expert-parallel rank ep_rank of ep) in part `part` of a
  //! model of shape s (gpt_param_specs); global: the whole model's.
  static std::vector<ParamSpec> param_specs(const GptShape& s, int tp_rank, bool global, GptPart part = {},
                                            int ep_rank = 0, int ep = 1) {
    return gpt_param_specs<T>(s, global ? 1 : tp_size, global ? 0 : tp_rank, part, global ? 1 : ep,
                              global ? 0 : ep_rank);
  }
  std::vector<ParamSpec> param_specs(int tp_rank = 0, bool global = false, GptPart part = {}) const {
    return param_specs(shape_, tp_rank, global, part, ep_rank(), ep_size());
  }
  //! The expert-parallel degree (each rank holds experts / ep_size() of every mixture-of-experts layer), this
  //! rank's place in the group, and the group (null without expert parallelism); its traffic() counts the model's
  //! all-to-alls.
  int ep_size() const { return ep_ ? ep_->size() : 1; }
  int ep_rank() const { return ep_ ? ep_->rank() : 0; }
  comm::AnyComm* ep() const { return ep_.get(); }
  //! The whole model's shape (a pipeline part holds some of its blocks).
  const GptShape& shape() const { return shape_; }

  const std::vector<ParamSpec>& specs() const { return specs_; }
  //! Parameters and gradients in one flat buffer each, on Dev.
  const Buf& params() const { return params_; }
  const Buf& grads() const { return grads_; }
  //! A view of this rank's part of one parameter (or its gradient) by its Hugging Face name.
  Buf param(std::string_view name) const { return view_of(params_, name); }
  Buf grad(std::string_view name) const { return view_of(grads_, name); }
  //! Zeroes the gradients on the model's stream (ordered with its kernels, and in a device's profile).
  void zero_grad() { ops_.fill(grads_.data(), static_cast<std::size_t>(grads_.numel()), T(0)); }
  //! The operations the model runs on its device (on CUDA: with the stream they are issued on).
  const kernels::Ops<Dev>& ops() const { return ops_; }
  int tp_rank() const { return tp_.rank(); }
  //! The tensor-parallel group, with the counts of the collectives the model has issued.
  layers::TpGroup<T, tensor_parallel>& tp() { return tp_; }
  const layers::TpGroup<T, tensor_parallel>& tp() const { return tp_; }

  //! Whether this part holds the embedding (block 0), the loss (the last block); its blocks [first, last).
  bool embedding() const { return ix_.embeds; }
  bool head() const { return ix_.lnf_w != no_param; }
  int first_layer() const { return ix_.first; }
  int last_layer() const { return ix_.last; }

  //! The global gradient norm: each element of the whole model counted once, whichever ranks hold it.
  double grad_norm() { return std::sqrt(grad_square()); }
  //! The sum of squares of this part's gradients over its tensor-parallel group, each element counted once;
  //! without the tied table when skip_tied (a pipeline counts it on one of the two stages that hold it).
  //! With expert parallelism the experts' terms are summed over the expert-parallel group as well.
  double grad_square(bool skip_tied = false) {
    // Every piece's sum at once (a device waits once), then added in order.
    std::vector<std::int64_t> at, count;
    std::vector<int> replicas, expert;
    for (std::size_t p = 0; p < specs_.size(); ++p) {
      if (skip_tied && p == ix_.wte) continue;
      const std::int64_t base = grad_ptr(p) - grads_.data();
      specs_[p].layout.for_each_piece([&](std::int64_t lo, std::int64_t, std::int64_t n, int r) {
        at.push_back(base + lo), count.push_back(n), replicas.push_back(r), expert.push_back(specs_[p].expert);
      });
    }
    std::vector<double> sums(at.size());
    ops_.sums_of_squares(grads_.data(), at.data(), count.data(), at.size(), sums.data());
    double local[2] = {0, 0};  // dense, experts
    for (std::size_t i = 0; i < sums.size(); ++i) local[expert[i] ? 1 : 0] += sums[i] / replicas[i];
    std::vector<acc> sq{static_cast<acc>(local[0]), static_cast<acc>(local[1])};
    {
      auto counted = tp_.counting(layers::Phase::grads);
      tp_.all_reduce_acc(sq.data(), 2, comm::Reduce::sum);
    }
    if (ep_) {
      std::vector<double> e{static_cast<double>(sq[1])};
      ep_->all_reduce(e, comm::Reduce::sum);
      return static_cast<double>(sq[0]) + e[0];
    }
    return static_cast<double>(sq[0] + sq[1]);
  }
  //! The tied embedding table's gradient (this rank's rows, in Dev's memory), in a part that holds it; else (and
  //! for a model whose output layer has a table of its own) empty.
  std::span<T> tied_grad() {
    if (ix_.wte == no_param || !shape_.tied) return {};
    return {grad_ptr(ix_.wte), static_cast<std::size_t>(numel_of(specs_[ix_.wte].shape))};
  }
  //! Bytes of this rank's parameters: those every tensor-parallel rank holds in full, and its part of the others.
  struct ParamBytes {
    std::size_t replicated, sharded;
  };
  ParamBytes param_bytes() const {
    ParamBytes b{0, 0};
    for (const auto& s : specs_) (s.replicated ? b.replicated : b.sharded) += numel_of(s.shape) * sizeof(T);
    return b;
  }
  //! Sets elements [lo, hi) of the flat parameter buffer from seed, as building the model does (a shard's, when it
  //! was built without writing its buffers: GptOptions::write_buffers).
  void initialise(std::uint64_t seed, std::int64_t lo, std::int64_t hi) {
    if (lo >= hi) return;
    if constexpr (on_host) {
      layers::initialise(specs_, params_.data(), seed, lo, hi);
    } else {  // [lo, hi) made on the host, element by element as there, then copied
      const auto init = Tensor<T>::zeros({hi - lo});
      layers::initialise(specs_, init.data(), seed, lo, hi, lo);
      ops_.from_host(init.data(), params_.data() + lo, static_cast<std::size_t>(hi - lo));
    }
  }
  //! The whole model's parameters (or any buffer laid out as them, such as an optimizer's moments, U = acc) in the
  //! single-rank layout, in host memory on every rank (gather_params: a collective over the tensor-parallel
  //! group); local is in Dev's memory.
  template <class U>
  std::vector<U> gather(const U* local) {
    std::vector<U> staged;
    if constexpr (!on_host) {
      staged.resize(static_cast<std::size_t>(params_.numel()));
      ops_.to_host(local, staged.data(), staged.size());
      local = staged.data();
    }
    const auto global = param_specs(0, true);
    std::vector<U> whole = gather_params(tp_, specs_, global, shape_.params(), local);
    if (ep_) {  // every expert-parallel rank's experts, each where the single-rank layout has it
      std::vector<U> mine;
      for (const auto& s : specs_)
        if (s.expert) {
          const auto& g = global[s.index];
          mine.insert(mine.end(), whole.begin() + g.offset, whole.begin() + g.offset + numel_of(g.shape));
        }
      std::vector<U> all(mine.size() * static_cast<std::size_t>(ep_size()));
      ep_->all_gather(mine, all);
      for (int q = 0; q < ep_size(); ++q) {
        std::size_t at = mine.size() * static_cast<std::size_t>(q);
        for (const auto& s : param_specs(shape_, tp_.rank(), false, {ix_.first, ix_.last}, q, ep_size()))
          if (s.expert) {
            const auto& g = global[s.index];
            std::copy_n(all.begin() + static_cast<std::ptrdiff_t>(at), numel_of(g.shape), whole.begin() + g.offset);
            at += static_cast<std::size_t>(numel_of(g.shape));
          }
      }
    }
    return whole;
  }
  //! Sets this rank's part (local, in Dev's memory) from a buffer in the single-rank layout in host memory (no
  //! communication).
  template <class U>
  void scatter(const U* global_buffer, U* local) const {
    if constexpr (!on_host) {  // every element of local is written: build it on the host, copy it over
      std::vector<U> staged(static_cast<std::size_t>(params_.numel()));
      scatter_params(specs_, param_specs(0, true), global_buffer, staged.data());
      ops_.from_host(staged.data(), local, staged.size());
    } else {
      scatter_params(specs_, param_specs(0, true), global_buffer, local);
    }
  }
 protected:
  static constexpr bool on_host = kernels::is_host_v<Dev>;

  //! ep: the expert-parallel group's communicator (null, or a group of one, without expert parallelism).
  GptWeights(const GptShape& s, layers::TpGroup<T, tensor_parallel> tp, std::uint64_t seed, GptPart part,
             bool write = true, std::unique_ptr<comm::AnyComm> ep = nullptr)
      : shape_(checked(s, ep ? ep->size() : 1)), ep_(ep && ep->size() > 1 ? std::move(ep) : nullptr),
        tp_(std::move(tp)), specs_(param_specs(s, tp_.rank(), false, part, ep_rank(), ep_size())),
        ix_(s, part, specs_), shared_(specs_) {
    LOOM_CHECK(0 <= ix_.first && ix_.first < ix_.last && ix_.last <= s.layers, "a part of the model holds blocks [",
               part.first, ", ", part.last, "), which is not a non-empty range of 0..", s.layers);
    // On a device the tensor-parallel collectives read what the model's stream wrote: they are ordered on it.
    if constexpr (!on_host)
      if (tensor_parallel::size > 1) tp_.order_on(ops_.stream);
    const std::int64_t n = specs_.empty() ? 0 : specs_.back().offset + numel_of(specs_.back().shape);
    {
      MemoryUseScope use(MemoryUse::parameters);
      params_ = write ? Buf::zeros({n}) : Buf({n});
    }
    {
      MemoryUseScope use(MemoryUse::gradients);
      grads_ = write ? Buf::zeros({n}) : Buf({n});
    }
    if (write) initialise(seed, 0, n);
  }
  GptWeights(const GptWeights&) = delete;
  GptWeights& operator=(const GptWeights&) = delete;

  //! Parameter p's (or its gradient's) first element; null for no_param (a part, or a spec, without it).
  T* param_ptr(std::size_t p) const { return p == no_param ? nullptr : params_.data() + specs_[p].offset; }
  T* grad_ptr(std::size_t p) const { return p == no_param ? nullptr : grads_.data() + specs_[p].offset; }
  Buf view_of(const Buf& buf, std::string_view name) const {
    for (const auto& s : specs_)
      if (s.name == name) return buf.slice(0, s.offset, s.offset + numel_of(s.shape)).view(s.shape);
    throw Error(loom::detail::cat("loom: the model has no parameter named '", name, "'"));
  }
  //! A backward keeps the gradients that tensor-parallel ranks share before it adds to those of r, and sums them
  //! over the group after.
  void keep_shared(ParamRange r) {
    if constexpr (tp_size > 1) shared_.keep(grads_.data(), r.first, r.last, ops_);
  }
  void sum_shared(ParamRange r) {
    if constexpr (tp_size > 1) shared_.sum(tp_, grads_.data(), r.first, r.last, ops_);
  }

  //! s, if a model of that shape can be split over the layout's tensor- and context-parallel groups and ep
  //! expert-parallel ranks (the rules LayoutRules checks at compile time); else an error naming the rule.
  static const GptShape& checked(const GptShape& s, int ep) {
    std::string_view rule = shape_violation(s);
    if (rule.empty()) rule = tensor_parallel_violation(s, tp_size, sequence_parallel);
    if (rule.empty()) rule = context_parallel_violation(s, tp_size, cp_size, cp_algorithm);
    if (rule.empty()) rule = expert_parallel_violation(s, ep);
    LOOM_CHECK(rule.empty(), "a GPT of ", s.layers, " layers, heads ", s.heads, "/", s.kv_heads, ", d_model ",
               s.d_model, ", d_ff ", s.ffn(), ", vocabulary ", s.vocab, s.experts > 0 ? ", max_seq " : " and max_seq ",
               s.max_seq, s.experts > 0 ? " and " + std::to_string(s.experts) + " experts" : std::string(),
               " cannot be built on ", Cfg::name(), ep > 1 ? " with " + std::to_string(ep) + " expert-parallel ranks"
               : std::string(), ": ", rule);
    return s;
  }

  GptShape shape_;
  std::unique_ptr<comm::AnyComm> ep_;  //!< with expert parallelism: the ep group's communicator
  kernels::Ops<Dev> ops_{};
  layers::TpGroup<T, tensor_parallel> tp_;
  std::vector<ParamSpec> specs_;
  GptParamIndex ix_;
  SharedGradients<T, tensor_parallel, Dev> shared_;  //!< refers to specs_
  Buf params_, grads_;
};

}  // namespace loom::models
