// Text generation from the library's transformers: decoding with a key/value cache, on one rank or over a
// tensor-parallel group, and the choice of each next token (greedy, or sampled with a temperature, top-k and top-p).
//
// The decoder reads the model's own parameters (no copy) and keeps, per block, the keys and values of every token
// fed so far. Feeding n tokens runs them through the blocks at once: each attends to the cached tokens and to the
// new ones before it, so one call takes a whole prompt (the prefill) and the next ones a token each. Under tensor
// parallelism every rank holds its heads' cache and its share of each projection, sums the row-parallel outputs
// (one all-reduce after the attention, one after the MLP, as in training) and gathers the logits over the
// vocabulary split: every rank sees the same logits and picks the same token, so the ranks stay in step. A mixture
// of experts routes each token to its top-k experts without a capacity (dropless, as Hugging Face's Mixtral decodes).
#pragma once

#include <loom/core/error.hpp>
#include <loom/core/function_ref.hpp>
#include <loom/core/random.hpp>
#include <loom/layers/moe_router.hpp>
#include <loom/models/gpt/model.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <span>
#include <vector>

namespace loom::models {

//! How the next token is chosen from the logits: greedily (temperature 0: the highest logit, the lowest id among
//! equals), or drawn from softmax(logits / temperature) restricted to the top_k most likely tokens (0: all) and then
//! to the fewest most likely whose probabilities reach top_p (1: all). The draws are a function of (seed, the
//! token's place in the generated text) alone.
struct Sampling {
  double temperature = 0;
  int top_k = 0;
  double top_p = 1;
  std::uint64_t seed = 0;

  void check() const {
    LOOM_CHECK(temperature >= 0 && std::isfinite(temperature), "the temperature must be 0 (greedy) or positive, got ",
               temperature);
    LOOM_CHECK(top_k >= 0, "top-k must be 0 (every token) or positive, got ", top_k);
    LOOM_CHECK(top_p > 0 && top_p <= 1, "top-p must be in (0, 1], got ", top_p);
  }
};

//! The token chosen from `logits` (one per vocabulary entry) under s; `draw` numbers the choice in its text.
inline std::int32_t choose_token(std::span<const double> logits, const Sampling& s, std::uint64_t draw) {
  LOOM_CHECK(!logits.empty(), "choosing a token from no logits");
  if (s.temperature == 0)
    return static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  std::vector<std::int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
    return logits[std::size_t(a)] > logits[std::size_t(b)];
  });
  std::size_t keep = s.top_k > 0 ? std::min<std::size_t>(std::size_t(s.top_k), order.size()) : order.size();
  const double top = logits[std::size_t(order[0])];
  std::vector<double> p(keep);
  double sum = 0;
  for (std::size_t i = 0; i < keep; ++i) sum += p[i] = std::exp((logits[std::size_t(order[i])] - top) / s.temperature);
  if (s.top_p < 1) {  // the fewest most likely whose probabilities reach top_p
    double reached = 0;
    std::size_t n = 0;
    while (n < keep && reached < s.top_p * sum) reached += p[n++];
    keep = std::max<std::size_t>(n, 1), sum = reached > 0 ? reached : p[0];
  }
  const double u = random::uniform(random::key(s.seed, 0x67656e65726174), draw) * sum;
  double at = 0;
  for (std::size_t i = 0; i < keep; ++i)
    if ((at += p[i]) > u) return order[i];
  return order[keep - 1];
}

//! Decodes with model m (a whole model: embedding, every block, the output layer; on its tensor-parallel group,
//! whose ranks call every member together), keeping the keys and values of up to `capacity` tokens (0: the model's
//! max_seq). m must outlive the decoder and not change while it decodes.
template <class T, class Cfg = Parallel<>>
class GptDecoder {
 public:
  using Model = GptModel<T, Cfg, Host>;
  using acc = loom::acc_t<T>;
  static_assert(Model::cp_size == 1,
                "loom: a decoder runs on one rank or a tensor-parallel group; context parallelism splits training's "
                "sequences, not one being generated");

