// The HTML report (see include/mnist_mpi/report/html_report.hpp): charts drawn here as SVG paths,
// so the page needs nothing but a browser.
#include "mnist_mpi/report/html_report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <optional>
#include <sstream>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/json.hpp"
#include "mnist_mpi/report/output.hpp"

namespace mnist_mpi {
namespace {

std::string esc(const std::string& s) {  // for HTML text
  std::string o;
  for (char c : s) {
    switch (c) {
      case '&':
        o += "&amp;";
        break;
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '"':
        o += "&quot;";
        break;
      default:
        o += c;
    }
  }
  return o;
}

struct Series {
  std::string name, color;
  std::vector<std::pair<double, double>> points;  // (step, value)
  bool markers = false;
  std::string dash;  // an SVG stroke-dasharray ("" solid): the split, where colours are runs
};

// How a chart's values are written (Note [Charts people can read]).
enum class Unit { kPlain, kFraction, kRate, kMs };

}  // namespace

// Note [Charts people can read]
// Ticks fall on round values, 1, 2 or 5 times a power of ten, about five to an axis (nice_ticks),
// and the axis is widened to the ticks around the data, so a reader never has to interpolate
// between 0.5969 and 7.286e+04. Values are written as people write them (format_value): 72.9k
// images/s, 98.2 %, 12.5 ms, 0.05; the step axis is ticked the same way and every epoch's end is
// marked. Every chart has axis titles and a legend naming each line and its split, and spans the
// page's width (a viewBox, scaled by the browser).
std::vector<double> nice_ticks(double lo, double hi, int target) {
  if (!(hi > lo) || !std::isfinite(lo) || !std::isfinite(hi)) return {lo};
  const double raw = (hi - lo) / std::max(1, target);
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  double step = 10 * p;
  for (const double m : {1.0, 2.0, 5.0})
    if (m * p >= raw) {
      step = m * p;
      break;
    }
  // k * step for whole k (not a running sum, whose error grows with each tick), from below lo to
  // at or above hi.
  std::vector<double> t;
  const double first = std::floor(lo / step), last = std::ceil(hi / step);
  for (double k = first; k <= last && t.size() <= 50; ++k) t.push_back(k == 0 ? 0.0 : k * step);
  return t;
}

// Note [An axis of a fraction]
// Accuracy is a fraction: its axis never passes 100 % nor goes below 0 %, which no value can be.
// Like every value axis it is zoomed to the data, but over at least kFractionSpan, centred on the
// data and moved inside [0, 1] where it would pass an end, so that one evaluation (or a flat
// series) gets a few round ticks around it, not an axis of zero height or one padded past 100 %.
// Other axes with one value are padded by half a unit or a tenth of the value, whichever is more.
std::vector<double> axis_ticks(double lo, double hi, int unit_kind) {
  if (static_cast<Unit>(unit_kind) != Unit::kFraction) {
    if (hi == lo) {
      lo -= std::max(0.5, std::fabs(lo) * 0.1);
      hi += std::max(0.5, std::fabs(hi) * 0.1);
    }
    return nice_ticks(lo, hi, 5);
  }
  constexpr double kFractionSpan = 0.02;  // two percentage points
  lo = std::clamp(lo, 0.0, 1.0);
  hi = std::clamp(hi, 0.0, 1.0);
  if (hi - lo < kFractionSpan) {
    lo = std::clamp((lo + hi - kFractionSpan) / 2, 0.0, 1.0 - kFractionSpan);
    hi = lo + kFractionSpan;
  }
  // The ticks, from the last at or below lo to the first at or above hi, stay within [0, 1]: over a
  // span of at most 1 the step is at most 0.2 (1, 2 or 5 times a negative power of ten), which
  // divides 1, so 1 is a tick.
  return nice_ticks(lo, hi, 5);
}

// Note [A bounded sample that keeps the extremes]
// A long run logs many more points than a chart has columns of pixels: drawn one by one they make a
// page of megabytes that a browser is slow to open, for a line no finer than the pixels. So a
// series is drawn from a bounded sample: its step range is cut into `buckets` equal ranges, and of
// each range its first, last, lowest and highest points are kept (and its first that is not a
// number, so a gap in the line still shows). Drawn in order, those make the same line as every
// point, down to a range's width (the M4 aggregation, Jugel et al., VLDB 2014): a loss spike of
// one step is still drawn to its height, where an evenly spaced or random sample (TensorBoard's
// reservoir) would most likely drop it. A series that fits in four points a range is drawn whole.
// kBuckets is about one range per pixel column of a chart at the page's widest, so thinner ranges
// would draw nothing more; at that, a series of a long run draws a few thousand points.
std::vector<std::size_t> bounded_sample(const std::vector<std::pair<double, double>>& points, std::size_t buckets) {
  std::vector<std::size_t> kept(points.size());
  std::iota(kept.begin(), kept.end(), std::size_t{0});
  if (points.size() <= 4 * buckets) return kept;
  kept.clear();
  const auto by_step = [](const auto& a, const auto& b) { return a.first < b.first; };
  const auto [lo, hi] = std::minmax_element(points.begin(), points.end(), by_step);
  const double x0 = lo->first, span = hi->first - lo->first;
  const auto bucket = [&](double x) {
    return span > 0 ? std::min(buckets - 1, static_cast<std::size_t>((x - x0) / span * static_cast<double>(buckets)))
                    : 0;
  };
  // A run of consecutive points in one range at a time: one per range, the points being in step
  // order as a run logs them.
  constexpr std::size_t kNone = static_cast<std::size_t>(-1);
  for (std::size_t begin = 0, end = 0; begin < points.size(); begin = end) {
    const std::size_t b = bucket(points[begin].first);
    std::size_t low = kNone, high = kNone, gap = kNone;
    for (end = begin; end < points.size() && bucket(points[end].first) == b; ++end) {
      const double y = points[end].second;
      if (!std::isfinite(y)) {
        if (gap == kNone) gap = end;
      } else {
        if (low == kNone || y < points[low].second) low = end;
        if (high == kNone || y > points[high].second) high = end;
      }
    }
    std::size_t picks[] = {begin, low, high, gap, end - 1};
    std::sort(std::begin(picks), std::end(picks));  // kNone last
    for (const std::size_t i : picks)
      if (i != kNone && (kept.empty() || kept.back() != i)) kept.push_back(i);
  }
  return kept;
}

std::string format_value(double v, int unit_kind, double step) {
  const auto unit = static_cast<Unit>(unit_kind);
  // Enough decimals to tell ticks `step` apart, no more.
  const auto decimals = [](double s) { return std::clamp(static_cast<int>(-std::floor(std::log10(s) + 1e-9)), 0, 6); };
  char b[64];
  switch (unit) {
    case Unit::kFraction:
      std::snprintf(b, sizeof b, "%.*f %%", step > 0 ? decimals(100 * step) : 1, 100 * v);
      return b;
    case Unit::kMs:
      std::snprintf(b, sizeof b, "%.*f ms", step > 0 ? decimals(step) : 2, v);
      return b;
    case Unit::kRate:
    case Unit::kPlain:
      break;
  }
  const double a = std::fabs(v);
  if (unit == Unit::kRate || a >= 1e4) {
    const char* suffix = a >= 1e9 ? "G" : a >= 1e6 ? "M" : a >= 1e3 ? "k" : "";
    const double scale = a >= 1e9 ? 1e9 : a >= 1e6 ? 1e6 : a >= 1e3 ? 1e3 : 1;
    std::snprintf(b, sizeof b, "%.*f%s", step > 0 ? decimals(step / scale) : 1, v / scale, suffix);
    return b;
  }
  std::snprintf(b, sizeof b, "%.*f", step > 0 ? decimals(step) : 3, v);
  return b;
}

namespace {

constexpr double kW = 960;  // the viewBox's width; the page scales it to its own
// Note [A bounded sample that keeps the extremes]: a plot is 832 of kW's units wide, in a page at
// most 1100 px wide, so about 950 px.
constexpr std::size_t kBuckets = 1000;

// A line chart: nice ticks on both axes, axis titles, epoch marks, a legend row under the title.
std::string line_chart(const std::string& title, const std::string& y_title, Unit unit, const std::vector<Series>& series,
                       std::int64_t steps_per_epoch) {
  constexpr double L = 84, R = 44, B = 52;
  // The legend's rows (it flows under the title) push the plot down.
  const auto legend_width = [](const Series& s) { return 30 + 6.6 * static_cast<double>(s.name.size()); };
  int rows = 1;
  for (double x = L; const Series& s : series) {
    if (s.points.empty()) continue;
    if (x + legend_width(s) > kW - R && x > L) {
      x = L;
      ++rows;
    }
    x += legend_width(s);
  }
  const double T = 48 + 14.0 * (rows - 1), H = 272 + T;
  double x0 = 1e300, x1 = -1e300, y0 = 1e300, y1 = -1e300;
  for (const Series& s : series)
    for (auto [x, y] : s.points) {
      if (!std::isfinite(y)) continue;
      x0 = std::min(x0, x);
      x1 = std::max(x1, x);
      y0 = std::min(y0, y);
      y1 = std::max(y1, y);
    }
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"chart\" data-title=\"" << esc(title) << "\" viewBox=\"0 0 "
    << kW << ' ' << H << "\" role=\"img\"><title>" << esc(title) << "</title>"
    << "<text x=\"" << L << "\" y=\"18\" class=\"t\">" << esc(title) << "</text>";
  if (x0 > x1) {
    o << "<text x=\"" << kW / 2 << "\" y=\"" << H / 2 << "\" text-anchor=\"middle\">no data</text></svg>";
    return o.str();
  }
  if (x1 == x0) {  // one step (an evaluation at the end): from step 0 to it
    x0 = std::min(0.0, x0);
    if (x1 == x0) x1 = x0 + 1;
  }
  const std::vector<double> yt = axis_ticks(y0, y1, static_cast<int>(unit));  // Note [An axis of a fraction]
  std::vector<double> xt = nice_ticks(x0, x1, 8);
  if (xt.size() > 1 && xt[1] - xt[0] < 1) xt = nice_ticks(x0, std::max(x1, x0 + 8), 8);  // steps are whole
  const double ys = yt.size() > 1 ? yt[1] - yt[0] : 0, xs = xt.size() > 1 ? xt[1] - xt[0] : 0;
  y0 = yt.front();
  y1 = yt.back();
  x0 = std::min(x0, xt.front());
  x1 = std::max(x1, xt.back());
  auto px = [&](double x) { return L + (x - x0) / (x1 - x0) * (kW - L - R); };
  auto py = [&](double y) { return T + (y1 - y) / (y1 - y0) * (H - T - B); };
  char b[256];
  for (const double y : yt) {
    std::snprintf(b, sizeof b,
                  "<line class=\"grid-y\" data-value=\"%g\" x1=\"%g\" x2=\"%g\" y1=\"%.1f\" y2=\"%.1f\" "
                  "stroke=\"#e6e6e6\"/>",
                  y, L, kW - R, py(y), py(y));
    o << b << "<text class=\"tick-y\" x=\"" << L - 6 << "\" y=\"" << py(y) + 4 << "\" text-anchor=\"end\">"
      << esc(format_value(y, static_cast<int>(unit), ys)) << "</text>";
  }
  for (const double x : xt) {
    if (x < x0 - 1e-9 || x > x1 + 1e-9) continue;
    std::snprintf(b, sizeof b, "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%g\" y2=\"%g\" stroke=\"#999\"/>", px(x), px(x),
                  H - B, H - B + 5);
    o << b << "<text class=\"tick-x\" x=\"" << px(x) << "\" y=\"" << H - B + 18 << "\" text-anchor=\"middle\">"
      << esc(format_value(x, static_cast<int>(Unit::kPlain), xs)) << "</text>";
  }
  if (steps_per_epoch > 0 && (x1 - x0) / static_cast<double>(steps_per_epoch) <= 40)
    for (std::int64_t e = 1; static_cast<double>(e * steps_per_epoch) <= x1; ++e) {
      const double x = static_cast<double>(e * steps_per_epoch);
      if (x < x0) continue;
      std::snprintf(b, sizeof b,
                    "<line class=\"epoch\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%g\" y2=\"%g\" stroke=\"#bbb\" "
                    "stroke-dasharray=\"4 3\"/><text x=\"%.1f\" y=\"%g\" text-anchor=\"end\" fill=\"#888\">epoch "
                    "%lld</text>",
                    px(x), px(x), T, H - B, px(x) - 3, T + 12, static_cast<long long>(e));
      o << b;
    }
  o << "<rect x=\"" << L << "\" y=\"" << T << "\" width=\"" << kW - L - R << "\" height=\"" << H - T - B
    << "\" fill=\"none\" stroke=\"#999\"/>"
    << "<text class=\"axis\" x=\"" << (L + kW - R) / 2 << "\" y=\"" << H - 10 << "\" text-anchor=\"middle\">step</text>"
    << "<text class=\"axis\" transform=\"rotate(-90)\" x=\"" << -(T + H - B) / 2 << "\" y=\"16\" text-anchor=\"middle\">"
    << esc(y_title) << "</text>";
  double legend_x = L, legend_y = 34;
  for (const Series& s : series) {
    if (s.points.empty()) continue;
    const std::vector<std::size_t> drawn = bounded_sample(s.points, kBuckets);
    o << "<g class=\"series\" data-name=\"" << esc(s.name) << "\" data-points=\"" << drawn.size() << "\">"
      << "<path fill=\"none\" stroke=\"" << s.color << "\" stroke-width=\"1.8\""
      << (s.dash.empty() ? "" : " stroke-dasharray=\"" + s.dash + "\"") << " d=\"";
    bool pen = false;
    for (const std::size_t i : drawn) {
      const auto [x, y] = s.points[i];
      if (!std::isfinite(y)) {
        pen = false;
        continue;
      }
      std::snprintf(b, sizeof b, "%c%.1f %.1f ", pen ? 'L' : 'M', px(x), py(y));
      o << b;
      pen = true;
    }
    o << "\"/>";
    if (s.markers)
      for (const std::size_t i : drawn)
        if (const auto [x, y] = s.points[i]; std::isfinite(y)) {
          std::snprintf(b, sizeof b, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>", px(x), py(y),
                        s.color.c_str());
          o << b;
        }
    o << "</g>";
    // The legend flows in rows of the chart's width under the title.
    const double width = legend_width(s);
    if (legend_x + width > kW - R && legend_x > L) {
      legend_x = L;
      legend_y += 14;
    }
    std::snprintf(b, sizeof b,
                  "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2.5\"%s/>",
                  legend_x, legend_x + 14, legend_y - 4, legend_y - 4, s.color.c_str(),
                  s.dash.empty() ? "" : (" stroke-dasharray=\"" + s.dash + "\"").c_str());
    o << b << "<text class=\"legend\" x=\"" << legend_x + 18 << "\" y=\"" << legend_y << "\">" << esc(s.name)
      << "</text>";
    legend_x += width;
  }
  o << "</svg>";
  return o.str();
}

// One bar per rank: its compute per step, phase by phase, and its wait (exposed communication), in
// ms, on one ms axis; the straggler's row is marked (Note [Naming a straggler] in src/report/ranks.cpp).
std::string rank_chart(const std::vector<RankTimes>& ranks, int straggler, const std::string& title = "time per step by rank") {
  constexpr double L = 190, R = 44, T = 48, Row = 26;
  const double H = T + Row * static_cast<double>(ranks.size()) + 56;
  struct Part {
    const char* name;
    const char* color;
    double StepTiming::*field;
  };
  static const Part kParts[] = {{"data", "#bab0ac", &StepTiming::data},
                                {"forward", "#4e79a7", &StepTiming::forward},
                                {"backward", "#f28e2b", &StepTiming::backward},
                                {"optimizer", "#59a14f", &StepTiming::optimizer},
                                {"waiting (exposed communication)", "#e15759", &StepTiming::exposed_comm}};
  double most = 0;
  for (const RankTimes& r : ranks) most = std::max(most, 1e3 * (r.compute() + r.per_step.exposed_comm));
  const std::vector<double> xt = nice_ticks(0, most > 0 ? most : 1, 6);
  const double x1 = xt.back(), xs = xt.size() > 1 ? xt[1] - xt[0] : 0;
  auto px = [&](double ms) { return L + ms / x1 * (kW - L - R); };
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"chart\" data-title=\"" << esc(title) << "\" viewBox=\"0 0 "
    << kW << ' ' << H << "\" role=\"img\"><title>" << esc(title) << "</title><text x=\"" << L
    << "\" y=\"18\" class=\"t\">" << esc(title) << "</text>";
  char b[320];
  double legend_x = L;
  for (const Part& p : kParts) {
    std::snprintf(b, sizeof b, "<rect x=\"%.1f\" y=\"26\" width=\"10\" height=\"10\" fill=\"%s\"/>", legend_x, p.color);
    o << b << "<text class=\"legend\" x=\"" << legend_x + 14 << "\" y=\"35\">" << p.name << "</text>";
    legend_x += 28 + 6.5 * static_cast<double>(std::strlen(p.name));
  }
  for (const double x : xt) {
    std::snprintf(b, sizeof b, "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%g\" y2=\"%g\" stroke=\"#e6e6e6\"/>", px(x), px(x), T,
                  H - 56);
    o << b << "<text class=\"tick-x\" x=\"" << px(x) << "\" y=\"" << H - 40 << "\" text-anchor=\"middle\">"
      << esc(format_value(x, static_cast<int>(Unit::kMs), xs)) << "</text>";
  }
  o << "<text class=\"axis\" x=\"" << (L + kW - R) / 2 << "\" y=\"" << H - 14
    << "\" text-anchor=\"middle\">ms per step (mean over the run)</text>";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    const RankTimes& r = ranks[i];
    const double y = T + Row * static_cast<double>(i) + 4;
    std::snprintf(b, sizeof b,
                  "<g class=\"rank\" data-rank=\"%d\" data-compute-ms=\"%.3f\" data-wait-ms=\"%.3f\"%s>", r.rank,
                  1e3 * r.compute(), 1e3 * r.per_step.exposed_comm, r.rank == straggler ? " data-straggler=\"1\"" : "");
    o << b << "<text x=\"" << L - 8 << "\" y=\"" << y + 13 << "\" text-anchor=\"end\""
      << (r.rank == straggler ? " font-weight=\"bold\" fill=\"#c00\"" : "") << ">rank " << r.rank << " ("
      << esc(r.host) << ")" << (r.rank == straggler ? " straggler" : "") << "</text>";
    double at = 0;
    for (const Part& p : kParts) {
      const double ms = 1e3 * std::max(0.0, r.per_step.*p.field);
      std::snprintf(b, sizeof b,
                    "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"18\" fill=\"%s\"><title>rank %d %s: %.2f "
                    "ms</title></rect>",
                    px(at), y, px(at + ms) - px(at), p.color, r.rank, p.name, ms);
      o << b;
      at += ms;
    }
    o << "</g>";
  }
  o << "</svg>";
  return o.str();
}

std::string time_bar(const std::vector<TimeShare>& time) {
  static const char* kColors[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
                                  "#edc948", "#b07aa1", "#9c755f", "#bab0ac"};
  double total = 0;
  for (const TimeShare& t : time) total += std::max(0.0, t.seconds);
  constexpr double W = kW, L = 8;
  std::ostringstream o;
  const double rows = static_cast<double>((time.size() + 2) / 3);
  const double H = 60 + 18 * rows;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H << "\" viewBox=\"0 0 " << W
    << ' ' << H << "\" role=\"img\"><title>where the time went</title>";
  double x = L;
  char b[256];
  for (std::size_t i = 0; i < time.size(); ++i) {
    const double w = total > 0 ? std::max(0.0, time[i].seconds) / total * (W - 2 * L) : 0;
    const char* c = kColors[i % (sizeof kColors / sizeof kColors[0])];
    std::snprintf(b, sizeof b,
                  "<rect x=\"%.1f\" y=\"8\" width=\"%.1f\" height=\"28\" fill=\"%s\"><title>%s: %.3f s</title></rect>",
                  x, w, c, esc(time[i].name).c_str(), time[i].seconds);
    o << b;
    x += w;
    const double lx = L + static_cast<double>(i % 3) * 310, ly = 56 + 18 * static_cast<double>(i / 3);
    std::snprintf(b, sizeof b,
                  "<rect x=\"%.1f\" y=\"%.1f\" width=\"10\" height=\"10\" fill=\"%s\"/><text x=\"%.1f\" y=\"%.1f\">%s "
                  "%.2f s (%.1f %%)</text>",
                  lx, ly - 9, c, lx + 14, ly, esc(time[i].name).c_str(), time[i].seconds,
                  total > 0 ? 100.0 * time[i].seconds / total : 0.0);
    o << b;
  }
  o << "</svg>";
  return o.str();
}

// The rows the charts draw a point of (Note [A bounded sample that keeps the extremes]): row i is
// on curve k (of `curves`) at (its step, *value(row, k)) where value gives a number, and is drawn
// when the bounded sample of one of its curves keeps it. Every row of a short run, each on a curve
// or not.
template <class Row, class Value>
std::vector<bool> rows_drawn(const std::vector<Row>& rows, std::size_t curves, Value value) {
  std::vector<bool> drawn(rows.size(), rows.size() <= 4 * kBuckets);
  if (drawn.empty() || drawn.front()) return drawn;
  std::vector<std::pair<double, double>> points;
  std::vector<std::size_t> row;  // points[j] is of rows[row[j]]
  for (std::size_t k = 0; k < curves; ++k) {
    points.clear();
    row.clear();
    for (std::size_t i = 0; i < rows.size(); ++i)
      if (const std::optional<double> v = value(rows[i], k)) {
        points.emplace_back(static_cast<double>(rows[i].step), *v);
        row.push_back(i);
      }
    for (const std::size_t j : bounded_sample(points, kBuckets)) drawn[row[j]] = true;
  }
  return drawn;
}

}  // namespace

