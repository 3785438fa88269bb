// The auto codec (--grad-compression auto[:RANK]; Note [A gradient codec] in
// include/mnist_mpi/train/codec.hpp): per bucket the float, bf16 or PowerSGD codec, chosen once
// from the measured link and backward's timing.
//
// Note [Choosing a codec per bucket from the link]
// Compression pays only where the link, not compute, bounds the step (Agarwal et al. 2021), and a
// bucket whose sum finishes while backward still runs costs nothing whatever its size. So the
// codec first sends floats and watches: for the steps before --compression-start-steps (at least
// kTimedSteps of them) every bucket's codec notes when its bucket was ready, relative to the first
// bucket; the last bucket is ready when backward ends. At the start step the ranks time sums of
// three sizes on the gradient communicator (the slowest rank's time of each) and fit a latency
// and a rate to them, and rank 0 chooses (choose_codecs, a pure function the tests call): from
// floats everywhere, where the last sum (each bucket's queued on the wire behind the one before)
// ends after backward, it takes the one change of one bucket's codec to bf16 or PowerSGD that ends
// it soonest, again and again, while a change still cuts the exposed time by more than 2 % of it
// and of backward's time (the codecs' compute is not in the model); then
// each bucket goes back to the least compression that ends the sums no later. So a bucket is
// compressed only where that shortens the step, and no more than it needs; compute the
// codecs add (PowerSGD's products) is not in the model. The choice is broadcast, so every rank
// runs the same codecs, printed (rank 0) and written to the metrics file, and kept in checkpoints
// with the state of every codec it may run, so a resume after the start step runs the same
// codecs; a run resumed before it chooses again from its own timing.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <vector>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/train/codec.hpp"

namespace mnist_mpi {

namespace {

// When the last bucket's sum ends, each queued on the wire behind the one before.
double last_end(const std::vector<BucketCosts>& buckets, const std::vector<int>& choice, LinkModel link) {
  double end = 0;
  for (std::size_t k = 0; k < buckets.size(); ++k) {
    const BucketCosts& b = buckets[k];
    const auto c = static_cast<std::size_t>(choice[k]);
    end = std::max(b.ready_s, end) + b.collectives[c] * link.latency_s + b.bytes[c] / link.bytes_per_s;
  }
  return end;
}

}  // namespace

std::vector<int> choose_codecs(const std::vector<BucketCosts>& buckets, double backward_s, LinkModel link) {
  std::vector<int> choice(buckets.size(), 0);
  double end = last_end(buckets, choice, link);
  for (;;) {  // the one change of one bucket's codec that ends the sums soonest, while it pays
    double best_end = end;
    std::size_t best_k = 0;
    int best_c = -1;
    for (std::size_t k = 0; k < buckets.size(); ++k) {
      const int was = choice[k];
      for (int c = was + 1; c < kAutoChoices; ++c) {
        choice[k] = c;
        const double e = last_end(buckets, choice, link);
        if (e < best_end) best_end = e, best_k = k, best_c = c;
      }
      choice[k] = was;
    }
    // A change must cut more than 2 % of the exposed time and more than 2 % of backward's: the
    // codecs' own compute (PowerSGD's products, bf16's rounding) is not in the model, and on a fast
    // link it costs more than the sliver of the last bucket's sum it would save.
    const double exposed = end - backward_s;
    if (best_c < 0 || end - best_end <= std::max({0.02 * exposed, 0.02 * backward_s, 1e-6})) break;
    choice[best_k] = best_c;
    end = best_end;
  }
  // Then each bucket back to the least compression that ends the sums no later.
  for (std::size_t k = 0; k < buckets.size(); ++k) {
    const int was = choice[k];
    for (int c = 0; c < was; ++c) {
      choice[k] = c;
      if (last_end(buckets, choice, link) <= end + 1e-9) break;
      choice[k] = was;
    }
  }
  return choice;
}

namespace {

constexpr std::int64_t kTimedSteps = 4;  // float steps timed before the choice (the first not counted)
constexpr std::int64_t kLinkSizes[] = {64 * 1024, 1024 * 1024, 4 * 1024 * 1024};  // bytes
constexpr int kLinkRepeats = 3;

// What the buckets' auto codecs of one reducer share: their timing, and the choice.
class AutoPlan {
 public:
  AutoPlan(Communicator& comm, std::int64_t start_step, int rank, CodecReport report)
      : comm_(comm),
        start_step_(start_step),
        rank_(rank),
        report_(std::move(report)),
        link_buffer_(static_cast<std::size_t>(kLinkSizes[std::size(kLinkSizes) - 1]) / sizeof(float)) {}

  int add(std::array<double, kAutoChoices> bytes) {
    bytes_.push_back(bytes);
    chosen_.push_back(-1);
    return static_cast<int>(bytes_.size()) - 1;
  }

