// The router of a mixture-of-experts layer, on the host: from each token's router logits (one per expert) the top-k
// experts and their combine weights, the capacity of each expert and which assignments it drops, the Switch
// load-balancing loss and the router z-loss; and the gradient of the logits from the weights' gradient and the two
// losses.
//
// - Softmax routing: p = softmax(logits); the k largest p (ties to the lower expert index); weights p_j / Σ_chosen p
//   (Mixtral's), or without renormalising, p_j themselves (DeepSeek-V2's, Qwen-MoE's norm_topk_prob = false).
// - Sigmoid routing (DeepSeek-V3): s = sigmoid(logits); the k largest s; weights s_j / Σ_chosen s. Its balance loss
//   takes the scores normalised over every expert, s / Σ s, as the probabilities.
// - Capacity: ceil(tokens × k / E × capacity_factor) assignments per expert (the mean load times the factor, as
//   Megatron-Core counts it; for top-1, Switch's tokens / E × factor); capacity_factor 0 is dropless. Assignments
//   are taken in order of choice rank, then token: every token's first choice before any second choice, so that a
//   token loses its first choice only to earlier tokens' first choices. An assignment over capacity is dropped: its
//   weight is zero and the token's other choices keep theirs (no renormalisation), so a token whose every choice is
//   dropped passes through the residual alone.
// - Switch load-balancing loss: aux = coeff · E · Σ_i f_i · P_i, f_i the fraction of the T·k assignments that chose
//   expert i (before capacity), P_i the mean probability of expert i over the tokens (ANCHORS.md).
// - Router z-loss: z = coeff · mean over tokens of logsumexp(logits)².
#pragma once

#include <loom/core/error.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace loom::layers {

struct RouterConfig {
  int experts = 8, top_k = 2;
  bool sigmoid = false;          //!< sigmoid scores (DeepSeek-V3) instead of the softmax
  bool renormalize = true;       //!< softmax weights renormalised over the chosen (sigmoid scores always are)
  double capacity_factor = 1.25;  //!< 0: dropless
  double aux_loss_coeff = 0.0, z_loss_coeff = 0.0;
};

//! What the router decided for T tokens: for each token its k choices in order (expert, weight, kept), and per
//! expert the assignments it takes.
struct Routing {
  int tokens = 0, top_k = 0, experts = 0;
  int capacity = -1;               //!< assignments per expert; -1: dropless
  std::vector<int> expert;         //!< T x k, the chosen experts, best first
  std::vector<double> weight;      //!< T x k, the combine weights (0 where dropped)
  std::vector<double> score;       //!< T x k, the weights before dropping (the gradient needs them)
  std::vector<char> kept;          //!< T x k
  std::vector<int> chose, load;    //!< per expert: assignments that chose it (before capacity), that it takes
  std::vector<double> probability;  //!< T x E, the probabilities the balance loss averages
  std::vector<double> lse;         //!< T, logsumexp of each token's logits
  double aux_loss = 0, z_loss = 0;  //!< each with its coefficient

  //! The fraction of the T·k assignments dropped.
  double dropped() const {
    const auto n = static_cast<double>(kept.size());
    return n == 0 ? 0.0 : static_cast<double>(std::count(kept.begin(), kept.end(), 0)) / n;
  }
  //! The largest expert load over the mean load (1: balanced).
  double imbalance() const {
    if (load.empty()) return 1.0;
    double total = 0;
    for (int l : load) total += l;
    const double mean = total / static_cast<double>(load.size());
    return mean == 0 ? 1.0 : *std::max_element(load.begin(), load.end()) / mean;
  }
};

//! The capacity of each of `experts` experts for `tokens` tokens choosing top_k each: ceil(tokens × top_k / experts
//! × factor), or -1 (dropless) for factor 0.
constexpr int expert_capacity(int tokens, int top_k, int experts, double factor) {
  LOOM_CHECK(factor >= 0, "the capacity factor must not be negative, got ", factor);
  if (factor == 0) return -1;
  const double x = static_cast<double>(tokens) * top_k / experts * factor - 1e-12;
  const int floor = static_cast<int>(x);
  return floor < x ? floor + 1 : floor;
}