// The curves' rows are those drawn (rows_drawn: the curves of add_curves and the per-rank chart),
// and "logged" says how many the run had.
std::string report_json(const ReportData& d) {
  Json facts = Json::object(), train = Json::array(), evals = Json::array(), time = Json::object();
  for (const auto& [name, value] : d.facts) facts[name] = value;
  const std::vector<bool> train_drawn = rows_drawn(d.train, 2, [](const TrainPoint& p, std::size_t k) {
    return std::optional<double>(k == 0 ? p.loss : p.images_per_s);
  });
  for (std::size_t i = 0; i < d.train.size(); ++i) {
    if (!train_drawn[i]) continue;
    const TrainPoint& p = d.train[i];
    train.push_back({{"step", p.step},
                     {"loss", json_number(p.loss)},
                     {"lr", json_number(p.lr)},
                     {"images_per_s", json_number(p.images_per_s)}});
  }
  // Curves 0 and 1 validation loss and accuracy, 2 and 3 test's.
  const std::vector<bool> evals_drawn =
      rows_drawn(d.evals, 4, [](const EvalPoint& p, std::size_t k) -> std::optional<double> {
        if ((std::strcmp(p.split, "validation") == 0) != (k < 2)) return std::nullopt;
        return k % 2 == 0 ? p.loss : p.accuracy;
      });
  for (std::size_t i = 0; i < d.evals.size(); ++i) {
    if (!evals_drawn[i]) continue;
    const EvalPoint& p = d.evals[i];
    evals.push_back(
        {{"split", p.split}, {"step", p.step}, {"accuracy", json_number(p.accuracy)}, {"loss", json_number(p.loss)}});
  }
  for (const TimeShare& t : d.time) time[t.name] = json_number(t.seconds);
  Json ranks = Json::array(), points = Json::array();
  for (const RankTimes& r : d.ranks)
    ranks.push_back({{"rank", r.rank},
                     {"host", r.host},
                     {"compute_ms", json_number(1e3 * r.compute())},
                     {"wait_ms", json_number(1e3 * r.per_step.exposed_comm)}});
  const std::vector<bool> rank_points_drawn =
      rows_drawn(d.rank_points, d.ranks.size(), [](const RankPoint& p, std::size_t r) -> std::optional<double> {
        if (r < p.compute_ms.size()) return p.compute_ms[r];
        return std::nullopt;
      });
  for (std::size_t i = 0; i < d.rank_points.size(); ++i) {
    if (!rank_points_drawn[i]) continue;
    const RankPoint& p = d.rank_points[i];
    Json c = Json::array(), w = Json::array();
    for (const double v : p.compute_ms) c.push_back(json_number(v));
    for (const double v : p.wait_ms) w.push_back(json_number(v));
    points.push_back({{"step", p.step}, {"compute_ms", std::move(c)}, {"wait_ms", std::move(w)}});
  }
  Json logged = {{"train", d.train.size()}, {"eval", d.evals.size()}, {"rank_points", d.rank_points.size()}};
  const std::string text = json_text({{"facts", std::move(facts)},
                                      {"train", std::move(train)},
                                      {"eval", std::move(evals)},
                                      {"time_s", std::move(time)},
                                      {"steps_per_epoch", d.steps_per_epoch},
                                      {"ranks", std::move(ranks)},
                                      {"rank_points", std::move(points)},
                                      {"straggler", d.straggler},
                                      {"logged", std::move(logged)}});
  // The data sits inside <script>, which the first "</script>" would end. JSON text holds '<' only
  // inside strings, where \u003c is the same character.
  std::string o;
  o.reserve(text.size());
  for (const char c : text) {
    if (c == '<')
      o += "\\u003c";
    else
      o += c;
  }
  return o;
}