  // Bucket 0's begin_step: the same point of the same step on every rank.
  void begin_step(std::int64_t step) {
    if (ready_.empty()) ready_.assign(bytes_.size() * static_cast<std::size_t>(kTimedSteps), 0.0);
    if (decided()) return;
    timed_step_ = step - first_step_;
    if (first_step_ < 0) {
      first_step_ = step;
      timed_step_ = 0;
    }
    if (step >= std::max(start_step_, first_step_ + kTimedSteps)) decide(step);
  }

  // A bucket started (bucket 0 at the step's time origin).
  void ready(int k, std::chrono::steady_clock::time_point t) {
    if (decided() || ready_.empty() || timed_step_ >= kTimedSteps) return;
    if (k == 0) origin_ = t;
    ready_[static_cast<std::size_t>(timed_step_) * bytes_.size() + static_cast<std::size_t>(k)] =
        std::chrono::duration<double>(t - origin_).count();
  }

  bool decided() const { return !chosen_.empty() && chosen_[0] >= 0; }
  int chosen(int k) const { return chosen_[static_cast<std::size_t>(k)]; }
  void restore(int k, int c) { chosen_[static_cast<std::size_t>(k)] = c; }

 private:
  void decide(std::int64_t step) {
    const std::size_t n = bytes_.size();
    std::vector<BucketCosts> costs(n);
    for (std::size_t k = 0; k < n; ++k) {  // the median over the timed steps but the first
      std::vector<double> t;
      for (std::int64_t s = 1; s < kTimedSteps; ++s) t.push_back(ready_[static_cast<std::size_t>(s) * n + k]);
      std::nth_element(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(t.size() / 2), t.end());
      costs[k].ready_s = t[t.size() / 2];
      costs[k].bytes = bytes_[k];
      costs[k].collectives = {1, 1, 2};
    }
    double backward = costs.back().ready_s;
    comm_.allreduce_max(std::span<double>(&backward, 1));  // the slowest rank's backward
    const LinkModel link = measure_link();
    std::vector<std::int64_t> choice(n, 0);
    if (comm_.rank() == 0) {
      const std::vector<int> c = choose_codecs(costs, backward, link);
      std::copy(c.begin(), c.end(), choice.begin());
    }
    comm_.broadcast(std::span<std::int64_t>(choice), 0);
    for (std::size_t k = 0; k < n; ++k) chosen_[k] = static_cast<int>(choice[k]);
    if (report_) {
      CodecChoiceReport r{step, link, backward, describe(step, link, backward), {}};
      for (std::size_t k = 0; k < n; ++k) r.buckets.push_back(name(chosen_[k]));
      report_(r);
    }
  }

  std::string name(int c) const {
    static constexpr const char* kNames[] = {"none", "bf16", "powersgd"};
    std::string s = kNames[c];
    if (c == 2) s.append(":").append(std::to_string(rank_));
    return s;
  }

  // Sums of three sizes, the slowest rank's median of each, and the latency and rate of the line
  // through them (least squares).
  LinkModel measure_link() {
    std::vector<float>& buf = link_buffer_;
    double sx = 0, sy = 0, sxx = 0, sxy = 0;
    for (const std::int64_t bytes : kLinkSizes) {
      const std::span<float> part(buf.data(), static_cast<std::size_t>(bytes) / sizeof(float));
      std::vector<double> t;
      for (int r = 0; r < kLinkRepeats; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        comm_.allreduce_sum(part);
        t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      std::sort(t.begin(), t.end());
      double m = t[t.size() / 2];
      comm_.allreduce_max(std::span<double>(&m, 1));
      const auto x = static_cast<double>(bytes);
      sx += x, sy += m, sxx += x * x, sxy += x * m;
    }
    const double k = static_cast<double>(std::size(kLinkSizes));
    const double slope = (k * sxy - sx * sy) / (k * sxx - sx * sx);
    const double latency = (sy - slope * sx) / k;
    return {std::max(latency, 1e-6), slope > 0 ? 1.0 / slope : 1e12};
  }

  std::string describe(std::int64_t step, LinkModel link, double backward) const {
    char head[200];
    std::snprintf(head, sizeof head,
                  "gradient codec (auto, at step %lld): the link sums at %.2f Gbit/s with %.0f us a sum (measured), "
                  "backward %.1f ms;",
                  static_cast<long long>(step), link.bytes_per_s * 8 / 1e9, link.latency_s * 1e6, backward * 1e3);
    std::string s = head;
    double wire = 0, floats = 0;
    for (std::size_t k = 0; k < chosen_.size(); ++k) {
      const int c = chosen_[k];
      s += (k == 0 ? " bucket " : ", ") + std::to_string(k) + " " + name(c);
      wire += bytes_[k][static_cast<std::size_t>(c)];
      floats += bytes_[k][0];
    }
    char tail[120];
    std::snprintf(tail, sizeof tail, "; %.2f MB a step on the wire instead of %.2f MB", wire / 1e6, floats / 1e6);
    return s + tail;
  }

  Communicator& comm_;
  std::int64_t start_step_;
  int rank_;  // PowerSGD's
  CodecReport report_;
  std::vector<std::array<double, kAutoChoices>> bytes_;  // per bucket, per choice
  std::vector<int> chosen_;                              // per bucket; -1 until the choice
  std::vector<double> ready_;                            // kTimedSteps x buckets: seconds after bucket 0
  std::chrono::steady_clock::time_point origin_;
  std::int64_t first_step_ = -1, timed_step_ = 0;
  std::vector<float> link_buffer_;  // measure_link's sums, made once
};

class AutoCodec final : public GradientCodec {
 public:
  AutoCodec(const CodecBinding& b, std::shared_ptr<AutoPlan> plan, const CodecArgs& args)
      : plan_(std::move(plan)) {
    codecs_[0] = float_codec()(b);
    codecs_[1] = bf16_codec()(b);
    codecs_[2] = powersgd_codec(args.rank, 0, args.seed, args.tensors)(b);
    std::array<double, kAutoChoices> bytes{};
    for (int c = 0; c < kAutoChoices; ++c) bytes[static_cast<std::size_t>(c)] = codecs_[c]->wire_bytes();
    k_ = plan_->add(bytes);
    // The state: every codec's own part, the PowerSGD factors, then the choice (shared).
    std::int64_t own = 0, shared = 0;
    for (const auto& c : codecs_) {
      shared += c->shared_state_size();
      own += static_cast<std::int64_t>(c->state().size()) - c->shared_state_size();
    }
    own_ = own;
    state_.assign(static_cast<std::size_t>(own + shared + 1), 0.0f);
  }

