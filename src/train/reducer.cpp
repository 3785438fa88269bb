// Bucket planning and the overlapped gradient reduction (see include/mnist_mpi/train/reducer.hpp).
#include "mnist_mpi/train/reducer.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/comm/watchdog.hpp"

namespace mnist_mpi {

std::vector<Bucket> plan_buckets(const ModelSpec& spec, std::int64_t cap, std::int64_t first_cap) {
  MNIST_CHECK(cap > 0 && first_cap > 0, ExitCode::kUsage, "bucket caps must be positive");
  std::vector<Bucket> out;
  Bucket cur{0, 0, static_cast<int>(spec.layers.size())};
  auto limit = [&] { return out.empty() ? first_cap : cap; };
  for (const ParamTensor& p : spec.params) {  // in flat order: the last layer first
    std::int64_t pos = p.offset;
    const std::int64_t end = p.offset + p.size;
    while (pos < end) {
      // A tensor that does not fit in what is left of the bucket closes it, unless the bucket is
      // empty, in which case the tensor is split at the cap.
      if (cur.end > cur.begin && cur.end - cur.begin + (end - pos) > limit()) {
        out.push_back(cur);
        cur = Bucket{pos, pos, static_cast<int>(spec.layers.size())};
      }
      const std::int64_t take = std::min(end - pos, limit() - (cur.end - cur.begin));
      cur.end = pos + take;
      cur.ready_after_layer = std::min(cur.ready_after_layer, p.layer);
      pos += take;
      if (cur.end - cur.begin == limit() && pos < end) {
        out.push_back(cur);
        cur = Bucket{pos, pos, static_cast<int>(spec.layers.size())};
      }
    }
  }
  if (cur.end > cur.begin) out.push_back(cur);
  return out;
}

Reducer::Reducer(Communicator& comm, std::span<float> grads, std::vector<Bucket> buckets, bool overlap,
                 std::span<float> sharded_params, const CodecFactory& codec, Backend* backend)
    : comm_(comm),
      grads_(grads),
      buckets_(std::move(buckets)),
      overlap_(overlap),
      params_(sharded_params),
      gathers_(params_.empty() ? 0 : buckets_.size()),
      timings_(buckets_.size()) {
  MNIST_CHECK(params_.empty() || params_.size() == grads_.size(), ExitCode::kRuntime,
              "Reducer: the sharded parameters must match the gradient buffer");
  std::int64_t expect = 0;
  for (const Bucket& b : buckets_) {
    MNIST_CHECK(b.begin == expect && b.end > b.begin, ExitCode::kRuntime, "buckets must tile the gradient buffer");
    expect = b.end;
  }
  const auto total = static_cast<std::int64_t>(grads_.size());
  MNIST_CHECK(expect == total, ExitCode::kRuntime,
              "buckets must cover the whole gradient buffer: every gradient is averaged");
  for (std::size_t k = 0; k < buckets_.size(); ++k) mine_.push_back(shard(k, comm_.rank()));
  if (!overlap_ && !sharded()) {  // one sum of the whole buffer, no bucket's own
    whole_ = codec({&comm_, backend, grads_, 0, total, false, Shard{0, total}, true});
    return;
  }
  for (std::size_t k = 0; k < buckets_.size(); ++k) {
    const Bucket& b = buckets_[k];
    const Shard receives{mine_[k].begin - b.begin, mine_[k].end - b.begin};  // shard(k), within the bucket
    codecs_.push_back(
        codec({&comm_, backend, range(b.begin, b.end), b.begin, total, sharded(), receives, k + 1 == buckets_.size()}));
  }
}

std::span<float> Reducer::range(std::int64_t begin, std::int64_t end) const {
  return grads_.subspan(static_cast<std::size_t>(begin), static_cast<std::size_t>(end - begin));
}

// Note [Buckets start in index order]
// Collectives on one communicator must be started in the same order on every rank, or ranks match
// the wrong buckets (or deadlock). Buckets are therefore started strictly in index order, bucket
// k only after bucket k-1, and a bucket starts only when its own gradients are final: readiness
// depends on the layer reached in backward, which every rank reaches in the same order. This is
// DDP's rule too; the flat buffer in reverse layer order makes index order the order gradients are
// produced, so nothing waits for a later-ready bucket.
void Reducer::on_layer_done(int layer) {
  if (overlap_) start_ready(layer);
}

void Reducer::begin_step(std::int64_t step) {
  if (whole_) whole_->begin_step(step);
  for (const auto& c : codecs_) c->begin_step(step);
}

// Note [A codec's later collectives] (include/mnist_mpi/train/codec.hpp): the bucket before moves
// on just before the next one starts, and every bucket once backward is done.
void Reducer::start_ready(int layer) {
  while (next_ < buckets_.size() && buckets_[next_].ready_after_layer >= layer) {
    if (next_ > 0) codecs_[next_ - 1]->advance();
    timings_[next_].start = std::chrono::steady_clock::now();
    codecs_[next_]->start();
    ++next_;
  }
}

double Reducer::start_remaining() {
  const auto t0 = std::chrono::steady_clock::now();
  agreed_ = false;  // a new step's sums: its verdicts are not agreed on yet
  if (overlap_) {
    start_ready(-1);  // anything not yet started
    for (const auto& c : codecs_) c->advance();
  } else if (sharded()) {  // every bucket's shard, blocking: the shards are per bucket
    start_ready(-1);
    for (const auto& c : codecs_) c->advance();
    for (std::size_t k = buckets_.size(); k-- > 0;) wait_bucket(k);
  } else {  // one sum of the whole buffer
    whole_->start();
    whole_->advance();
    whole_->finish(nullptr);
    const auto t1 = std::chrono::steady_clock::now();
    for (BucketTiming& t : timings_) t = BucketTiming{t0, t1};
  }
  next_ = 0;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double Reducer::wait_bucket(std::size_t k) {
  MNIST_CHECK(k < buckets_.size(), ExitCode::kRuntime, "wait_bucket: no bucket " + std::to_string(k));
  if (whole_ || !codecs_[k]->in_flight()) return 0.0;  // --no-overlap: already summed
  const auto t0 = std::chrono::steady_clock::now();
  watch_set_bucket(static_cast<std::int64_t>(k));  // named by the collective watchdog
  codecs_[k]->finish(&timings_[k].end);
  watch_set_bucket(-1);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

ParamRange Reducer::shard(std::size_t k, int rank) const {
  const Bucket& b = buckets_.at(k);
  if (!sharded()) return {b.begin, b.end};
  const Shard s = shard_of(b.end - b.begin, rank, comm_.size());  // Note [Shards]
  return {b.begin + s.begin, b.begin + s.end};
}

std::vector<ParamRange> Reducer::owned() const { return owned(comm_.rank()); }

std::vector<ParamRange> Reducer::owned(int rank) const {
  std::vector<ParamRange> out;
  for (std::size_t k = 0; k < buckets_.size(); ++k)
    if (const ParamRange r = shard(k, rank); r.end > r.begin) out.push_back(r);
  return out;
}

// Gathers go to the communicator after the sums started before them and complete in start order
// with them; every rank starts them in bucket order after the same sums, so the order of the
// collectives is the same on every rank (Note [Buckets start in index order]).
void Reducer::start_gather(std::size_t k) {
  if (!sharded()) return;
  MNIST_CHECK(k == next_gather_ && k < buckets_.size() && !gathers_[k].active(), ExitCode::kRuntime,
              "start_gather: bucket " + std::to_string(k) + " out of order or already started");
  const Bucket& b = buckets_[k];
  gathers_[k] = comm_.start_allgather_shards(
      params_.subspan(static_cast<std::size_t>(b.begin), static_cast<std::size_t>(b.end - b.begin)));
  ++next_gather_;
}

double Reducer::finish_gathers(FunctionRef<void(std::int64_t, std::int64_t)> others_wrote) {
  if (!sharded()) return 0.0;
  while (next_gather_ < buckets_.size()) start_gather(next_gather_);  // not updated: the same bits
  next_gather_ = 0;
  // The gathers first: on the CPU the caller then sleeps in wait() while the communication thread
  // has the core, where a blocking collective beside it would spin against it.
  const double waited = wait_gathers();
  for (std::size_t k = 0; k < buckets_.size(); ++k) {  // the other ranks' shards, gathered
    others_wrote(buckets_[k].begin, mine_[k].begin);
    others_wrote(mine_[k].end, buckets_[k].end);
  }
  return waited;
}

bool Reducer::agree(StepGuard& guard) {
  if (!sharded()) return true;
  if (!agreed_) {
    verdict_ = guard.agree(comm_);
    agreed_ = true;
  }
  return verdict_;
}

double Reducer::wait_gathers() {
  const auto t0 = std::chrono::steady_clock::now();
  for (std::size_t k = gathers_.size(); k-- > 0;)  // in start order they complete: the last first
    if (gathers_[k].active()) comm_.wait(gathers_[k]);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// --no-overlap's whole-buffer codec (whole_) keeps the state of a run without overlap; the
// per-bucket codecs that of one with it. Either way the state is in flat order for a codec whose
// state is per element (bf16's residuals), so a checkpoint resumes under other buckets too. Every
// codec's own part comes first, in bucket order, then every codec's shared part (Note [Codec state
// on another number of ranks]).
std::int64_t Reducer::codec_state_size() const {
  std::int64_t n = 0;
  for_each_codec([&](GradientCodec& c) { n += static_cast<std::int64_t>(c.state().size()); });
  return n;
}

std::int64_t Reducer::codec_shared_state_size() const {
  std::int64_t n = 0;
  for_each_codec([&](GradientCodec& c) { n += c.shared_state_size(); });
  return n;
}

void Reducer::for_each_codec(FunctionRef<void(GradientCodec&)> f) const {
  if (whole_)
    f(*whole_);
  else
    for (const auto& c : codecs_) f(*c);
}

double Reducer::wire_bytes() const {
  double n = 0;
  bool known = true;
  for_each_codec([&](GradientCodec& c) {
    n += c.wire_bytes();
    known = known && c.wire_bytes() > 0;
  });
  return known ? n : 0.0;
}

// copy(codec's span, at) for each codec's own part, then for each codec's shared part; each
// codec's state() asked for once (at checkpoints and at resume only).
void Reducer::codec_state_parts(FunctionRef<void(std::span<float>, std::size_t)> copy) const {
  std::vector<std::pair<std::span<float>, std::size_t>> states;  // a codec's state, its own part's size
  for_each_codec([&](GradientCodec& c) {
    const std::span<float> s = c.state();
    states.emplace_back(s, s.size() - static_cast<std::size_t>(c.shared_state_size()));
  });
  std::size_t at = 0;
  for (const bool shared : {false, true})
    for (const auto& [s, own] : states) {
      const std::span<float> part = shared ? s.subspan(own) : s.first(own);
      copy(part, at);
      at += part.size();
    }
}

void Reducer::save_codec_state(std::span<float> out) const {
  MNIST_CHECK(static_cast<std::int64_t>(out.size()) == codec_state_size(), ExitCode::kRuntime,
              "Reducer: the codec state's size");
  codec_state_parts([&](std::span<float> part, std::size_t at) {
    std::copy(part.begin(), part.end(), out.begin() + static_cast<std::ptrdiff_t>(at));
  });
}

void Reducer::load_codec_state(std::span<const float> in) {
  MNIST_CHECK(static_cast<std::int64_t>(in.size()) == codec_state_size(), ExitCode::kRuntime,
              "Reducer: the codec state's size");
  codec_state_parts([&](std::span<float> part, std::size_t at) {
    std::copy_n(in.begin() + static_cast<std::ptrdiff_t>(at), part.size(), part.begin());
  });
  for_each_codec([](GradientCodec& c) { c.state_loaded(); });
}

void Reducer::gather_codec_state(int root) {
  const auto n = static_cast<std::size_t>(codec_state_size());
  if (n == 0) return;  // the same on every rank: the same codec
  codec_mine_.resize(n);
  save_codec_state(codec_mine_);
  comm_.gather({reinterpret_cast<const std::uint8_t*>(codec_mine_.data()), n * sizeof(float)}, codec_bytes_,
               codec_counts_, root);
  codec_all_.resize(codec_bytes_.size() / sizeof(float));
  if (!codec_bytes_.empty()) std::memcpy(codec_all_.data(), codec_bytes_.data(), codec_bytes_.size());
}

// Note [Codec state on another number of ranks]
// A codec's state belongs to its rank (bf16's residuals: what that rank's roundings left out). On
// as many ranks as the run that wrote the checkpoint, rank r takes rank r's state back: the resumed
// run is the straight one, bit for bit. On another number, what the next step must still send is
// the residuals' sum over the ranks (the sum is all the ranks' gradients ever reach), so rank 0
// takes that sum (added in rank order) and the others start from zero. What every rank holds alike
// (PowerSGD's warm-start factors: the state's last codec_shared_state_size() values) every rank
// takes from rank 0. A checkpoint without codec state (written by a run without such a codec)
// starts every rank from zero; a run whose codec keeps nothing ignores one that has it. The size
// of PowerSGD's state depends on the buckets (a matrix split across two is two), so a resume keeps
// the bucket sizes too.
void Reducer::restore_codec_state(std::int64_t ranks, std::int64_t shared, std::span<const float> all) {
  const auto n = static_cast<std::size_t>(codec_state_size());
  if (n == 0 || ranks == 0) return;
  MNIST_CHECK(all.size() == static_cast<std::size_t>(ranks) * n && shared == codec_shared_state_size(),
              ExitCode::kCheckpoint,
              "the checkpoint's gradient-codec state holds " + std::to_string(all.size() / static_cast<std::size_t>(ranks)) +
                  " values a rank, this run's codec keeps " + std::to_string(n) +
                  ": resume with the --grad-compression (and the --bucket-mb, --first-bucket-mb and "
                  "--no-overlap) of the run that wrote it");
  std::vector<float> mine(n, 0.0f);  // once, at resume
  const auto own = n - static_cast<std::size_t>(codec_shared_state_size());
  if (ranks == comm_.size()) {
    std::copy_n(all.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(comm_.rank()) * n), n, mine.begin());
  } else {
    if (comm_.rank() == 0)
      for (std::int64_t q = 0; q < ranks; ++q)
        for (std::size_t i = 0; i < own; ++i) mine[i] += all[static_cast<std::size_t>(q) * n + i];
    std::copy(all.begin() + static_cast<std::ptrdiff_t>(own), all.begin() + static_cast<std::ptrdiff_t>(n),
              mine.begin() + static_cast<std::ptrdiff_t>(own));
  }
  load_codec_state(mine);
}

double Reducer::finish() {
  double waited = start_remaining();
  // Sums complete in start order: once the last is done all are, so waiting for it first costs
  // one wake-up instead of one per bucket.
  for (std::size_t k = buckets_.size(); k-- > 0;) waited += wait_bucket(k);
  return waited;
}

}  // namespace mnist_mpi