// The page's head and style, the same for one run and for several.
// A run's curves into its series: training loss and images/s at every log line, each split's loss
// and accuracy at its evaluations.
static void add_curves(const ReportData& d, Series& train_loss, Series& speed, Series& val_loss, Series& test_loss,
                       Series& val_acc, Series& test_acc) {
  for (const TrainPoint& p : d.train) {
    train_loss.points.emplace_back(static_cast<double>(p.step), p.loss);
    speed.points.emplace_back(static_cast<double>(p.step), p.images_per_s);
  }
  for (const EvalPoint& p : d.evals) {
    const bool val = std::strcmp(p.split, "validation") == 0;
    (val ? val_loss : test_loss).points.emplace_back(static_cast<double>(p.step), p.loss);
    (val ? val_acc : test_acc).points.emplace_back(static_cast<double>(p.step), p.accuracy);
  }
}

static std::string page_head(const std::string& title) {
  return "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>" + esc(title) +
         "</title>\n"
         "<style>body{font:14px sans-serif;margin:24px auto;padding:0 24px;color:#222;max-width:1100px}"
         "svg{display:block;width:100%;height:auto;margin:8px 0 24px}svg text{font:12px sans-serif;fill:#333}"
         "svg text.t{font-size:14px;font-weight:bold}svg text.axis{fill:#555}"
         "table{border-collapse:collapse}td,th{padding:2px 12px 2px 0;vertical-align:top;text-align:left}"
         "td:first-child{color:#666}</style></head>\n<body><h1>" +
         esc(title) + "</h1>\n";
}

