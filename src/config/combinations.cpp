// The options a run can combine (include/mnist_mpi/config/combinations.hpp): one row per refusal,
// its test and its message, which names both sides and the fix.
#include "mnist_mpi/config/combinations.hpp"

#include <algorithm>
#include <cstdint>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/spec_text.hpp"

namespace mnist_mpi {
namespace {

// Whether --model has a batch norm layer: a token whose kind (its first field) is "batchnorm", read
// as parse_model_spec reads it (include/mnist_mpi/spec_text.hpp). The spec itself is parsed where
// the input's shape is known (src/model/spec.cpp, a layer beside this one: docs/style.md).
bool batch_norm(const Options& o) {
  for (const std::string& token : split_spec_text(o.model, ','))
    if (split_spec_text(token, ':').front() == "batchnorm") return true;
  return false;
}

// The gradient codec's name: --grad-compression without its ":RANK".
std::string codec_name(const Options& o) { return o.grad_compression.substr(0, o.grad_compression.find(':')); }

// The global batch and the micro-batches it is cut into (ranks x accumulation steps), when the
// global batch is given (or the default); a per-rank --batch-size makes every micro-batch whole.
struct Cut {
  std::int64_t global = 0, parts = 1;
  bool uneven() const { return global % parts != 0; }
};
Cut cut_of(const Options& o, const RunPlace& p) {
  if (o.batch_size != 0) return {};
  return {o.global_batch_size != 0 ? o.global_batch_size : kDefaultGlobalBatch,
          std::int64_t{p.world} * std::max<std::int64_t>(o.accumulation_steps, 1)};
}

struct Combination {
  bool needs_place;  // a row about the machine the run found (checked by the trainer only)
  bool (*refuses)(const Options&, const RunPlace&);
  std::string (*message)(const Options&, const RunPlace&);
};

// In the order a user meets them: where the outputs go, then the numerics, then the GPU's.
constexpr Combination kCombinations[] = {
    {false, [](const Options& o, const RunPlace&) { return o.checkpoint_dir.empty() && o.resume == "auto"; },
     [](const Options&, const RunPlace&) -> std::string {
       return "--resume auto looks in --checkpoint-dir: give --checkpoint-dir DIR (or --resume FILE)";
     }},
    {false, [](const Options& o, const RunPlace&) { return o.checkpoint_dir.empty() && o.checkpoint_every > 0; },
     [](const Options&, const RunPlace&) -> std::string {
       return "--checkpoint-every needs --checkpoint-dir DIR to write into";
     }},
    {false, [](const Options& o, const RunPlace&) { return o.batch_size != 0 && o.global_batch_size != 0; },
     [](const Options&, const RunPlace&) -> std::string {
       return "give one of --batch-size (per rank) and --global-batch-size, not both";
     }},
    {false, [](const Options& o, const RunPlace&) { return o.exact_sums && o.precision == "bf16"; },
     [](const Options&, const RunPlace&) -> std::string {
       return "--precision bf16 with --exact-sums: the exact sums run the fp32 kernels only; drop one of them";
     }},
    {false, [](const Options& o, const RunPlace&) { return o.exact_sums && codec_name(o) == "bf16"; },
     [](const Options&, const RunPlace&) -> std::string {
       return "--grad-compression bf16 with --exact-sums: bf16 on the wire rounds every rank's gradient and every "
              "addition of the sum, so the parameters would depend on the number of ranks, which is what the exact "
              "sums exclude; drop one of them";
     }},
    {false,
     [](const Options& o, const RunPlace&) {
       return o.exact_sums && (codec_name(o) == "powersgd" || codec_name(o) == "auto");
     },
     [](const Options& o, const RunPlace&) -> std::string {
       return "--grad-compression " + codec_name(o) +
              " with --exact-sums: PowerSGD's factors are summed in floats so far, so the parameters would depend "
              "on the number of ranks, which is what the exact sums exclude; drop one of them";
     }},
    {true, [](const Options& o, const RunPlace& p) { return codec_name(o) != "none" && p.cuda; },
     [](const Options& o, const RunPlace&) -> std::string {
       return "--grad-compression " + o.grad_compression +
              " on a GPU: its codec runs on the CPU only so far; drop it (NCCL's float sums are the GPU's) or train "
              "with --device cpu";
     }},
    {false, [](const Options& o, const RunPlace&) { return o.exact_sums && batch_norm(o); },
     [](const Options&, const RunPlace&) -> std::string {
       return "batchnorm in --model with --exact-sums: batch statistics are taken over each rank's own images, so "
              "the gradients depend on how the global batch is cut among the ranks, which the exact sums exclude; "
              "drop --exact-sums or the batchnorm layers";
     }},
    // A shorter micro-batch is padded to the model's batch with rows whose loss gradient is zero,
    // which adds nothing to a sum, but batch statistics would take the padding in.
    // (Note [Uneven slices] in include/mnist_mpi/data/sampler.hpp)
    {true, [](const Options& o, const RunPlace& p) { return batch_norm(o) && cut_of(o, p).uneven(); },
     [](const Options& o, const RunPlace& p) -> std::string {
       const Cut c = cut_of(o, p);
       return "batchnorm in --model needs micro-batches of one size (its statistics would count a shorter one's "
              "padding): the global batch of " + std::to_string(c.global) + " does not divide into " +
              std::to_string(p.world) + " ranks x " + std::to_string(c.parts / p.world) +
              " accumulation steps; give a --global-batch-size that is a multiple of " + std::to_string(c.parts);
     }},
    {false, [](const Options& o, const RunPlace&) { return o.exact_sums && o.cuda_graph; },
     [](const Options&, const RunPlace&) -> std::string {
       return "--exact-sums with --cuda-graph: an exact step reads its sums' counters on the host and may compute "
              "the step again, which a CUDA graph cannot replay; drop --cuda-graph";
     }},
    {false, [](const Options& o, const RunPlace&) { return traits(o.optimizer.kind).two_phase && o.cuda_graph; },
     [](const Options& o, const RunPlace&) -> std::string {
       return std::string("--optimizer ") + name_of(o.optimizer.kind) +
              " with --cuda-graph: its per-tensor norms are summed and turned into rates on the host between the "
              "two phases of the update, which a CUDA graph cannot replay; drop --cuda-graph";
     }},
    {false, [](const Options& o, const RunPlace&) { return o.exact_sums && o.conv_algos == "measured"; },
     [](const Options&, const RunPlace&) -> std::string {
       return "--exact-sums with --conv-algos measured: algorithms chosen by timing could differ from run to run, "
              "and the bits with them; drop --conv-algos measured (cuDNN's heuristics, the default, choose the "
              "same deterministic ones every run)";
     }},
    // --exact-sums: a chunk's gradient must be the same bits on every rank, and the CPU kernels'
    // sums over threads are cut by the number of threads (measured: lenet, 1 and 2 threads, other
    // bits). A GPU rank's --threads changes none of its kernels.
    {true, [](const Options& o, const RunPlace& p) { return o.exact_sums && o.threads > 1 && !p.cuda; },
     [](const Options& o, const RunPlace&) -> std::string {
       return "--exact-sums computes with one thread per rank (the kernels' sums depend on the number of threads); "
              "drop --threads " + std::to_string(o.threads) + " and start more ranks to use more cores";
     }},
    {false, [](const Options& o, const RunPlace&) { return o.conv_algos == "measured" && o.device == "cpu"; },
     [](const Options&, const RunPlace&) -> std::string {
       return "--conv-algos measured times cuDNN's algorithms, and --device cpu has none (oneDNN chooses its own): "
              "drop it, or use --device cuda";
     }},
    {false, [](const Options& o, const RunPlace&) { return o.cuda_graph && o.device == "cpu"; },
     [](const Options&, const RunPlace&) -> std::string {
       return "--cuda-graph needs --device cuda (or auto on a machine with GPUs)";
     }},
    {true, [](const Options& o, const RunPlace& p) { return o.cuda_graph && !p.cuda; },
     [](const Options&, const RunPlace& p) -> std::string {
       return "--cuda-graph needs a GPU, and --device auto found none on " + p.host + ": drop --cuda-graph";
     }},
    {false, [](const Options& o, const RunPlace&) { return o.cuda_graph && !o.timeline_file.empty(); },
     [](const Options&, const RunPlace&) -> std::string {
       return "--timeline records each layer's host times, which a replayed CUDA graph does not have; drop "
              "--timeline or --cuda-graph";
     }},
    {false, [](const Options& o, const RunPlace&) { return o.cuda_graph && o.allow_gpu_sharing; },
     [](const Options&, const RunPlace&) -> std::string {
       return "--cuda-graph with --allow-gpu-sharing: ranks that share a GPU sum through host memory, which a "
              "CUDA graph cannot capture; drop one of them";
     }},
    {true, [](const Options& o, const RunPlace& p) { return o.cuda_graph && p.shared_gpus; },
     [](const Options&, const RunPlace&) -> std::string {
       return "--cuda-graph with ranks sharing a GPU: they sum through host memory, which a CUDA graph cannot "
              "capture; drop --cuda-graph or run one rank per GPU";
     }},
};

}  // namespace

void check_combinations(const Options& o, const RunPlace* place) {
  const RunPlace none;
  for (const Combination& c : kCombinations) {
    if (c.needs_place && !place) continue;
    const RunPlace& p = place ? *place : none;
    if (c.refuses(o, p)) throw_error(ExitCode::kUsage, c.message(o, p));
  }
}

}  // namespace mnist_mpi