//! Routes T tokens from their logits (T x E, row-major).
template <class T>
Routing route(const T* logits, int tokens, const RouterConfig& c) {
  const int E = c.experts, k = c.top_k;
  LOOM_CHECK(E >= 1 && k >= 1 && k <= E, "a router picks top_k of the experts: top_k ", k, " of ", E);
  Routing r;
  r.tokens = tokens, r.top_k = k, r.experts = E;
  r.capacity = expert_capacity(tokens, k, E, c.capacity_factor);
  const std::size_t n = std::size_t(tokens) * k;
  r.expert.resize(n), r.weight.resize(n), r.score.resize(n), r.kept.assign(n, 1);
  r.chose.assign(std::size_t(E), 0), r.load.assign(std::size_t(E), 0);
  r.probability.resize(std::size_t(tokens) * E), r.lse.resize(std::size_t(tokens));
  std::vector<double> s(static_cast<std::size_t>(E));
  std::vector<int> order(static_cast<std::size_t>(E));
  double z = 0;
  for (int t = 0; t < tokens; ++t) {
    const T* x = logits + std::size_t(t) * E;
    double m = -INFINITY;
    for (int e = 0; e < E; ++e) m = std::max(m, double(x[e]));
    double sum = 0;
    for (int e = 0; e < E; ++e) sum += std::exp(double(x[e]) - m);
    const double lse = m + std::log(sum);
    r.lse[std::size_t(t)] = lse, z += lse * lse;
    double total = 0;  // of the scores, for the sigmoid's probabilities
    for (int e = 0; e < E; ++e) {
      s[std::size_t(e)] = c.sigmoid ? 1.0 / (1.0 + std::exp(-double(x[e]))) : std::exp(double(x[e]) - lse);
      total += s[std::size_t(e)];
    }
    for (int e = 0; e < E; ++e)
      r.probability[std::size_t(t) * E + e] = c.sigmoid ? s[std::size_t(e)] / total : s[std::size_t(e)];
    for (int e = 0; e < E; ++e) order[std::size_t(e)] = e;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return s[std::size_t(a)] > s[std::size_t(b)]; });
    double chosen = 0;
    for (int j = 0; j < k; ++j) chosen += s[std::size_t(order[std::size_t(j)])];
    if (!c.sigmoid && !c.renormalize) chosen = 1;
    for (int j = 0; j < k; ++j) {
      const int e = order[std::size_t(j)];
      r.expert[std::size_t(t) * k + j] = e;
      r.score[std::size_t(t) * k + j] = s[std::size_t(e)] / chosen;
      ++r.chose[std::size_t(e)];
    }
  }
  // Capacity: first choices of every token, in token order, then second choices, ...
  for (int j = 0; j < k; ++j)
    for (int t = 0; t < tokens; ++t) {
      const std::size_t a = std::size_t(t) * k + j;
      int& load = r.load[std::size_t(r.expert[a])];
      if (r.capacity >= 0 && load >= r.capacity) r.kept[a] = 0;
      else ++load;
      r.weight[a] = r.kept[a] ? r.score[a] : 0.0;
    }
  if (c.aux_loss_coeff != 0 && tokens > 0) {
    double sum = 0;
    for (int e = 0; e < E; ++e) {
      double P = 0;
      for (int t = 0; t < tokens; ++t) P += r.probability[std::size_t(t) * E + e];
      sum += static_cast<double>(r.chose[std::size_t(e)]) / n * (P / tokens);
    }
    r.aux_loss = c.aux_loss_coeff * E * sum;
  }
  if (tokens > 0) r.z_loss = c.z_loss_coeff * z / tokens;
  return r;
}