std::string render_html_report(const ReportData& d) {
  Series train_loss{"training loss (training split)", "#4e79a7", {}, false, ""},
      val_loss{"validation loss (validation split)", "#e15759", {}, true, ""},
      test_loss{"test loss (test split)", "#59a14f", {}, true, ""},
      val_acc{"validation accuracy (validation split)", "#e15759", {}, true, ""},
      test_acc{"test accuracy (test split)", "#59a14f", {}, true, ""}, speed{"images/s (all ranks)", "#f28e2b", {}, false, ""};
  add_curves(d, train_loss, speed, val_loss, test_loss, val_acc, test_acc);
  static const char* kRankColors[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
                                      "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"};
  std::vector<Series> by_rank;
  for (std::size_t r = 0; r < d.ranks.size(); ++r) {
    Series s{"rank " + std::to_string(r) + " compute", kRankColors[r % 10], {}, d.rank_points.size() < 3, ""};
    for (const RankPoint& p : d.rank_points)
      if (r < p.compute_ms.size()) s.points.emplace_back(static_cast<double>(p.step), p.compute_ms[r]);
    by_rank.push_back(std::move(s));
  }
  std::ostringstream o;
  o << page_head("mnist_mpi training report") << "<table>";
  for (const auto& [k, v] : d.facts) o << "<tr><td>" << esc(k) << "</td><td>" << esc(v) << "</td></tr>";
  o << "</table>\n<h2>Loss</h2>\n"
    << line_chart("loss", "loss (cross-entropy)", Unit::kPlain, {train_loss, val_loss, test_loss}, d.steps_per_epoch)
    << "\n<h2>Accuracy</h2>\n"
    << line_chart("accuracy", "accuracy", Unit::kFraction, {val_acc, test_acc}, d.steps_per_epoch)
    << "\n<h2>Throughput</h2>\n"
    << line_chart("images/s", "images per second", Unit::kRate, {speed}, d.steps_per_epoch);
  if (!d.ranks.empty()) {
    o << "\n<h2>Ranks</h2>\n<p class=\"straggler\">straggler: " << esc(d.straggler)
      << "</p>\n"
      << rank_chart(d.ranks, d.straggler_rank);
    if (!d.rank_points.empty())
      o << line_chart("compute per step by rank", "ms per step", Unit::kMs, by_rank, d.steps_per_epoch);
  }
  o << "\n<h2>Where the time went (rank 0)</h2>\n"
    << time_bar(d.time) << "\n<script type=\"application/json\" id=\"mnist-mpi-report\">\n"
    << report_json(d) << "\n</script>\n</body></html>\n";
  return o.str();
}

