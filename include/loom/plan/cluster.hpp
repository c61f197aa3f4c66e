// Where a run is planned: a cluster of nodes of devices, each device's calibrated rates (a roofline per class of
// operation: matrix products, attention, memory-bound element-wise work) and the links between devices inside a
// node and between nodes (alpha-beta: a latency per hop and a bandwidth per device and direction). Built-in
// descriptions of A100 80GB, H100 80GB and H200 nodes and of this CPU; a cluster file (JSON) gives any other, and
// loom-plan --calibrate writes one measured on this machine.
#pragma once

#include <loom/core/error.hpp>
#include <loom/plan/model.hpp>

#include <array>
#include <optional>
#include <string>
#include <string_view>

namespace loom::plan {

//! A link between the devices of a group: bytes per second per device and direction, seconds per hop.
struct Link {
  double bandwidth = 0;
  double latency = 0;
};

struct Cluster {
  std::string name;
  int devices_per_node = 8;
  double memory_bytes = 0;  //!< per device
  //! The share of memory_bytes a run can fill: the rest goes to the runtime's context, the communication library's
  //! buffers and the allocator's fragmentation (a GPU's 80 GiB holds about 72 GiB of tensors).
  double usable = 1.0;
  constexpr double usable_bytes() const { return memory_bytes * usable; }
  //! Peak FLOP/s per device by element type (f64, f32, bf16): dense matrix products, what MFU is measured against.
  std::array<double, 3> peak_flops{};
  double memory_bandwidth = 0;  //!< bytes/s per device
  //! What share of the peak each class reaches: large matrix products, attention's products (with its softmax),
  //! memory-bound element-wise work (of memory_bandwidth).
  double matmul_efficiency = 0.8, attention_efficiency = 0.5, memory_efficiency = 0.7;
  //! Fixed cost per operation launched (a kernel, a task), seconds.
  double launch = 5e-6;
  Link intra, inter;           //!< inside a node; between nodes (per device: its share of the node's NICs)
  double collective_base = 0;  //!< a collective's fixed latency (NCCL's base latency), seconds
  //! Whether collectives overlap computation at all on this cluster's backend (CPU ranks as threads share cores).
  double overlap_efficiency = 1.0;
  //! A host whose ranks (threads or processes) share its hardware threads: their number (0: one device per rank,
  //! as on GPUs). A device is then one hardware thread, and each rate above is one thread's; the ranks divide the
  //! threads among them (threads_per_rank), and where they are more than the threads, take turns.
  int shared_threads = 0;
  //! With shared_threads: what all of them reach over what one does, for matrix products, attention and
  //! element-wise work (a rank with k of T threads gets 1 + (k - 1)(speedup - 1)/(T - 1) times one thread's rate).
  std::array<double, 3> speedup{1, 1, 1};
  //! With shared_threads: a collective's latency per step when the ranks outnumber the threads (they take turns:
  //! a rank that waits for a peer's turn waits a scheduler's slice, not a memory's latency). 0: the link's.
  double oversubscribed_latency = 0;
  //! What a step's own work adds to its kernels' time (a model's glue between kernels, the trainer's tasks), as a
  //! factor on the compute rates; bench/plan_check.py measures it from one one-rank step of train_gpt.
  double compute_overhead = 1.0;

  constexpr double peak(Dtype d) const { return peak_flops[static_cast<std::size_t>(d)]; }
};

//! The built-in clusters: a100-80gb and h100-80gb (nodes of 8 with NVLink, 8 x 200 and 8 x 400 Gb/s InfiniBand),
//! h200 (H100's node with H200's memory), cpu (a 2-thread host, ranks as threads; loom-plan --calibrate measures
//! one).
inline std::optional<Cluster> cluster_named(std::string_view name) {
  if (name == "a100-80gb") {
    Cluster c;
    c.name = "a100-80gb", c.memory_bytes = 80.0 * (1 << 30), c.peak_flops = {19.5e12, 156e12, 312e12};
    c.memory_bandwidth = 2.0e12;
    c.matmul_efficiency = 0.74, c.attention_efficiency = 0.45, c.memory_efficiency = 0.75, c.launch = 4e-6;
    c.intra = {235e9, 3.4e-6};  // NVLink 3: 300 GB/s per direction, about 235 GB/s of bus bandwidth in NCCL
    c.inter = {23e9, 9.6e-6};   // 8 x HDR 200 Gb/s per node: 25 GB/s per GPU, about 23 measured
    c.collective_base = 8.4e-6, c.usable = 0.9;
    return c;
  }
  if (name == "h100-80gb" || name == "h200") {
    const bool h200 = name == "h200";
    Cluster c;
    c.name = std::string(name), c.memory_bytes = h200 ? 141e9 : 80.0 * (1 << 30);
    c.peak_flops = {67e12, 494e12, 989e12}, c.memory_bandwidth = h200 ? 4.8e12 : 3.35e12;
    c.matmul_efficiency = 0.62, c.attention_efficiency = 0.3, c.memory_efficiency = 0.75, c.launch = 3e-6;
    c.intra = {370e9, 3.4e-6};  // NVLink 4: 450 GB/s per direction, about 370 GB/s of ring bus bandwidth
    c.inter = {47e9, 9.6e-6};   // 8 x NDR 400 Gb/s per node: 46-48 GB/s per GPU measured
    c.collective_base = 8.4e-6, c.usable = 0.9;
    return c;
  }
  if (name == "cpu") {
    Cluster c;
    c.name = "cpu", c.devices_per_node = 2, c.memory_bytes = 24.0 * (1 << 30), c.peak_flops = {32e9, 64e9, 64e9};
    c.memory_bandwidth = 10e9, c.shared_threads = 2, c.speedup = {1.8, 1.0, 1.0};
    c.matmul_efficiency = 0.4, c.attention_efficiency = 0.15, c.memory_efficiency = 0.5, c.launch = 2e-6;
    c.intra = {4e9, 10e-6};
    c.inter = {4e9, 10e-6};
    c.collective_base = 20e-6;
    c.overlap_efficiency = 0.0;
    return c;
  }
  return std::nullopt;
}

inline constexpr std::string_view cluster_names = "a100-80gb, h100-80gb, h200, cpu";

}  // namespace loom::plan