  explicit GptDecoder(Model& m, int capacity = 0)
      : m_(m), s_(m.shape()), cap_(capacity > 0 ? capacity : m.shape().max_seq), hd_(s_.head_dim()),
        hq_(s_.heads / tp), hkv_(static_cast<int>(units_of(s_.kv_heads, tp, 0).count)), ld_((hq_ + 2 * hkv_) * hd_),
        slice_(layers::vocab_slice(s_.vocab, tp, m.tp_rank())),
        norm_{s_.norm == NormKind::rms, m.options().ln_eps, m.ops()} {
    LOOM_CHECK(m.embedding() && m.head() && m.first_layer() == 0 && m.last_layer() == s_.layers,
               "a decoder needs the whole model, but this part holds blocks ", m.first_layer(), "..",
               m.last_layer() - 1, " of ", s_.layers);
    LOOM_CHECK(m.ep_size() == 1, "a decoder needs every expert on each rank, but the model's experts are split over ",
               m.ep_size(), " expert-parallel ranks");
    LOOM_CHECK(capacity >= 0 && cap_ <= s_.max_seq, "a decoder's capacity of ", capacity,
               " tokens is outside 1..", s_.max_seq, " (the model's max_seq)");
    if (s_.rope()) rope_.emplace(hd_, s_.max_seq, rope_frequencies(s_), m.ops());
    const std::int64_t kv = std::int64_t{hkv_} * hd_;
    for (int l = 0; l < s_.layers; ++l)
      keys_.emplace_back(Tensor<T>({cap_, kv})), values_.emplace_back(Tensor<T>({cap_, kv}));
    logits_.resize(std::size_t(s_.vocab));
    mine_.assign(std::size_t((s_.vocab + tp - 1) / tp), T(0));  // padded to the most entries a rank holds
    all_.resize(mine_.size() * tp);
  }

  //! Tokens in the cache, and how many it holds.
  int length() const { return len_; }
  int capacity() const { return cap_; }
  //! Forgets the cached tokens: the next feed starts a new text.
  void reset() { len_ = 0; }

  //! Runs `tokens` through the model after the cached ones and caches them; returns the logits of the last of them
  //! over the whole vocabulary, the same on every tensor-parallel rank (valid until the next call).
  std::span<const double> feed(std::span<const std::int32_t> tokens) {
    const int n = static_cast<int>(tokens.size());
    LOOM_CHECK(n >= 1, "feeding no tokens");
    LOOM_CHECK(len_ + n <= cap_, "the decoder holds ", len_, " tokens and was given ", n,
               " more, past its capacity of ", cap_);
    for (int i = 0; i < n; ++i)
      LOOM_CHECK(tokens[std::size_t(i)] >= 0 && tokens[std::size_t(i)] < s_.vocab, "token ", tokens[std::size_t(i)],
                 " at position ", len_ + i, " is outside the vocabulary 0..", s_.vocab - 1);
    resize(n);
    const auto& ops = m_.ops();
    const auto ends = m_.end_weights();
    const int d = s_.d_model;
    T* x = x_.data();
    ops.embedding_forward(tokens.data(), ends.wte, x, n, d, slice_.first, slice_.count);
    reduce(x, std::size_t(n) * d);
    if (ends.wpe) ops.add_positions(ends.wpe, x, 1, n, d, len_);
    for (int l = 0; l < s_.layers; ++l) block(l, n);
    // The last token's logits: its final norm, this rank's vocabulary rows, gathered over the group.
    const T* last = x + std::ptrdiff_t(n - 1) * d;
    norm_.forward(last, ends.lnf_w, ends.lnf_b, ln_.data(), mean_.data(), rstd_.data(), 1, d);
    const std::size_t c = mine_.size();  // the most entries a rank holds
    ops.matmul(ln_.data(), ends.output, mine_.data(), 1, slice_.count, d, false, true);
    m_.tp().all_gather(mine_.data(), all_.data(), c);
    for (int r = 0; r < tp; ++r) {
      const auto v = layers::vocab_slice(s_.vocab, tp, r);
      for (int i = 0; i < v.count; ++i)
        logits_[std::size_t(v.first + i)] = static_cast<double>(all_[std::size_t(r) * c + std::size_t(i)]);
    }
    len_ += n;
    return logits_;
  }

  //! The prompt, then up to max_new tokens chosen under s, each given to `each` as it is chosen; stops after any of
  //! the tokens `stop`. Starts a new text. Returns the generated tokens (without the prompt).
  std::vector<std::int32_t> generate(std::span<const std::int32_t> prompt, int max_new, const Sampling& s,
                                     std::span<const std::int32_t> stop = {},
                                     FunctionRef<void(std::int32_t)> each = [](std::int32_t) {}) {
    s.check();
    LOOM_CHECK(!prompt.empty(), "generation needs a prompt of at least one token");
    LOOM_CHECK(max_new >= 0, "cannot generate ", max_new, " tokens");
    LOOM_CHECK(std::int64_t(prompt.size()) + max_new - 1 <= cap_, "a prompt of ", prompt.size(), " tokens and ",
               max_new, " new ones need ", prompt.size() + std::size_t(std::max(max_new, 1)) - 1,
               " cached positions, but the decoder holds ", cap_, " (the model's max_seq is ", s_.max_seq, ")");
    reset();
    std::vector<std::int32_t> out;
    if (max_new == 0) return out;
    std::span<const double> logits = feed(prompt);
    for (int i = 0; i < max_new; ++i) {
      const std::int32_t t = choose_token(logits, s, std::uint64_t(i));
      out.push_back(t);
      each(t);
      if (std::find(stop.begin(), stop.end(), t) != stop.end() || i + 1 == max_new) break;
      logits = feed(std::span<const std::int32_t>(&out.back(), 1));
    }
    return out;
  }