//! The gradient of the logits (T x E, written) from dweight (T x k: the gradient of the kept weights; dropped ones
//! are ignored) and from the balance loss and the z-loss, both scaled by `scale` (1/m when m micro-batches make a
//! step, as their losses are).
template <class T>
void route_backward(const T* logits, const Routing& r, const RouterConfig& c, const double* dweight, double scale,
                    T* dlogits) {
  const int E = r.experts, k = r.top_k, tokens = r.tokens;
  const double n = static_cast<double>(tokens) * k;
  std::vector<double> g(static_cast<std::size_t>(E)), a(static_cast<std::size_t>(E));
  for (int e = 0; e < E; ++e)  // d aux / d P_i (t) = coeff E f_i / T
    a[std::size_t(e)] = tokens ? scale * c.aux_loss_coeff * E * r.chose[std::size_t(e)] / n / tokens : 0.0;
  for (int t = 0; t < tokens; ++t) {
    const T* x = logits + std::size_t(t) * E;
    std::fill(g.begin(), g.end(), 0.0);
    // The weights: w_j = s_j / Σ_chosen s; dL/ds_j = (dw_j - Σ_i dw_i w_i) / Σ_chosen s over the chosen.
    double dot = 0, chosen_sum = 0;
    for (int j = 0; j < k; ++j) {
      const std::size_t at = std::size_t(t) * k + j;
      if (r.kept[at]) dot += dweight[at] * r.score[at];
    }
    for (int j = 0; j < k; ++j) {
      const std::size_t at = std::size_t(t) * k + j;
      const int e = r.expert[at];
      const double dw = r.kept[at] ? dweight[at] : 0.0;
      if (c.sigmoid) {
        const double s = 1.0 / (1.0 + std::exp(-double(x[e])));
        chosen_sum += s;
        g[std::size_t(e)] += (dw - dot);  // divided by Σ_chosen s and times s(1 - s) below
      } else if (c.renormalize) {  // the renormalised softmax over the chosen is their softmax: w_j (dw_j - Σ w dw)
        g[std::size_t(e)] += r.score[at] * (dw - dot);
      } else {  // w_j = p_j: dlogit_e = p_e dw_e [e chosen] - p_e Σ_j p_j dw_j
        g[std::size_t(e)] += r.score[at] * dw;
      }
    }
    if (!c.sigmoid && !c.renormalize) {
      const double* p = r.probability.data() + std::size_t(t) * E;
      for (int e = 0; e < E; ++e) g[std::size_t(e)] -= p[e] * dot;
    }
    if (c.sigmoid)
      for (int j = 0; j < k; ++j) {
        const int e = r.expert[std::size_t(t) * k + j];
        const double s = 1.0 / (1.0 + std::exp(-double(x[e])));
        g[std::size_t(e)] *= s * (1 - s) / chosen_sum;
      }
    // The balance loss through the probabilities: softmax, or the sigmoid scores normalised over every expert.
    const double* p = r.probability.data() + std::size_t(t) * E;
    double pa = 0;
    for (int e = 0; e < E; ++e) pa += p[e] * a[std::size_t(e)];
    if (c.sigmoid) {
      double total = 0;
      for (int e = 0; e < E; ++e) total += 1.0 / (1.0 + std::exp(-double(x[e])));
      for (int e = 0; e < E; ++e) {
        const double s = 1.0 / (1.0 + std::exp(-double(x[e])));
        g[std::size_t(e)] += (a[std::size_t(e)] - pa) / total * s * (1 - s);
      }
    } else {
      for (int e = 0; e < E; ++e) g[std::size_t(e)] += p[e] * (a[std::size_t(e)] - pa);
    }
    // The z-loss: d/dlogit_e of coeff/T · lse² is coeff/T · 2 lse · softmax_e.
    const double lse = r.lse[std::size_t(t)];
    for (int e = 0; e < E; ++e)
      g[std::size_t(e)] += scale * c.z_loss_coeff / tokens * 2 * lse * std::exp(double(x[e]) - lse);
    for (int e = 0; e < E; ++e) dlogits[std::size_t(t) * E + e] = static_cast<T>(g[std::size_t(e)]);
  }
}

}  // namespace loom::layers
