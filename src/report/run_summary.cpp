// The summary of a finished run (include/mnist_mpi/report/run_summary.hpp): its JSON, both ways, and
// the report's facts. Every key of the "final" event is written and read here, next to each other.
#include "mnist_mpi/report/run_summary.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/report/output.hpp"  // fmt
#include "mnist_mpi/report/ranks.hpp"   // straggler_text

namespace mnist_mpi {

double json_field_number(const Json& j, const char* key) {
  const auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : std::numeric_limits<double>::quiet_NaN();
}

// nlohmann's value() would cast a float such as 1e27 to an integer, undefined behaviour out of
// range (found by fuzz_metrics): refused here instead.
std::int64_t json_field_whole(const Json& j, const char* key, std::int64_t dflt) {
  const auto it = j.find(key);
  if (it == j.end()) return dflt;
  if (it->is_number_unsigned()) {
    const std::uint64_t u = it->get<std::uint64_t>();
    if (u <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) return static_cast<std::int64_t>(u);
  } else if (it->is_number_integer()) {
    return it->get<std::int64_t>();
  } else if (it->is_number_float()) {
    const double d = it->get<double>();
    if (d == std::floor(d) && std::fabs(d) < 9.2e18) return static_cast<std::int64_t>(d);
  }
  throw_error(ExitCode::kData, std::string("the field \"") + key + "\" is not a whole number of 64 bits");
}

std::vector<TimeShare> time_shares(double startup_s, const StepTiming& t) {
  return {{"start-up", startup_s},    {"data", t.data},
          {"forward", t.forward},     {"backward", t.backward},
          {"exposed communication", t.exposed_comm}, {"optimizer", t.optimizer}};
}

Json step_ms_json(const StepTiming& t) {
  return Json{{"data", json_number(1e3 * t.data)},
              {"forward", json_number(1e3 * t.forward)},
              {"backward", json_number(1e3 * t.backward)},
              {"exposed_comm", json_number(1e3 * t.exposed_comm)},
              {"optimizer", json_number(1e3 * t.optimizer)}};
}

StepTiming step_ms_of(const Json& j) {
  const auto it = j.find("step_ms");
  if (it == j.end() || !it->is_object()) return {};
  return StepTiming{.data = json_field_number(*it, "data") / 1e3,
                    .forward = json_field_number(*it, "forward") / 1e3,
                    .backward = json_field_number(*it, "backward") / 1e3,
                    .exposed_comm = json_field_number(*it, "exposed_comm") / 1e3,
                    .optimizer = json_field_number(*it, "optimizer") / 1e3};
}

Json rank_json(const RankTimes& r) {
  return Json{{"rank", r.rank},
              {"host", r.host},
              {"compute_ms", json_number(1e3 * r.compute())},
              {"wait_ms", json_number(1e3 * r.per_step.exposed_comm)},
              {"step_ms", step_ms_json(r.per_step)}};
}

std::vector<RankTimes> ranks_of(const Json& event) {
  std::vector<RankTimes> out;
  const auto it = event.find("ranks");
  if (it == event.end() || !it->is_array()) return out;
  for (const Json& r : *it) {
    RankTimes t;
    t.rank = static_cast<int>(json_field_whole(r, "rank", 0));
    t.host = r.value("host", std::string());
    t.per_step = step_ms_of(r);
    out.push_back(t);
  }
  return out;
}

Json RunSummary::final_event() const {
  const FinalFacts& f = end;
  const CheckpointStats& c = f.checkpoints;
  Json rss = Json::array();
  for (const std::uint64_t kib : f.peak_rss_kib) rss.push_back(json_number(static_cast<double>(kib) / 1024.0));
  const double written = static_cast<double>(c.written);
  Json event{{"event", "final"},
             {"test_accuracy", json_number(f.test_accuracy)},
             {"test_loss", json_number(f.test_loss)},
             {"steps", f.steps},
             {"epochs", json_number(f.epochs)},
             {"world_size", world_size},
             {"global_batch", global_batch},
             {"wall_s", json_number(f.wall_s)},
             {"images_per_s", json_number(f.images_per_s)},
             {"startup_s", json_number(f.startup_s)},
             {"eval_s", json_number(f.eval_s)},
             {"peak_rss_mb", std::move(rss)},
             {"step_ms", step_ms_json(f.per_step)},
             {"reduced_bytes_per_step", json_number(f.per_step.reduced_bytes)},
             {"buckets", buckets},
             {"skipped_steps", f.skipped_steps},
             {"exact_chunk", f.exact_chunk},
             {"exact_sum_probes", f.exact_sum_probes},
             {"params_hash", f.params_hash},
             {"checkpoints",
              {{"written", c.written},
               {"bytes", json_number(c.bytes)},
               {"capture_ms", json_number(c.written ? c.capture_ms / written : 0.0)},
               {"write_ms", json_number(c.written ? c.write_ms / written : 0.0)},
               {"others_wait_ms", json_number(c.others_wait_ms)},
               {"others_wait_baseline_ms", json_number(c.others_wait_baseline_ms)}}}};
  Json ranks = Json::array();
  for (const RankTimes& r : f.ranks) ranks.push_back(rank_json(r));
  event["ranks"] = std::move(ranks);
  const Straggler& s = f.straggler;
  event["straggler"] = s.rank < 0 ? Json(nullptr)
                                  : Json{{"rank", s.rank},
                                         {"host", s.host},
                                         {"phase", s.phase},
                                         {"slower", json_number(s.slower)},
                                         {"phase_slower", json_number(s.phase_slower)},
                                         {"others_waited_s", json_number(s.others_waited_s)}};
  if (f.target.accuracy > 0) {
    const TargetFacts& g = f.target;
    event["target"] =
        Json{{"accuracy", json_number(g.accuracy)},
             {"reached", g.reached},
             {"step", g.reached ? Json(g.step) : Json(nullptr)},
             {"validation_accuracy", g.reached ? json_number(g.validation_accuracy) : Json(nullptr)},
             {"time_from_process_start_s", g.reached ? json_number(g.time_from_process_start_s) : Json(nullptr)}};
  }
  event["process_s"] = json_number(process_s);
  Json shares = Json::object();
  for (const TimeShare& t : time) shares[t.name] = json_number(t.seconds);
  event["time_s"] = std::move(shares);
  return event;
}

RunSummary RunSummary::from_events(const Json& start, const Json& f) {
  RunSummary s;
  s.config = start.value("config", std::string());
  s.model = start.value("model", std::string());
  s.precision = start.value("precision", std::string());
  s.optimizer = start.value("optimizer", std::string());
  s.exact_sums = start.value("exact_sums", false);
  s.seed = static_cast<std::uint64_t>(json_field_whole(start, "seed", 0));
  s.world_size = json_field_whole(start, "world_size", 0);
  s.global_batch = json_field_whole(start, "global_batch", 0);
  s.steps_per_epoch = json_field_whole(start, "steps_per_epoch", 0);

  FinalFacts& e = s.end;
  e.model = s.model;
  e.test_accuracy = json_field_number(f, "test_accuracy");
  e.test_loss = json_field_number(f, "test_loss");
  e.steps = json_field_whole(f, "steps", 0);
  e.epochs = json_field_number(f, "epochs");
  e.wall_s = json_field_number(f, "wall_s");
  e.images_per_s = json_field_number(f, "images_per_s");
  e.startup_s = json_field_number(f, "startup_s");
  e.eval_s = json_field_number(f, "eval_s");
  if (const auto it = f.find("peak_rss_mb"); it != f.end() && it->is_array())
    for (const Json& mb : *it)
      // Clamped before the cast: a double out of the integer's range would be undefined behaviour.
      e.peak_rss_kib.push_back(mb.is_number() ? static_cast<std::uint64_t>(std::clamp(mb.get<double>(), 0.0, 1e15) * 1024.0) : 0);
  e.per_step = step_ms_of(f);
  e.per_step.reduced_bytes = json_field_number(f, "reduced_bytes_per_step");
  s.buckets = json_field_whole(f, "buckets", 0);
  e.skipped_steps = json_field_whole(f, "skipped_steps", 0);
  e.exact_chunk = json_field_whole(f, "exact_chunk", 0);
  e.exact_sum_probes = json_field_whole(f, "exact_sum_probes", 0);
  e.params_hash = f.value("params_hash", std::string());
  if (const auto it = f.find("checkpoints"); it != f.end() && it->is_object()) {
    CheckpointStats& c = e.checkpoints;
    c.written = json_field_whole(*it, "written", 0);
    c.bytes = json_field_number(*it, "bytes");
    c.capture_ms = json_field_number(*it, "capture_ms") * static_cast<double>(c.written);  // totals, as the trainer's
    c.write_ms = json_field_number(*it, "write_ms") * static_cast<double>(c.written);
    c.others_wait_ms = json_field_number(*it, "others_wait_ms");
    c.others_wait_baseline_ms = json_field_number(*it, "others_wait_baseline_ms");
  }
  e.ranks = ranks_of(f);
  if (const auto it = f.find("straggler"); it != f.end() && it->is_object()) {
    Straggler& g = e.straggler;
    g.rank = static_cast<int>(json_field_whole(*it, "rank", -1));
    g.host = it->value("host", std::string());
    g.phase = it->value("phase", std::string());
    g.slower = json_field_number(*it, "slower");
    g.phase_slower = json_field_number(*it, "phase_slower");
    g.others_waited_s = json_field_number(*it, "others_waited_s");
  }
  if (const auto it = f.find("target"); it != f.end() && it->is_object()) {
    TargetFacts& g = e.target;
    g.accuracy = json_field_number(*it, "accuracy");
    g.reached = it->value("reached", false);
    if (g.reached) {
      g.step = json_field_whole(*it, "step", 0);
      g.validation_accuracy = json_field_number(*it, "validation_accuracy");
      g.time_from_process_start_s = json_field_number(*it, "time_from_process_start_s");
    }
  }
  s.process_s = json_field_number(f, "process_s");
  if (const auto it = f.find("time_s"); it != f.end() && it->is_object()) {
    for (const auto& [name, seconds] : it->items())
      s.time.push_back({name, seconds.is_number() ? seconds.get<double>() : std::nan("")});
  } else {  // an earlier version's file: the phases from the means per step
    const StepTiming& t = e.per_step;
    const double n = static_cast<double>(e.steps);
    s.time = time_shares(e.startup_s, StepTiming{.data = t.data * n, .forward = t.forward * n, .backward = t.backward * n,
                                                 .exposed_comm = t.exposed_comm * n, .optimizer = t.optimizer * n});
  }
  return s;
}

std::string RunSummary::straggler_line() const { return straggler_text(end.ranks, end.straggler); }

std::vector<std::pair<std::string, std::string>> RunSummary::facts() const {
  return {{"config", config.empty() ? "(none)" : config},
          {"model", model},
          {"ranks", std::to_string(world_size)},
          {"global batch", std::to_string(global_batch)},
          {"precision", precision},
          {"optimizer", optimizer},
          {"exact sums", exact_sums ? "on" : "off"},
          {"seed", std::to_string(seed)},
          {"steps", std::to_string(end.steps) + " (" + fmt("%.2f", end.epochs) + " epochs)"},
          {"test accuracy", fmt("%.4f", end.test_accuracy)},
          {"test loss", fmt("%.4f", end.test_loss)},
          {"images/s (steady)", fmt("%.0f", end.images_per_s)},
          {"wall time of training", fmt("%.2f s", end.wall_s)},
          {"straggler", straggler_line()},
          {"params_hash", end.params_hash}};
}

}  // namespace mnist_mpi