  void begin_step(std::int64_t step) override {
    if (k_ == 0) plan_->begin_step(step);
    for (const auto& c : codecs_) c->begin_step(step);
  }
  void start() override {
    plan_->ready(k_, std::chrono::steady_clock::now());
    current_ = codecs_[plan_->decided() ? plan_->chosen(k_) : 0].get();
    current_->start();
  }
  void advance() override {
    if (current_) current_->advance();
  }
  bool in_flight() const override { return current_ && current_->in_flight(); }
  void finish(std::chrono::steady_clock::time_point* completed) override {
    if (current_) current_->finish(completed);
  }
  // A copy, refreshed here: the codecs' own parts, then their shared parts, then the choice
  // (the reducer asks once a checkpoint and copies a checkpoint's in before state_loaded()).
  std::span<float> state() override {
    copy_state(true);
    return state_;
  }
  std::int64_t shared_state_size() const override { return static_cast<std::int64_t>(state_.size()) - own_; }
  void state_loaded() override {
    copy_state(false);
    const float c = state_.back();
    if (c >= 0 && c < kAutoChoices) plan_->restore(k_, static_cast<int>(c));
  }
  double wire_bytes() const override { return codecs_[plan_->decided() ? plan_->chosen(k_) : 0]->wire_bytes(); }

 private:
  void copy_state(bool out) {
    std::size_t at = 0;
    for (const bool shared : {false, true})
      for (const auto& c : codecs_) {
        const std::span<float> s = c->state();
        const auto mine = s.size() - static_cast<std::size_t>(c->shared_state_size());
        const std::span<float> part = shared ? s.subspan(mine) : s.first(mine);
        if (out)
          std::copy(part.begin(), part.end(), state_.begin() + static_cast<std::ptrdiff_t>(at));
        else
          std::copy_n(state_.begin() + static_cast<std::ptrdiff_t>(at), part.size(), part.begin());
        at += part.size();
      }
    if (out) state_.back() = plan_->decided() ? static_cast<float>(plan_->chosen(k_)) : -1.0f;
    if (!out)
      for (const auto& c : codecs_) c->state_loaded();
  }

  std::shared_ptr<AutoPlan> plan_;
  std::array<std::unique_ptr<GradientCodec>, kAutoChoices> codecs_;
  GradientCodec* current_ = nullptr;
  int k_ = 0;
  std::int64_t own_ = 0;
  std::vector<float> state_;
};

}  // namespace

CodecFactory auto_codec(const CodecArgs& args) {
  // One plan for the reducer's buckets, made with the first bucket's codec (bucket 0 is bound
  // first: the reducer binds them in order), so a factory used for a second reducer starts anew.
  auto plan = std::make_shared<std::shared_ptr<AutoPlan>>();
  return [plan, args](const CodecBinding& b) -> std::unique_ptr<GradientCodec> {
    if (b.offset == 0 || !*plan)
      *plan = std::make_shared<AutoPlan>(*b.comm, args.start_step, args.rank, args.report);
    return std::make_unique<AutoCodec>(b, *plan, args);
  };
}

}  // namespace mnist_mpi