 private:
  static constexpr int tp = Model::tp_size;
  using Block = typename Model::block_type;
  using Mlp = typename Block::Mlp;

  //! x (rows x d) summed over the tensor-parallel group: the exit of a row-parallel layer.
  void reduce(T* x, std::size_t n) {
    if constexpr (tp > 1) m_.tp().all_reduce(x, n);
  }

  void resize(int n) {
    if (n <= rows_) return;
    rows_ = n;
    const std::int64_t r = n, d = s_.d_model;
    const int f = std::max(s_.ffn() / tp, s_.shared_experts * s_.expert_width() / tp);
    const int up = s_.gated() ? 2 * std::max(f, s_.expert_width()) : std::max(f, s_.expert_width());
    x_ = Tensor<T>({r, d}), ln_ = Tensor<T>({r, d}), branch_ = Tensor<T>({r, d}), routed_ = Tensor<T>({r, d});
    qkv_ = Tensor<T>({r, std::int64_t{ld_}}), core_ = Tensor<T>({r, std::int64_t{hq_} * hd_});
    h_ = Tensor<T>({r, std::int64_t{up}}), g_ = Tensor<T>({r, std::int64_t{up}});
    mean_ = Tensor<acc>({r}), rstd_ = Tensor<acc>({r});
    if (s_.experts > 0) router_ = Tensor<T>({r, std::int64_t{s_.experts}});
  }

  //! Block l on the n rows of x_ at positions len_ .. len_ + n - 1.
  void block(int l, int n) {
    const auto& ops = m_.ops();
    const auto w = m_.block_weights(l);
    const int d = s_.d_model;
    const std::size_t nd = std::size_t(n) * d;
    T* x = x_.data();
    norm_.forward(x, w.ln1_w, w.ln1_b, ln_.data(), mean_.data(), rstd_.data(), n, d);
    attention(l, n, w.attn);
    ops.add(x, branch_.data(), x, nd);
    norm_.forward(x, w.ln2_w, w.ln2_b, ln_.data(), mean_.data(), rstd_.data(), n, d);
    if (s_.moe_block(l)) experts(n, w.moe);
    else mlp(ln_.data(), n, w.mlp, s_.ffn() / tp, branch_.data());
    ops.add(x, branch_.data(), x, nd);
  }

  //! branch_ = the attention of ln_'s n rows over the cache and themselves.
  void attention(int l, int n, const typename Block::Attention::Params& w) {
    const auto& ops = m_.ops();
    const int d = s_.d_model, p0 = len_, kvw = hkv_ * hd_;
    T* qkv = qkv_.data();
    ops.matmul(ln_.data(), w.qkv_w, qkv, n, ld_, d, false, false);
    if (w.qkv_b) ops.bias_add(qkv, w.qkv_b, qkv, n, ld_);
    if (rope_) rope_->rotate(qkv, n, ld_, hq_ + hkv_, p0, false);
    T *K = keys_[std::size_t(l)].data(), *V = values_[std::size_t(l)].data();
    for (int i = 0; i < n; ++i) {
      std::copy_n(qkv + std::ptrdiff_t(i) * ld_ + hq_ * hd_, kvw, K + std::ptrdiff_t(p0 + i) * kvw);
      std::copy_n(qkv + std::ptrdiff_t(i) * ld_ + (hq_ + hkv_) * hd_, kvw, V + std::ptrdiff_t(p0 + i) * kvw);
    }
    const acc scale = static_cast<acc>(1.0 / std::sqrt(static_cast<double>(hd_)));
    const int group = hq_ / hkv_;
    scores_.resize(std::size_t(p0 + n));
    out_.resize(std::size_t(hd_));
    for (int i = 0; i < n; ++i) {
      const int keys = p0 + i + 1;  // causal: the cache and the new tokens up to this one
      for (int h = 0; h < hq_; ++h) {
        const T* q = qkv + std::ptrdiff_t(i) * ld_ + std::ptrdiff_t(h) * hd_;
        const std::ptrdiff_t kv0 = std::ptrdiff_t(h / group) * hd_;
        acc top = -std::numeric_limits<acc>::infinity();
        for (int t = 0; t < keys; ++t) {
          const T* k = K + std::ptrdiff_t(t) * kvw + kv0;
          acc dot = 0;
          for (int e = 0; e < hd_; ++e) dot += static_cast<acc>(q[e]) * static_cast<acc>(k[e]);
          scores_[std::size_t(t)] = dot * scale;
          top = std::max(top, scores_[std::size_t(t)]);
        }
        acc sum = 0;
        std::fill(out_.begin(), out_.end(), acc(0));
        for (int t = 0; t < keys; ++t) {
          const acc p = std::exp(scores_[std::size_t(t)] - top);
          sum += p;
          const T* v = V + std::ptrdiff_t(t) * kvw + kv0;
          for (int e = 0; e < hd_; ++e) out_[std::size_t(e)] += p * static_cast<acc>(v[e]);
        }
        T* o = core_.data() + std::ptrdiff_t(i) * hq_ * hd_ + std::ptrdiff_t(h) * hd_;
        for (int e = 0; e < hd_; ++e) o[e] = static_cast<T>(out_[std::size_t(e)] / sum);
      }
    }
    ops.matmul(core_.data(), w.proj_w, branch_.data(), n, d, hq_ * hd_, false, false);
    reduce(branch_.data(), std::size_t(n) * d);
    if (w.proj_b) ops.bias_add(branch_.data(), w.proj_b, branch_.data(), n, d);
  }

