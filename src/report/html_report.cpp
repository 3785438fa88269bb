// The HTML report (see include/mnist_mpi/report/html_report.hpp): charts drawn here as SVG paths,
// so the page needs nothing but a browser.
#include "mnist_mpi/report/html_report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
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
};

// A line chart with a frame, 5 horizontal grid lines labelled with values, and the step range.
std::string line_chart(const std::string& title, const std::vector<Series>& series) {
  constexpr double W = 640, H = 280, L = 64, R = 16, T = 28, B = 36;
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
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H << "\" viewBox=\"0 0 " << W
    << ' ' << H << "\" role=\"img\"><title>" << esc(title) << "</title>"
    << "<text x=\"" << L << "\" y=\"18\" class=\"t\">" << esc(title) << "</text>"
    << "<rect x=\"" << L << "\" y=\"" << T << "\" width=\"" << W - L - R << "\" height=\"" << H - T - B
    << "\" fill=\"none\" stroke=\"#999\"/>";
  if (x0 > x1) {
    o << "<text x=\"" << W / 2 << "\" y=\"" << H / 2 << "\" text-anchor=\"middle\">no data</text></svg>";
    return o.str();
  }
  if (x1 == x0) {
    x0 -= 1;
    x1 += 1;
  }
  if (y1 == y0) {
    y0 -= 0.5;
    y1 += 0.5;
  }
  const double pad = 0.05 * (y1 - y0);
  y0 -= pad;
  y1 += pad;
  auto px = [&](double x) { return L + (x - x0) / (x1 - x0) * (W - L - R); };
  auto py = [&](double y) { return T + (y1 - y) / (y1 - y0) * (H - T - B); };
  char b[160];
  for (int i = 0; i <= 4; ++i) {
    const double y = y0 + (y1 - y0) * i / 4.0;
    std::snprintf(b, sizeof b, "<line x1=\"%g\" x2=\"%g\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#eee\"/>", L, W - R, py(y),
                  py(y));
    o << b;
    std::snprintf(b, sizeof b, "<text x=\"%g\" y=\"%.1f\" text-anchor=\"end\">%.4g</text>", L - 4, py(y) + 4, y);
    o << b;
  }
  std::snprintf(b, sizeof b,
                "<text x=\"%g\" y=\"%g\">step %.0f</text><text x=\"%g\" y=\"%g\" text-anchor=\"end\">step %.0f</text>",
                L, H - 12, x0, W - R, H - 12, x1);
  o << b;
  double legend_x = L + 30 + 8.0 * static_cast<double>(title.size());  // the legend follows the title
  for (const Series& s : series) {
    if (s.points.empty()) continue;
    o << "<path fill=\"none\" stroke=\"" << s.color << "\" stroke-width=\"1.6\" d=\"";
    bool pen = false;
    for (auto [x, y] : s.points) {
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
      for (auto [x, y] : s.points)
        if (std::isfinite(y)) {
          std::snprintf(b, sizeof b, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"2.5\" fill=\"%s\"/>", px(x), py(y),
                        s.color.c_str());
          o << b;
        }
    std::snprintf(b, sizeof b, "<rect x=\"%.1f\" y=\"9\" width=\"10\" height=\"10\" fill=\"%s\"/>", legend_x,
                  s.color.c_str());
    o << b << "<text x=\"" << legend_x + 14 << "\" y=\"18\">" << esc(s.name) << "</text>";
    legend_x += 22 + 7.0 * static_cast<double>(s.name.size());
  }
  o << "</svg>";
  return o.str();
}

std::string time_bar(const std::vector<TimeShare>& time) {
  static const char* kColors[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
                                  "#edc948", "#b07aa1", "#9c755f", "#bab0ac"};
  double total = 0;
  for (const TimeShare& t : time) total += std::max(0.0, t.seconds);
  constexpr double W = 640, L = 8;
  std::ostringstream o;
  const double rows = static_cast<double>((time.size() + 1) / 2);
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
    const double lx = L + static_cast<double>(i % 2) * 310, ly = 56 + 18 * static_cast<double>(i / 2);
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

}  // namespace

std::string report_json(const ReportData& d) {
  Json facts = Json::object(), train = Json::array(), evals = Json::array(), time = Json::object();
  for (const auto& [name, value] : d.facts) facts[name] = value;
  for (const TrainPoint& p : d.train)
    train.push_back({{"step", p.step},
                     {"loss", json_number(p.loss)},
                     {"lr", json_number(p.lr)},
                     {"images_per_s", json_number(p.images_per_s)}});
  for (const EvalPoint& p : d.evals)
    evals.push_back(
        {{"split", p.split}, {"step", p.step}, {"accuracy", json_number(p.accuracy)}, {"loss", json_number(p.loss)}});
  for (const TimeShare& t : d.time) time[t.name] = json_number(t.seconds);
  const std::string text = json_text({{"facts", std::move(facts)},
                                      {"train", std::move(train)},
                                      {"eval", std::move(evals)},
                                      {"time_s", std::move(time)}});
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

std::string render_html_report(const ReportData& d) {
  Series train_loss{"training loss", "#4e79a7", {}, false}, val_loss{"validation loss", "#e15759", {}, true},
      test_loss{"test loss", "#59a14f", {}, true}, val_acc{"validation accuracy", "#e15759", {}, true},
      test_acc{"test accuracy", "#59a14f", {}, true}, speed{"images/s", "#f28e2b", {}, false};
  for (const TrainPoint& p : d.train) {
    train_loss.points.emplace_back(static_cast<double>(p.step), p.loss);
    speed.points.emplace_back(static_cast<double>(p.step), p.images_per_s);
  }
  for (const EvalPoint& p : d.evals) {
    const bool val = std::strcmp(p.split, "validation") == 0;
    (val ? val_loss : test_loss).points.emplace_back(static_cast<double>(p.step), p.loss);
    (val ? val_acc : test_acc).points.emplace_back(static_cast<double>(p.step), p.accuracy);
  }
  std::ostringstream o;
  o << "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>mnist_mpi training report</title>\n"
       "<style>body{font:14px sans-serif;margin:24px;color:#222;max-width:700px}"
       "svg{display:block;margin:8px 0 20px}svg text{font:11px sans-serif;fill:#333}svg "
       "text.t{font-size:13px;font-weight:bold}"
       "table{border-collapse:collapse}td{padding:2px 12px 2px "
       "0;vertical-align:top}td:first-child{color:#666}</style></head>\n"
       "<body><h1>mnist_mpi training report</h1>\n<table>";
  for (const auto& [k, v] : d.facts) o << "<tr><td>" << esc(k) << "</td><td>" << esc(v) << "</td></tr>";
  o << "</table>\n<h2>Loss</h2>\n"
    << line_chart("loss", {train_loss, val_loss, test_loss}) << "\n<h2>Accuracy</h2>\n"
    << line_chart("accuracy", {val_acc, test_acc}) << "\n<h2>Throughput</h2>\n"
    << line_chart("images/s", {speed}) << "\n<h2>Where the time went</h2>\n"
    << time_bar(d.time) << "\n<script type=\"application/json\" id=\"mnist-mpi-report\">\n"
    << report_json(d) << "\n</script>\n</body></html>\n";
  return o.str();
}

bool write_html_report(OutputFile& out, const ReportData& data) {
  const std::string html = render_html_report(data);
  return out.open() && out.write(html) && out.close();
}

}  // namespace mnist_mpi
