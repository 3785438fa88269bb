// The per-rank timeline and its Chrome trace-event JSON (see include/mnist_mpi/report/timeline.hpp).
#include "mnist_mpi/report/timeline.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/hash.hpp"
#include "mnist_mpi/json.hpp"
#include "mnist_mpi/report/output.hpp"

namespace mnist_mpi {
namespace {

constexpr const char* kSpanNames[] = {"step",      "data",      "forward",    "backward",  "wait for bucket",
                                      "optimizer", "allreduce", "evaluation", "checkpoint"};
static_assert(sizeof kSpanNames / sizeof kSpanNames[0] == static_cast<std::size_t>(SpanKind::kCount));

template <class T>
void append_pod(std::vector<std::uint8_t>& out, const T& v) {
  const auto* p = reinterpret_cast<const std::uint8_t*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}

template <class T>
T read_pod(const std::uint8_t*& p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  p += sizeof(T);
  return v;
}

}  // namespace

const char* span_name(SpanKind kind) { return kSpanNames[static_cast<std::size_t>(kind)]; }

std::size_t timeline_capacity(std::int64_t steps, std::int64_t accumulation, std::size_t layers, std::size_t buckets,
                              std::int64_t evaluations, int world) {
  const double per_step = 2.0 + 3.0 * static_cast<double>(accumulation) + static_cast<double>(layers + 3 * buckets);
  const double need = per_step * static_cast<double>(steps) + 2.0 * static_cast<double>(evaluations) + 256.0;
  const std::size_t per_rank = kTimelineMaxGathered / static_cast<std::size_t>(std::max(world, 1));
  const double cap = static_cast<double>(std::min(kTimelineMaxSpans, per_rank));
  return static_cast<std::size_t>(std::min(need, cap));
}

Timeline::Timeline(int rank, std::size_t capacity, std::vector<std::string> layer_names)
    : rank_(rank), spans_(capacity), layer_names_(std::move(layer_names)) {}

void Timeline::full() {
  if (dropped_++ == 0)
    std::fprintf(stderr,
                 "mnist_mpi: timeline: rank %d's buffer of %zu spans is full; later spans are not recorded "
                 "(the timeline file covers the first part of the run)\n",
                 rank_, spans_.size());
}

// Note [Timeline clocks]
// Spans are stamped with each rank's std::chrono::steady_clock, which on Linux is CLOCK_MONOTONIC:
// one clock for the whole machine (time since boot), so ranks on rank 0's host need no
// correction at all, and their spans line up to the nanosecond. For ranks on other hosts the
// offset to rank 0 is measured at the start of the run: five rounds of (barrier, read the clock,
// allgather the readings); the offset is the median of (my reading - rank 0's reading). Its error
// is how far apart the ranks leave the barrier (microseconds on one switch, far below a step),
// and clocks drift apart by parts per million over the run. Time zero of the file is rank 0's
// clock at the last round.
void Timeline::align_clocks(Communicator& comm) {
  const auto world = static_cast<std::size_t>(comm.size());
  std::vector<std::uint64_t> got(world), hosts(world);
  comm.allgather(fnv1a(comm.host()), hosts);
  constexpr int kRounds = 5;
  std::vector<std::int64_t> diffs;
  for (int round = 0; round < kRounds; ++round) {
    comm.barrier();
    comm.allgather(static_cast<std::uint64_t>(ns(Clock::now())), got);
    diffs.push_back(static_cast<std::int64_t>(got[static_cast<std::size_t>(rank_)]) -
                    static_cast<std::int64_t>(got[0]));
    origin_ns_ = static_cast<std::int64_t>(got[0]);
  }
  std::sort(diffs.begin(), diffs.end());
  offset_ns_ = hosts[static_cast<std::size_t>(rank_)] == hosts[0] ? 0 : diffs[kRounds / 2];
}

// Long on purpose (Note [Why a function is long] in docs/style.md): one collective exchange then
// one pass that writes the trace file in its fixed order (metadata, then every rank's spans).
void Timeline::gather_and_write(Communicator& comm, OutputFile* out, const std::string& host) {
  // This rank's message: dropped count, host name, then its spans on rank 0's clock.
  std::vector<std::uint8_t> mine;
  mine.reserve(64 + host.size() + size_ * sizeof(Span));
  append_pod(mine, dropped_);
  append_pod(mine, static_cast<std::int64_t>(host.size()));
  mine.insert(mine.end(), host.begin(), host.end());
  for (std::size_t i = 0; i < size_; ++i) {
    Span s = spans_[i];
    s.begin_ns -= offset_ns_ + origin_ns_;
    s.end_ns -= offset_ns_ + origin_ns_;
    append_pod(mine, s);
  }
  std::vector<std::uint8_t> all;
  std::vector<std::int64_t> counts;
  comm.gather(mine, all, counts, 0);
  if (comm.rank() != 0 || out == nullptr || !out->open()) return;

  // Note [Streaming the timeline]
  // The file is one JSON document, but rank 0 may hold up to kTimelineMaxGathered spans: as one
  // nlohmann tree that would take gigabytes. So each trace event is built and written on its own
  // (one per line), and only the document's frame around them, constant text, is written as is.
  OutputFile& f = *out;  // after a failed write every call below does nothing (and the loops stop)
  f.write("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n");
  bool first = true;
  auto emit = [&](const Json& event) {
    if (!first) f.write(",\n");
    first = false;
    f.write(json_text(event));
  };
  const auto metadata = [](const char* name, std::size_t pid, std::size_t tid, const char* key, Json value) {
    Json e{{"name", name}, {"ph", "M"}, {"pid", pid}, {"tid", tid}};
    e["args"][key] = std::move(value);
    return e;
  };
  Json dropped_spans = Json::array();
  const std::uint8_t* p = all.data();
  std::vector<std::int64_t> lane_end;  // per communication lane: when its last span ended
  // One span event, reused: only the values change, assigned through references to them (no
  // lookup by name, and the name's string keeps its buffer).
  Json span{{"name", ""}, {"cat", ""}, {"ph", "X"}, {"pid", 0},
            {"tid", 0},   {"ts", 0},   {"dur", 0},  {"args", {{"step", 0}, {"index", 0}}}};
  std::string& span_name_text = span["name"].get_ref<std::string&>();
  std::string& span_cat = span["cat"].get_ref<std::string&>();
  Json &span_pid = span["pid"], &span_tid = span["tid"], &span_ts = span["ts"], &span_dur = span["dur"],
       &span_step = span["args"]["step"], &span_index = span["args"]["index"];
  for (std::size_t r = 0; r < counts.size() && !f.failed(); ++r) {
    const std::uint8_t* end = p + counts[r];
    const auto dropped = read_pod<std::int64_t>(p);
    const auto host_len = read_pod<std::int64_t>(p);
    const std::string rank_host(reinterpret_cast<const char*>(p), static_cast<std::size_t>(host_len));
    p += host_len;
    dropped_spans.push_back(dropped);
    emit(metadata("process_name", r, 0, "name", "rank " + std::to_string(r) + " (" + rank_host + ")"));
    emit(metadata("process_sort_index", r, 0, "sort_index", r));
    emit(metadata("thread_name", r, 0, "name", "compute"));
    // Allreduce spans of different buckets overlap in time; each goes to the first communication
    // lane (tid 1, 2, ...) that is free at its start, so spans on one row never overlap.
    lane_end.clear();
    for (; p < end && !f.failed(); p += sizeof(Span)) {
      Span s;
      std::memcpy(&s, p, sizeof(Span));
      std::size_t tid = 0;
      if (s.kind == SpanKind::kAllreduce) {
        std::size_t lane = 0;
        while (lane < lane_end.size() && lane_end[lane] > s.begin_ns) ++lane;
        if (lane == lane_end.size()) {
          lane_end.push_back(0);
          emit(metadata("thread_name", r, lane + 1, "name", "communication " + std::to_string(lane + 1)));
        }
        lane_end[lane] = s.end_ns;
        tid = lane + 1;
      }
      char name[192];
      if (s.kind == SpanKind::kBackward && s.index >= 0)
        std::snprintf(name, sizeof name, "backward %d %s", s.index,
                      static_cast<std::size_t>(s.index) < layer_names_.size()
                          ? layer_names_[static_cast<std::size_t>(s.index)].c_str()
                          : "");
      else if (s.kind == SpanKind::kAllreduce)
        std::snprintf(name, sizeof name, "allreduce bucket %d", s.index);
      else if (s.kind == SpanKind::kWait)
        std::snprintf(name, sizeof name, "wait for bucket %d", s.index);
      else if (s.kind == SpanKind::kOptimizer)
        std::snprintf(name, sizeof name, "optimizer bucket %d", s.index);
      else if (s.kind == SpanKind::kEvaluation)
        std::snprintf(name, sizeof name, "evaluation %s", s.index == 1 ? "test" : "validation");
      else
        std::snprintf(name, sizeof name, "%s", span_name(s.kind));
      span_name_text = name;
      span_cat = span_name(s.kind);
      span_pid = r;
      span_tid = tid;
      // Microseconds: n / 1e3 is the double nearest to n/1000, so it is written with 3 decimals at most.
      span_ts = json_number(static_cast<double>(s.begin_ns) / 1e3);
      span_dur = json_number(static_cast<double>(s.end_ns - s.begin_ns) / 1e3);
      span_step = s.step;
      span_index = s.index;
      emit(span);
    }
  }
  Json other{{"producer", "mnist_mpi " MNIST_MPI_VERSION},
             {"ranks", counts.size()},
             {"clock", "steady_clock, offsets to rank 0 measured at start (Note [Timeline clocks])"},
             {"dropped_spans", std::move(dropped_spans)}};
  f.write("\n],\"otherData\":");
  f.write(json_text(other));
  f.write("}\n");
  f.close();  // renames PATH.tmp onto PATH
}

}  // namespace mnist_mpi