// Several runs in one page (mnist_mpi report): one colour per run, the split as the line's style
// (training solid, validation dashed, test dotted), the facts side by side, a per-rank chart each.
std::string render_runs_report(const std::vector<LabelledRun>& runs) {
  static const char* kRunColors[] = {"#4e79a7", "#e15759", "#59a14f", "#f28e2b", "#b07aa1",
                                     "#76b7b2", "#edc948", "#ff9da7", "#9c755f", "#bab0ac"};
  std::vector<Series> loss, accuracy, speed;
  std::int64_t steps_per_epoch = runs.empty() ? 0 : runs.front().data.steps_per_epoch;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const ReportData& d = runs[i].data;
    const std::string c = kRunColors[i % 10], l = runs[i].label;
    if (d.steps_per_epoch != steps_per_epoch) steps_per_epoch = 0;  // no one epoch length to mark
    Series train{l + ": training loss", c, {}, false, ""}, val_loss{l + ": validation loss", c, {}, true, "6 4"},
        test_loss{l + ": test loss", c, {}, true, "2 3"}, val_acc{l + ": validation accuracy", c, {}, true, "6 4"},
        test_acc{l + ": test accuracy", c, {}, true, "2 3"}, ips{l + ": images/s", c, {}, false, ""};
    add_curves(d, train, ips, val_loss, test_loss, val_acc, test_acc);
    loss.insert(loss.end(), {train, val_loss, test_loss});
    accuracy.insert(accuracy.end(), {val_acc, test_acc});
    speed.push_back(ips);
  }
  std::ostringstream o;
  o << page_head("mnist_mpi: " + std::to_string(runs.size()) + " runs compared") << "<table><tr><th></th>";
  for (std::size_t i = 0; i < runs.size(); ++i)
    o << "<th style=\"color:" << kRunColors[i % 10] << "\">" << esc(runs[i].label) << "</th>";
  o << "</tr>";
  std::vector<std::string> keys;  // every fact any run has, in first-seen order
  for (const LabelledRun& r : runs)
    for (const auto& [k, v] : r.data.facts)
      if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
  for (const std::string& k : keys) {
    o << "<tr><td>" << esc(k) << "</td>";
    for (const LabelledRun& r : runs) {
      std::string v = "";
      for (const auto& [rk, rv] : r.data.facts)
        if (rk == k) v = rv;
      o << "<td>" << esc(v) << "</td>";
    }
    o << "</tr>";
  }
  o << "</table>\n<p>Line styles: training solid, validation dashed, test dotted.</p>\n<h2>Loss</h2>\n"
    << line_chart("loss", "loss (cross-entropy)", Unit::kPlain, loss, steps_per_epoch) << "\n<h2>Accuracy</h2>\n"
    << line_chart("accuracy", "accuracy", Unit::kFraction, accuracy, steps_per_epoch) << "\n<h2>Throughput</h2>\n"
    << line_chart("images/s", "images per second", Unit::kRate, speed, steps_per_epoch) << "\n<h2>Ranks</h2>\n";
  for (const LabelledRun& r : runs) {
    if (r.data.ranks.empty()) continue;
    o << "<p class=\"straggler\">" << esc(r.label) << ": straggler: " << esc(r.data.straggler) << "</p>\n"
      << rank_chart(r.data.ranks, r.data.straggler_rank, "time per step by rank: " + r.label);
  }
  o << "</body></html>\n";
  return o.str();
}

bool write_html_report(OutputFile& out, const ReportData& data) {
  const std::string html = render_html_report(data);
  return out.open() && out.write(html) && out.close();
}

}  // namespace mnist_mpi