  //! out (n x d) = an MLP of f features per rank (GELU, or SwiGLU with gate and up fused) on the n rows of in; split
  //! over the tensor-parallel group when `split` (a dense or shared MLP), else whole on each rank (a routed expert).
  void mlp(const T* in, int n, const typename Mlp::Params& w, int f, T* out, bool split = true) {
    const auto& ops = m_.ops();
    const int d = s_.d_model, up = s_.gated() ? 2 * f : f;
    ops.matmul(in, w.fc_w, h_.data(), n, up, d, false, false);
    if (w.fc_b) ops.bias_add(h_.data(), w.fc_b, h_.data(), n, up);
    if (s_.gated()) ops.swiglu_forward(h_.data(), g_.data(), n, f);
    else ops.gelu_forward(h_.data(), g_.data(), std::size_t(n) * f);
    ops.matmul(g_.data(), w.proj_w, out, n, d, f, false, false);
    if (split) reduce(out, std::size_t(n) * d);
    if (w.proj_b) ops.bias_add(out, w.proj_b, out, n, d);
  }

  //! branch_ = the mixture of experts on ln_'s n rows: the shared experts (split over the group) plus each token's
  //! top-k routed experts (every one held whole by each rank), weighted as the router says.
  void experts(int n, const typename Block::Moe::Params& w) {
    const auto& ops = m_.ops();
    const int d = s_.d_model, E = s_.experts, f = s_.expert_width(), up = s_.gated() ? 2 * f : f;
    if (s_.shared_experts > 0) mlp(ln_.data(), n, w.shared, s_.shared_experts * f / tp, branch_.data());
    else ops.fill(branch_.data(), std::size_t(n) * d, T(0));
    ops.matmul(ln_.data(), w.router, router_.data(), n, E, d, false, false);
    const layers::RouterConfig dropless{E, s_.top_k, m_.options().moe.sigmoid, s_.renormalize, 0.0, 0.0, 0.0};
    const layers::Routing r = layers::route(router_.data(), n, dropless);
    const std::int64_t stride = std::int64_t{d} * up + std::int64_t{f} * d + (s_.bias ? up + d : 0);
    for (int t = 0; t < n; ++t) {  // one token at a time through each of its experts
      T* y = branch_.data() + std::ptrdiff_t(t) * d;
      for (int j = 0; j < s_.top_k; ++j) {
        const std::size_t a = std::size_t(t) * s_.top_k + j;
        T* at = w.experts + r.expert[a] * stride;
        T* proj = at + std::int64_t{d} * up + (s_.bias ? up : 0);
        const typename Mlp::Params e{at, s_.bias ? at + std::int64_t{d} * up : nullptr, proj,
                                     s_.bias ? proj + std::int64_t{f} * d : nullptr};
        mlp(ln_.data() + std::ptrdiff_t(t) * d, 1, e, f, routed_.data(), false);
        const acc weight = static_cast<acc>(r.weight[a]);
        for (int c = 0; c < d; ++c)
          y[c] = static_cast<T>(static_cast<acc>(y[c]) + weight * static_cast<acc>(routed_.data()[c]));
      }
    }
  }

  Model& m_;
  GptShape s_;
  int cap_, hd_, hq_, hkv_, ld_;
  layers::VocabSlice slice_;
  layers::Norm<T, Host> norm_;
  std::optional<layers::Rotary<T, Host>> rope_;
  std::vector<Tensor<T>> keys_, values_;  //!< per block: capacity x (local kv heads x head_dim)
  int len_ = 0, rows_ = 0;
  Tensor<T> x_, ln_, branch_, routed_, qkv_, core_, h_, g_, router_;
  Tensor<acc> mean_, rstd_;
  std::vector<acc> scores_, out_;
  std::vector<T> mine_, all_;  //!< this rank's logits of the last token, and every rank's
  std::vector<double> logits_;
};

}  // namespace loom::models
