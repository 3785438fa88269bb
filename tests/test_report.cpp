// The observability pieces on their own: the protobuf encoder against hand-encoded bytes, TensorBoard
// event files read back by a decoder written here (every CRC, every field), the timeline's fixed
// buffer, the HTML report's embedded data and self-containedness, and the progress output (lines,
// and the bar's throttled redraws) with a clock the test controls.
#include <gtest/gtest.h>
#include <mpi.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/comm/mpi_communicator.hpp"
#include "mnist_mpi/config/options.hpp"
#include "mnist_mpi/crc32c.hpp"
#include "mnist_mpi/json.hpp"
#include "mnist_mpi/report/html_report.hpp"
#include "mnist_mpi/report/monitor.hpp"
#include "mnist_mpi/report/output.hpp"
#include "mnist_mpi/report/progress.hpp"
#include "mnist_mpi/report/report_command.hpp"
#include "mnist_mpi/report/run_summary.hpp"
#include "mnist_mpi/report/protobuf.hpp"
#include "mnist_mpi/report/tensorboard.hpp"
#include "mnist_mpi/report/timeline.hpp"

namespace mnist_mpi {
namespace {

namespace fs = std::filesystem;

fs::path fresh_dir(const std::string& tag) {
  const fs::path d = fs::temp_directory_path() / ("mnist_mpi_report_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::string bytes(std::initializer_list<int> b) {
  std::string s;
  for (int v : b) s.push_back(static_cast<char>(v));
  return s;
}

TEST(Protobuf, EncodesEachWireTypeAsTheSpecSays) {
  ProtoWriter w;
  w.varint(1, 150);  // the protobuf documentation's example: 08 96 01
  EXPECT_EQ(w.data(), bytes({0x08, 0x96, 0x01}));
  w.clear();
  w.int64(2, -1);  // negative int64: ten bytes, two's complement
  EXPECT_EQ(w.data(), bytes({0x10, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01}));
  w.clear();
  w.string(2, "testing");  // 12 07 74 65 73 74 69 6e 67
  EXPECT_EQ(w.data(), bytes({0x12, 0x07, 't', 'e', 's', 't', 'i', 'n', 'g'}));
  w.clear();
  w.float32(2, 1.0f);  // tag (2 << 3) | 5, then 0x3f800000 little-endian
  EXPECT_EQ(w.data(), bytes({0x15, 0x00, 0x00, 0x80, 0x3f}));
  w.clear();
  w.float64(1, 2.0);  // tag (1 << 3) | 1, then 0x4000000000000000 little-endian
  EXPECT_EQ(w.data(), bytes({0x09, 0, 0, 0, 0, 0, 0, 0, 0x40}));
  w.clear();
  w.varint(100, 0);  // a field number above 15 needs a two-byte tag: (100 << 3) = 800 = a0 06
  EXPECT_EQ(w.data(), bytes({0xa0, 0x06, 0x00}));
}

// ---- a small reader of what TensorBoardWriter writes ----

struct Field {
  int number = 0, wire = 0;
  std::uint64_t varint = 0;  // wire 0, 1, 5: the raw bits
  std::string bytes;         // wire 2
};

std::uint64_t read_varint(const std::string& s, std::size_t& i) {
  std::uint64_t v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (i >= s.size()) throw std::runtime_error("truncated varint");
    const auto b = static_cast<unsigned char>(s[i++]);
    v |= static_cast<std::uint64_t>(b & 0x7f) << shift;
    if (!(b & 0x80)) return v;
  }
  throw std::runtime_error("varint longer than 10 bytes");
}

std::uint64_t read_le(const std::string& s, std::size_t& i, int n) {
  if (i + static_cast<std::size_t>(n) > s.size()) throw std::runtime_error("truncated fixed field");
  std::uint64_t v = 0;
  for (int k = 0; k < n; ++k) v |= static_cast<std::uint64_t>(static_cast<unsigned char>(s[i++])) << (8 * k);
  return v;
}

std::vector<Field> parse_message(const std::string& s) {
  std::vector<Field> out;
  std::size_t i = 0;
  while (i < s.size()) {
    const std::uint64_t key = read_varint(s, i);
    Field f;
    f.number = static_cast<int>(key >> 3);
    f.wire = static_cast<int>(key & 7);
    if (f.wire == 0)
      f.varint = read_varint(s, i);
    else if (f.wire == 1)
      f.varint = read_le(s, i, 8);
    else if (f.wire == 5)
      f.varint = read_le(s, i, 4);
    else if (f.wire == 2) {
      const std::uint64_t n = read_varint(s, i);
      if (i + n > s.size()) throw std::runtime_error("truncated length-delimited field");
      f.bytes = s.substr(i, n);
      i += n;
    } else {
      throw std::runtime_error("unexpected wire type " + std::to_string(f.wire));
    }
    out.push_back(f);
  }
  return out;
}

struct Event {
  double wall_time = 0;
  std::int64_t step = 0;
  std::string file_version;
  std::vector<std::pair<std::string, float>> values;
};

// Reads every record, checking both masked CRCs; decodes Event and Summary.Value.
std::vector<Event> read_event_file(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string s = ss.str();
  std::vector<Event> events;
  std::size_t i = 0;
  while (i < s.size()) {
    if (i + 12 > s.size()) throw std::runtime_error("truncated record header");
    const std::string len_bytes = s.substr(i, 8);
    std::size_t j = i;
    const std::uint64_t len = read_le(s, j, 8);
    const auto len_crc = static_cast<std::uint32_t>(read_le(s, j, 4));
    if (len_crc != crc32c_masked(crc32c(len_bytes.data(), 8))) throw std::runtime_error("bad length CRC");
    if (j + len + 4 > s.size()) throw std::runtime_error("truncated record");
    const std::string data = s.substr(j, len);
    j += len;
    const auto data_crc = static_cast<std::uint32_t>(read_le(s, j, 4));
    if (data_crc != crc32c_masked(crc32c(data.data(), data.size()))) throw std::runtime_error("bad data CRC");
    i = j;
    Event e;
    for (const Field& fld : parse_message(data)) {
      if (fld.number == 1 && fld.wire == 1)
        e.wall_time = std::bit_cast<double>(fld.varint);
      else if (fld.number == 2 && fld.wire == 0)
        e.step = static_cast<std::int64_t>(fld.varint);
      else if (fld.number == 3 && fld.wire == 2)
        e.file_version = fld.bytes;
      else if (fld.number == 5 && fld.wire == 2) {
        for (const Field& v : parse_message(fld.bytes)) {  // Summary: repeated Value value = 1
          if (v.number != 1 || v.wire != 2) throw std::runtime_error("Summary field other than value");
          std::string tag;
          float value = 0;
          bool has_value = false;
          for (const Field& x : parse_message(v.bytes)) {
            if (x.number == 1 && x.wire == 2)
              tag = x.bytes;
            else if (x.number == 2 && x.wire == 5) {
              value = std::bit_cast<float>(static_cast<std::uint32_t>(x.varint));
              has_value = true;
            } else
              throw std::runtime_error("Value field other than tag / simple_value");
          }
          if (!has_value) throw std::runtime_error("Value without simple_value");
          e.values.emplace_back(tag, value);
        }
      } else {
        throw std::runtime_error("unexpected Event field " + std::to_string(fld.number));
      }
    }
    events.push_back(e);
  }
  return events;
}

TEST(TensorBoard, EventFileReadsBackWithEveryCrcAndValue) {
  const fs::path dir = fresh_dir("tb") / "nested" / "run";  // created with its parents
  std::string path;
  {
    TensorBoardWriter w(dir.string(), "testhost");
    path = w.path();
    w.scalars(10, {{"train/loss", 2.5}, {"train/learning_rate", 0.001}, {"train/images_per_s", 12345.0}});
    w.scalars(20, {{"validation/accuracy", 0.9375}, {"validation/loss", -0.0}});
    w.scalars(1LL << 40, {{"x", 1e30}});
  }
  ASSERT_EQ(fs::path(path).parent_path(), dir);
  EXPECT_EQ(fs::path(path).filename().string().rfind("events.out.tfevents.", 0), 0u);
  EXPECT_NE(fs::path(path).filename().string().find(".testhost."), std::string::npos);
  const std::vector<Event> ev = read_event_file(path);
  ASSERT_EQ(ev.size(), 4u);
  EXPECT_EQ(ev[0].file_version, "brain.Event:2");
  EXPECT_TRUE(ev[0].values.empty());
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  for (const Event& e : ev) EXPECT_NEAR(e.wall_time, now, 60.0);
  EXPECT_EQ(ev[1].step, 10);
  ASSERT_EQ(ev[1].values.size(), 3u);
  EXPECT_EQ(ev[1].values[0], (std::pair<std::string, float>{"train/loss", 2.5f}));
  EXPECT_EQ(ev[1].values[1], (std::pair<std::string, float>{"train/learning_rate", 0.001f}));
  EXPECT_EQ(ev[1].values[2], (std::pair<std::string, float>{"train/images_per_s", 12345.0f}));
  EXPECT_EQ(ev[2].step, 20);
  ASSERT_EQ(ev[2].values.size(), 2u);
  EXPECT_EQ(ev[2].values[0], (std::pair<std::string, float>{"validation/accuracy", 0.9375f}));
  EXPECT_EQ(ev[2].values[1].first, "validation/loss");
  EXPECT_TRUE(std::signbit(ev[2].values[1].second));
  EXPECT_EQ(ev[3].step, 1LL << 40);
  EXPECT_EQ(ev[3].values[0].second, 1e30f);
  fs::remove_all(dir.parent_path().parent_path());
}

TEST(TensorBoard, CorruptionIsCaughtByTheReader) {  // the reader above really checks the CRCs
  const fs::path dir = fresh_dir("tbc");
  std::string path;
  {
    TensorBoardWriter w(dir.string(), "h");
    path = w.path();
    w.scalars(1, {{"a", 1.0}});
  }
  ASSERT_NO_THROW(read_event_file(path));
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(-6, std::ios::end);  // inside the last record's float
  f.put('\x7f');
  f.close();
  EXPECT_THROW(read_event_file(path), std::runtime_error);
  fs::remove_all(dir);
}

TEST(TensorBoard, UnwritableDirectoryIsAUsageError) {
  const fs::path dir = fresh_dir("tbbad");
  std::ofstream(dir / "file") << "x";
  try {
    TensorBoardWriter w((dir / "file" / "sub").string(), "h");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kUsage);
    EXPECT_NE(std::string(e.what()).find("--tensorboard-dir"), std::string::npos);
  }
  fs::remove_all(dir);
}

TEST(TfRecord, FrameLayout) {
  const std::string rec = tfrecord_frame("abc");
  ASSERT_EQ(rec.size(), 8u + 4u + 3u + 4u);
  EXPECT_EQ(rec.substr(0, 8), bytes({3, 0, 0, 0, 0, 0, 0, 0}));
  std::size_t i = 8;
  EXPECT_EQ(read_le(rec, i, 4), crc32c_masked(crc32c(rec.data(), 8)));
  EXPECT_EQ(rec.substr(12, 3), "abc");
  i = 15;
  EXPECT_EQ(read_le(rec, i, 4), crc32c_masked(crc32c("abc", 3)));
}

// ---- timeline ----

TEST(Timeline, FullBufferKeepsTheFirstSpansAndCountsTheRest) {
  Timeline t(0, 3, {"fc:10"});
  const auto t0 = Timeline::Clock::now();
  for (int i = 0; i < 5; ++i) t.record(SpanKind::kData, t0, t0 + std::chrono::microseconds(i), i);
  EXPECT_EQ(t.size(), 3u);
  EXPECT_EQ(t.capacity(), 3u);
  EXPECT_EQ(t.dropped(), 2);
}

TEST(Timeline, CapacityCoversTheRunUpToTheCap) {
  // 100 steps, 1 micro-batch, 5 layers, 2 buckets: (2 + 3 + 5 + 3 * 2) per step, 2 per evaluation, + 256.
  EXPECT_EQ(timeline_capacity(100, 1, 5, 2, 3), 100u * 16u + 6u + 256u);
  EXPECT_EQ(timeline_capacity(1LL << 40, 1, 5, 2, 3), kTimelineMaxSpans);
  EXPECT_EQ(timeline_capacity(1LL << 40, 1, 5, 2, 3, 256), kTimelineMaxGathered / 256);  // rank 0 gathers <= 1 GiB
}

TEST(Timeline, WritesOneFileWithSpansOnRankZerosClock) {
  auto comm = make_mpi_communicator(MPI_COMM_SELF);
  const fs::path dir = fresh_dir("tl");
  Timeline t(0, 16, {"conv:3x3:4", "fc:10"});
  t.align_clocks(*comm);
  const auto a = Timeline::Clock::now();
  t.record(SpanKind::kStep, a, a + std::chrono::microseconds(1500), 7);
  t.backward_starts(a, 7);
  t.layer_done(1);
  const std::vector<BucketTiming> buckets{{a, a + std::chrono::microseconds(5)}, {a, a + std::chrono::microseconds(9)}};
  t.bucket_updated(8, 1, a, a + std::chrono::microseconds(10), a + std::chrono::microseconds(12));
  t.step_done(8, a, a + std::chrono::microseconds(20), buckets);
  const std::string path = (dir / "t.json").string();
  OutputFile out("the timeline (--timeline)", path, OutputFile::Mode::kReplace);
  t.gather_and_write(*comm, &out, "hostname");
  EXPECT_FALSE(out.failed());
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string s = ss.str();
  EXPECT_NE(s.find("\"traceEvents\":["), std::string::npos);
  EXPECT_NE(s.find("\"name\":\"rank 0 (hostname)\""), std::string::npos);
  EXPECT_NE(s.find("\"name\":\"backward 1 fc:10\""), std::string::npos);
  EXPECT_NE(s.find("\"name\":\"step\",\"cat\":\"step\",\"ph\":\"X\",\"pid\":0,\"tid\":0"), std::string::npos);
  EXPECT_NE(s.find("\"dur\":1500,\"args\":{\"step\":7"), std::string::npos);
  // Two buckets in flight at once go to two communication rows.
  EXPECT_NE(s.find("\"name\":\"allreduce bucket 0\",\"cat\":\"allreduce\",\"ph\":\"X\",\"pid\":0,\"tid\":1"),
            std::string::npos);
  EXPECT_NE(s.find("\"name\":\"allreduce bucket 1\",\"cat\":\"allreduce\",\"ph\":\"X\",\"pid\":0,\"tid\":2"),
            std::string::npos);
  EXPECT_NE(s.find("\"name\":\"wait for bucket 1\",\"cat\":\"wait for bucket\",\"ph\":\"X\",\"pid\":0,\"tid\":0"),
            std::string::npos);
  const auto opt = s.find("\"name\":\"optimizer bucket 1\",\"cat\":\"optimizer\",\"ph\":\"X\",\"pid\":0,\"tid\":0,");
  ASSERT_NE(opt, std::string::npos);
  EXPECT_NE(s.find("\"dur\":2,\"args\":{\"step\":8,\"index\":1}", opt), std::string::npos);
  EXPECT_NE(s.find("\"dropped_spans\":[0]"), std::string::npos);
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  fs::remove_all(dir);
}

// ---- HTML report ----

TEST(HtmlReport, EmbedsTheCurvesAndNeedsNoNetwork) {
  ReportData d;
  d.facts = {{"model", "fc:10 <&>"}, {"ranks", "2"}};
  d.train = {{5, 2.25, 0.001, 1000}, {10, 1.5, 0.001, 1100}};
  d.evals = {{"validation", 10, 0.875, 0.5}, {"test", 10, 0.8125, 0.625}};
  d.time = {{"forward", 1.5}, {"backward", 3.0}};
  const std::string html = render_html_report(d);
  const std::string open = "<script type=\"application/json\" id=\"mnist-mpi-report\">\n";
  const auto b = html.find(open);
  ASSERT_NE(b, std::string::npos);
  const auto e = html.find("\n</script>", b);
  const std::string json = html.substr(b + open.size(), e - b - open.size());
  EXPECT_EQ(json, report_json(d));
  EXPECT_NE(json.find("\"train\":[{\"step\":5,\"loss\":2.25,\"lr\":0.001,\"images_per_s\":1000},"
                      "{\"step\":10,\"loss\":1.5,\"lr\":0.001,\"images_per_s\":1100}]"),
            std::string::npos);
  EXPECT_NE(json.find("{\"split\":\"validation\",\"step\":10,\"accuracy\":0.875,\"loss\":0.5}"), std::string::npos);
  EXPECT_NE(json.find("\"time_s\":{\"forward\":1.5,\"backward\":3}"), std::string::npos);
  EXPECT_NE(json.find("\"model\":\"fc:10 \\u003c&>\""), std::string::npos);  // no "</script>" can end the block early
  EXPECT_NE(html.find("fc:10 &lt;&amp;&gt;"), std::string::npos);
  EXPECT_EQ(html.find("<script src"), std::string::npos);
  EXPECT_EQ(html.find("<link"), std::string::npos);
  EXPECT_EQ(html.find("url("), std::string::npos);
  EXPECT_EQ(html.find("@import"), std::string::npos);
  // Only the SVG namespace names a URL.
  std::string rest = html;
  for (auto p = rest.find("http://www.w3.org/2000/svg"); p != std::string::npos;
       p = rest.find("http://www.w3.org/2000/svg"))
    rest.erase(p, 26);
  EXPECT_EQ(rest.find("http"), std::string::npos);
  EXPECT_NE(html.find("<path fill=\"none\" stroke=\"#4e79a7\""), std::string::npos);  // the loss curve is drawn
}

// Note [Charts people can read]: ticks at 1, 2 or 5 times a power of ten that cover the data,
// labels as people write them.
TEST(HtmlReport, TicksAreRoundAndLabelsReadable) {
  EXPECT_EQ(nice_ticks(0.5969, 2.31, 5), (std::vector<double>{0.5, 1.0, 1.5, 2.0, 2.5}));
  EXPECT_EQ(nice_ticks(0, 72860, 5), (std::vector<double>{0, 20000, 40000, 60000, 80000}));
  EXPECT_EQ(nice_ticks(10, 1100, 8), (std::vector<double>{0, 200, 400, 600, 800, 1000, 1200}));
  const std::vector<double> acc = nice_ticks(0.9312, 0.9871, 5);  // 0.92 .. 1.00 by 0.02
  ASSERT_EQ(acc.size(), 5u);
  EXPECT_NEAR(acc.front(), 0.92, 1e-12);
  EXPECT_NEAR(acc.back(), 1.0, 1e-12);
  for (double lo : {-3.7, 0.0, 1e-6, 12.0, 5e5})
    for (double span : {1e-5, 0.3, 7.0, 123.0, 4e6}) {
      const std::vector<double> t = nice_ticks(lo, lo + span, 5);
      ASSERT_GE(t.size(), 2u);
      EXPECT_LE(t.front(), lo);
      EXPECT_GE(t.back(), lo + span);
      EXPECT_LE(t.size(), 12u) << lo << " + " << span;
      const double step = t[1] - t[0], m = step / std::pow(10.0, std::floor(std::log10(step) + 1e-9));
      EXPECT_TRUE(std::fabs(m - 1) < 1e-4 || std::fabs(m - 2) < 1e-4 || std::fabs(m - 5) < 1e-4) << step;
    }
  EXPECT_EQ(format_value(72900, 2, 10000), "73k");
  EXPECT_EQ(format_value(72900, 2, 100), "72.9k");
  EXPECT_EQ(format_value(0.982, 1, 0.001), "98.2 %");
  EXPECT_EQ(format_value(0.95, 1, 0.05), "95 %");
  EXPECT_EQ(format_value(12.5, 3, 0.5), "12.5 ms");
  EXPECT_EQ(format_value(0.5, 0, 0.5), "0.5");
  EXPECT_EQ(format_value(1200, 0, 200), "1200");
  EXPECT_EQ(format_value(40000, 0, 20000), "40k");
}

// The report's charts: round tick labels only, the per-rank chart with one bar per rank and the
// straggler marked, every series named with its split.
TEST(HtmlReport, ChartsHaveRoundTicksAndOneBarPerRank) {
  ReportData d;
  d.steps_per_epoch = 50;
  for (int s = 10; s <= 120; s += 10) d.train.push_back({s, 2.0 / s, 0.001, 70000.0 + 100 * s});
  d.evals = {{"validation", 50, 0.9512, 0.3}, {"validation", 100, 0.9734, 0.2}, {"test", 120, 0.9751, 0.19}};
  for (int r = 0; r < 3; ++r) {
    RankTimes t;
    t.rank = r;
    t.host = "h" + std::to_string(r);
    t.per_step = StepTiming{.data = 1e-4, .forward = 1e-3, .backward = r == 2 ? 4e-3 : 2e-3, .exposed_comm = 2e-4};
    d.ranks.push_back(t);
  }
  d.rank_points = {{60, {3.1, 3.1, 5.1}, {2.0, 2.0, 0.1}}, {120, {3.1, 3.2, 5.1}, {2.0, 2.0, 0.1}}};
  d.straggler = "rank 2 on host h2: backward 100 % slower than the median rank";
  d.straggler_rank = 2;
  const std::string html = render_html_report(d);
  std::size_t bars = 0;
  for (auto p = html.find("<g class=\"rank\""); p != std::string::npos; p = html.find("<g class=\"rank\"", p + 1)) ++bars;
  EXPECT_EQ(bars, 3u);
  EXPECT_NE(html.find("data-rank=\"2\" data-compute-ms=\"5.100\" data-wait-ms=\"0.200\" data-straggler=\"1\""),
            std::string::npos);
  for (const char* name : {"training loss (training split)", "validation loss (validation split)",
                           "test accuracy (test split)", "images/s (all ranks)", "rank 2 compute"})
    EXPECT_NE(html.find(std::string("data-name=\"") + name + "\""), std::string::npos) << name;
  EXPECT_NE(html.find(">epoch 1</text>"), std::string::npos);
  EXPECT_NE(html.find(">step</text>"), std::string::npos);
  // Every chart's tick labels: numbers without exponent, equally spaced by 1, 2 or 5 times a power
  // of ten, each a multiple of that step (the units' k, % and ms read as written).
  for (auto c = html.find("<svg"); c != std::string::npos; c = html.find("<svg", c + 1)) {
    const std::string chart = html.substr(c, html.find("</svg>", c) - c);
    for (const char* cls : {"tick-y", "tick-x"}) {
      std::vector<double> v;
      for (auto p = chart.find(std::string("class=\"") + cls); p != std::string::npos;
           p = chart.find(std::string("class=\"") + cls, p + 1)) {
        const auto b = chart.find('>', p) + 1, e = chart.find('<', b);
        const std::string label = chart.substr(b, e - b);
        EXPECT_EQ(label.find('e'), std::string::npos) << label;
        v.push_back(std::strtod(label.c_str(), nullptr));
      }
      if (v.size() < 2) continue;
      const double step = v[1] - v[0];
      ASSERT_GT(step, 0) << cls;
      const double m = step / std::pow(10.0, std::floor(std::log10(step) + 1e-9));
      EXPECT_TRUE(std::fabs(m - 1) < 1e-6 || std::fabs(m - 2) < 1e-6 || std::fabs(m - 5) < 1e-6) << cls << " " << step;
      for (std::size_t i = 1; i < v.size(); ++i) EXPECT_NEAR(v[i] - v[i - 1], step, step * 1e-6) << cls;
      for (const double x : v) EXPECT_NEAR(x / step, std::round(x / step), 1e-6) << cls << " " << x;
    }
  }
  EXPECT_NE(html.find(">97.0 %</text>"), std::string::npos);  // accuracy ticks in percent
}

// The values of a chart's tick labels of class `cls` ("tick-y", "tick-x"), in the page's order:
// the number a label starts with (97.5 of "97.5 %").
std::vector<double> tick_values(const std::string& html, const std::string& title, const std::string& cls) {
  const auto c = html.find("<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"chart\" data-title=\"" + title + "\"");
  EXPECT_NE(c, std::string::npos) << title;
  const std::string chart = c == std::string::npos ? "" : html.substr(c, html.find("</svg>", c) - c);
  std::vector<double> v;
  for (auto p = chart.find("class=\"" + cls); p != std::string::npos; p = chart.find("class=\"" + cls, p + 1))
    v.push_back(std::strtod(chart.c_str() + chart.find('>', p) + 1, nullptr));
  return v;
}

// Note [An axis of a fraction]: accuracy's axis stays within 0 % .. 100 % and is zoomed to its
// points; one point, or a flat series, gets a few round ticks around it.
TEST(HtmlReport, AFractionAxisStaysWithin0To100PercentZoomedToItsPoints) {
  for (const double lo : {0.0, 1e-4, 0.13, 0.5, 0.93, 0.986, 0.9999, 1.0})
    for (const double span : {0.0, 1e-4, 0.007, 0.05, 0.3, 1.0}) {
      const double hi = std::min(1.0, lo + span);
      const std::vector<double> t = axis_ticks(lo, hi, 1);
      ASSERT_GE(t.size(), 2u) << lo << " .. " << hi;
      EXPECT_GE(t.front(), 0.0) << lo << " .. " << hi;
      EXPECT_LE(t.back(), 1.0) << lo << " .. " << hi;
      EXPECT_LE(t.front(), lo) << hi;
      EXPECT_GE(t.back(), hi) << lo;
    }
  // One evaluation at 98.6 %: not 40 % to 160 %.
  const std::vector<double> one = axis_ticks(0.986, 0.986, 1);
  EXPECT_GE(one.size(), 3u);
  EXPECT_GE(one.front(), 0.95);
  EXPECT_LE(one.back(), 1.0);
  EXPECT_EQ(axis_ticks(1, 1, 1).back(), 1.0);
  EXPECT_EQ(axis_ticks(0, 0, 1).front(), 0.0);
  EXPECT_GT(axis_ticks(0, 0, 1).back(), 0.0);
  EXPECT_EQ(axis_ticks(2, 2, 0), nice_ticks(1.5, 2.5, 5));  // other axes with one value: half a unit around it
  EXPECT_EQ(axis_ticks(0.5969, 2.31, 0), nice_ticks(0.5969, 2.31, 5));
  // In the page: a run whose one test evaluation is 98.6 %.
  ReportData d;
  d.train = {{10, 0.3, 0.001, 1000}, {20, 0.2, 0.001, 1000}};
  d.evals = {{"test", 20, 0.986, 0.05}};
  const std::vector<double> percent = tick_values(render_html_report(d), "accuracy", "tick-y");
  ASSERT_GE(percent.size(), 3u);
  EXPECT_GE(percent.front(), 95.0);
  EXPECT_LE(percent.back(), 100.0);
}

// Note [A bounded sample that keeps the extremes]: a long series drawn from at most four points a
// step range, which keep its first, last, lowest and highest points and a one-step spike; a short
// one whole.
TEST(HtmlReport, ALongSeriesIsDrawnFromABoundedSampleThatKeepsItsExtremes) {
  std::vector<std::pair<double, double>> few;  // 4 points a range, unevenly spaced: a sample would thin it
  for (int i = 0; i < 400; ++i) few.emplace_back(i * i, std::sin(i));
  std::vector<std::size_t> all(few.size());
  std::iota(all.begin(), all.end(), std::size_t{0});
  EXPECT_EQ(bounded_sample(few, 100), all);
  // A loss curve of 200,000 steps: highest at its start, lowest near its end, with a spike of one
  // step (lower than the start, so not the series' highest) and a dip of one step in its middle.
  constexpr std::size_t kSpike = 120007, kDip = 77777;
  std::vector<std::pair<double, double>> loss;
  for (int s = 1; s <= 200000; ++s)
    loss.emplace_back(s, 0.05 + 2.25 * std::exp(-s / 20000.0) + 0.02 * std::sin(s * 0.37));
  loss[kSpike].second = 1.5;
  loss[kDip].second = 0.01;
  const std::vector<std::size_t> kept = bounded_sample(loss, 1000);
  EXPECT_LE(kept.size(), 4000u);
  EXPECT_GE(kept.size(), 2000u);
  EXPECT_TRUE(std::is_sorted(kept.begin(), kept.end()));
  EXPECT_EQ(std::adjacent_find(kept.begin(), kept.end()), kept.end());  // each point once
  const auto has = [&](std::size_t i) { return std::binary_search(kept.begin(), kept.end(), i); };
  const auto y_less = [](const auto& a, const auto& b) { return a.second < b.second; };
  const auto lowest = static_cast<std::size_t>(std::min_element(loss.begin(), loss.end(), y_less) - loss.begin());
  const auto highest = static_cast<std::size_t>(std::max_element(loss.begin(), loss.end(), y_less) - loss.begin());
  EXPECT_EQ(lowest, kDip);
  EXPECT_TRUE(has(0) && has(loss.size() - 1)) << "first and last";
  EXPECT_TRUE(has(lowest)) << "the lowest point, " << lowest;
  EXPECT_TRUE(has(highest)) << "the highest point, " << highest;
  EXPECT_TRUE(has(kSpike)) << "the spike";
  // A step that is not a number is kept, so the line's gap shows; still at most 5 points a range.
  loss[150100].second = std::nan("");  // inside a range, neither its first nor its last
  const std::vector<std::size_t> gap = bounded_sample(loss, 1000);
  EXPECT_TRUE(std::binary_search(gap.begin(), gap.end(), std::size_t{150100}));
  EXPECT_LE(gap.size(), 5000u);

  // The page of such a run: the loss curve drawn from the sample, up to the spike, and the JSON of
  // the rows drawn, saying how many were logged.
  ReportData d;
  for (int s = 1; s <= 200000; ++s)
    d.train.push_back({s, 0.05 + 2.25 * std::exp(-s / 20000.0) + 0.02 * std::sin(s * 0.37), 0.001,
                       70000 + 2000 * std::sin(s / 977.0)});
  d.train[kSpike].loss = 9.5;
  d.evals = {{"test", 200000, 0.986, 0.05}};
  const std::string html = render_html_report(d);
  EXPECT_LE(html.size(), std::size_t{3} << 20);
  const std::string name = "data-name=\"training loss (training split)\" data-points=\"";
  const auto at = html.find(name);
  ASSERT_NE(at, std::string::npos);
  EXPECT_LE(std::stoul(html.substr(at + name.size())), 4000u);
  EXPECT_GE(tick_values(html, "loss", "tick-y").back(), 9.5);
  const std::string open = "<script type=\"application/json\" id=\"mnist-mpi-report\">\n";
  const auto b = html.find(open);
  ASSERT_NE(b, std::string::npos);
  const Json json = Json::parse(html.substr(b + open.size(), html.find("\n</script>", b) - b - open.size()));
  EXPECT_EQ(json["logged"]["train"], 200000);
  EXPECT_LE(json["train"].size(), 6000u);  // each range's first, last, lowest and highest loss and images/s
  bool spike = false;
  for (const Json& p : json["train"]) spike = spike || p["loss"] == 9.5;
  EXPECT_TRUE(spike);
}

// ---- outputs that cannot be written (Note [When an output cannot be written]) ----

bool have_dev_full() { return fs::is_character_file("/dev/full"); }

std::size_t lines_in(const std::string& s) { return static_cast<std::size_t>(std::count(s.begin(), s.end(), '\n')); }

// The one warning: names the output and the file, says why, once.
void expect_one_warning(const std::string& err, const std::string& what, const std::string& path) {
  EXPECT_EQ(lines_in(err), 1u) << err;
  EXPECT_NE(err.find("mnist_mpi: warning: cannot write " + what + " '" + path + "': write: " + std::strerror(ENOSPC)),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("exit with code 7"), std::string::npos) << err;
}

TEST(OutputFile, FullDiskIsReportedOnceAndNeverThrows) {
  if (!have_dev_full()) GTEST_SKIP() << "no /dev/full";
  OutputFile f("the test output (--test)", "/dev/full");
  ASSERT_TRUE(f.open());
  EXPECT_FALSE(f.failed());
  ::testing::internal::CaptureStderr();
  bool any_ok = false;
  EXPECT_NO_THROW({
    for (int i = 0; i < 100; ++i) {
      const bool ok = f.write("{\"event\":\"step\"}") && f.write("\n") && f.flush();
      any_ok = any_ok || ok;
    }
    any_ok = f.print("%d\n", 7) || any_ok;
    any_ok = f.close() || any_ok;
  });
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_FALSE(any_ok);
  EXPECT_TRUE(f.failed());
  expect_one_warning(err, "the test output (--test)", "/dev/full");
  EXPECT_EQ(f.lost(), "the test output (--test) '/dev/full' (write: " + std::string(std::strerror(ENOSPC)) + ")");
}

TEST(OutputFile, WrittenFileIsNotFailedAndSaysNothing) {
  const fs::path dir = fresh_dir("out");
  const std::string path = (dir / "m.jsonl").string();
  ::testing::internal::CaptureStderr();
  {
    OutputFile f("the test output (--test)", path);
    ASSERT_TRUE(f.open());
    EXPECT_TRUE(f.write("a\n") && f.print("%d\n", 2) && f.flush());
    EXPECT_TRUE(f.close());
    EXPECT_FALSE(f.failed());
    EXPECT_EQ(f.lost(), "");
  }
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_EQ(ss.str(), "a\n2\n");
  fs::remove_all(dir);
}

TEST(OutputFile, ReplaceWritesATemporaryAndRenamesItOnlyOnClose) {
  const fs::path dir = fresh_dir("outr");
  const std::string path = (dir / "r.html").string();
  {
    OutputFile f("the report (--report)", path, OutputFile::Mode::kReplace);
    ASSERT_TRUE(f.open());
    EXPECT_TRUE(fs::exists(path + ".tmp"));
    EXPECT_FALSE(fs::exists(path));
    EXPECT_TRUE(f.write("<html>"));
    EXPECT_TRUE(f.close());
  }
  EXPECT_TRUE(fs::is_regular_file(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  {  // not closed (an exception while writing it): nothing replaces the file, no temporary stays
    OutputFile f("the report (--report)", path, OutputFile::Mode::kReplace);
    ASSERT_TRUE(f.open());
    EXPECT_TRUE(f.write("half"));
  }
  EXPECT_EQ(fs::file_size(path), 6u);
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  fs::remove_all(dir);
}

// A rename onto /dev/full would replace the device node (as root, /dev is writable): a
// character device is written directly, and its failure is heard.
TEST(OutputFile, ReplaceWritesACharacterDeviceDirectly) {
  if (!have_dev_full()) GTEST_SKIP() << "no /dev/full";
  {
    OutputFile null("the report (--report)", "/dev/null", OutputFile::Mode::kReplace);
    ASSERT_TRUE(null.open());
    EXPECT_TRUE(null.write("x") && null.close());
  }
  OutputFile f("the report (--report)", "/dev/full", OutputFile::Mode::kReplace);
  ::testing::internal::CaptureStderr();
  ASSERT_TRUE(f.open());
  EXPECT_FALSE(fs::exists("/dev/full.tmp"));
  f.write(std::string(1 << 16, 'x'));
  EXPECT_FALSE(f.close());
  expect_one_warning(::testing::internal::GetCapturedStderr(), "the report (--report)", "/dev/full");
  EXPECT_TRUE(fs::is_character_file("/dev/full"));
  EXPECT_FALSE(fs::exists("/dev/null.tmp"));
}

TEST(OutputFile, FifoOrDirectoryIsRefusedWithoutBlocking) {
  const fs::path dir = fresh_dir("outf");
  const std::string fifo = (dir / "fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& path : {fifo, dir.string()}) {
    OutputFile f("the metrics file (--metrics-file)", path);
    try {
      f.open_or_throw(ExitCode::kUsage);  // open(2) of a FIFO without O_NONBLOCK would block here
      FAIL() << "no error for " << path;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ExitCode::kUsage);
      const std::string want = path == fifo ? "is a FIFO (named pipe)" : "is a directory";
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  }
  fs::remove_all(dir);
}

TEST(Timeline, UnwritableFileIsALostOutputNotAnError) {
  if (!have_dev_full()) GTEST_SKIP() << "no /dev/full";
  auto comm = make_mpi_communicator(MPI_COMM_SELF);
  Timeline t(0, 16, {"fc:10"});
  t.align_clocks(*comm);
  const auto a = Timeline::Clock::now();
  for (int i = 0; i < 10; ++i) t.record(SpanKind::kStep, a, a + std::chrono::microseconds(10), i);
  OutputFile out("the timeline (--timeline)", "/dev/full", OutputFile::Mode::kReplace);
  ::testing::internal::CaptureStderr();
  EXPECT_NO_THROW(t.gather_and_write(*comm, &out, "h"));
  expect_one_warning(::testing::internal::GetCapturedStderr(), "the timeline (--timeline)", "/dev/full");
  EXPECT_TRUE(out.failed());
}

TEST(HtmlReport, UnwritableFileIsALostOutputNotAnError) {
  if (!have_dev_full()) GTEST_SKIP() << "no /dev/full";
  ReportData d;
  d.facts = {{"model", "fc:10"}};
  OutputFile out("the report (--report)", "/dev/full", OutputFile::Mode::kReplace);
  ::testing::internal::CaptureStderr();
  bool written = true;
  EXPECT_NO_THROW(written = write_html_report(out, d));
  expect_one_warning(::testing::internal::GetCapturedStderr(), "the report (--report)", "/dev/full");
  EXPECT_FALSE(written);
}

TEST(TensorBoard, DirectoryThatIsAFifoIsRefusedSayingSo) {
  const fs::path dir = fresh_dir("tbfifo");
  const std::string fifo = (dir / "fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  try {
    TensorBoardWriter w(fifo, "h");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kUsage);
    EXPECT_NE(std::string(e.what()).find("--tensorboard-dir '" + fifo + "' is a FIFO (named pipe), not a directory"),
              std::string::npos)
        << e.what();
  }
  fs::remove_all(dir);
}

// The event file's name holds the time in seconds: links with every name it can take point to /dev/full.
TEST(TensorBoard, FullDiskWarnsOnceAndTheRunGoesOn) {
  if (!have_dev_full()) GTEST_SKIP() << "no /dev/full";
  const fs::path dir = fresh_dir("tbfull");
  const auto now = static_cast<long long>(
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
  for (long long t = now - 1; t <= now + 5; ++t)
    fs::create_symlink("/dev/full",
                       dir / ("events.out.tfevents." + std::to_string(t) + ".h." + std::to_string(::getpid())));
  ::testing::internal::CaptureStderr();
  std::string path;
  EXPECT_NO_THROW({
    TensorBoardWriter w(dir.string(), "h");
    path = w.path();
    for (int i = 0; i < 10; ++i) w.scalars(i, {{"train/loss", 1.0}});
    EXPECT_TRUE(w.failed());
    EXPECT_FALSE(w.close());
    EXPECT_NE(w.lost().find("the TensorBoard file (--tensorboard-dir)"), std::string::npos);
  });
  expect_one_warning(::testing::internal::GetCapturedStderr(), "the TensorBoard file (--tensorboard-dir)", path);
  EXPECT_TRUE(fs::is_character_file("/dev/full"));
  fs::remove_all(dir);
}

// ---- the monitor: the metrics file and the verdict of the run ----

MonitorSetup small_setup() {
  MonitorSetup ms;
  // Not `ms.host = "h"`: GCC 12 at -O3 warns (-Wrestrict) about a 2^63-byte overlap in that
  // assignment once this function is inlined into a test, a known false positive of its memcpy check.
  ms.host.push_back('h');
  ms.total_steps = 4;
  ms.steps_per_epoch = 2;
  ms.global_batch = 8;
  ms.process_start = Monitor::Clock::now();
  return ms;
}

TEST(Monitor, LostMetricsFileIsReportedOnceListedAndAgreed) {
  if (!have_dev_full()) GTEST_SKIP() << "no /dev/full";
  auto comm = make_mpi_communicator(MPI_COMM_SELF);
  MonitorOptions opt;
  opt.quiet = true;
  opt.metrics_file = "/dev/full";
  Monitor m(opt, small_setup());
  ::testing::internal::CaptureStderr();
  ::testing::internal::CaptureStdout();
  for (int i = 0; i < 3; ++i) EXPECT_NO_THROW(m.on_log(i, 0.5, 0.01, 100.0));
  EXPECT_NO_THROW(m.finish(*comm, FinalFacts{}));
  const std::string out = ::testing::internal::GetCapturedStdout();
  expect_one_warning(::testing::internal::GetCapturedStderr(), "the metrics file (--metrics-file)", "/dev/full");
  EXPECT_TRUE(m.outputs_lost());
  ASSERT_EQ(m.lost_outputs().size(), 1u);
  EXPECT_NE(m.lost_outputs()[0].find("the metrics file (--metrics-file) '/dev/full'"), std::string::npos);
  EXPECT_NE(out.find("outputs lost (training finished; exit code 7):\n  the metrics file (--metrics-file) '/dev/full'"),
            std::string::npos)
      << out;
}

TEST(Monitor, NothingLostWhenEveryOutputIsWritten) {
  auto comm = make_mpi_communicator(MPI_COMM_SELF);
  const fs::path dir = fresh_dir("mon");
  MonitorOptions opt;
  opt.model = Options{}.model;  // the banner's default model
  opt.quiet = true;
  opt.metrics_file = (dir / "m.jsonl").string();
  opt.report_file = (dir / "r.html").string();
  Monitor m(opt, small_setup());
  m.on_start(StartFacts{});
  ::testing::internal::CaptureStdout();
  m.finish(*comm, FinalFacts{});
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_FALSE(m.outputs_lost());
  EXPECT_TRUE(m.lost_outputs().empty());
  EXPECT_EQ(out.find("outputs lost"), std::string::npos);
  std::ifstream in(opt.metrics_file);
  std::string line;
  std::getline(in, line);
  EXPECT_EQ(
      line,
      "{\"event\":\"start\",\"format\":1,\"version\":\"" MNIST_MPI_VERSION "\",\"config\":\"\",\"model\":\"conv:5x5:32:same,relu,maxpool:2,conv:5x5:64:same,relu,maxpool:2,flatten,fc:1024,relu,dropout:0.5,fc:10\",\"precision\":\"fp32\",\"exact_sums\":false,"
      "\"optimizer\":\"adam\",\"lr\":0.001,\"seed\":42,\"steps_per_epoch\":2,\"total_steps\":4,\"world_size\":1,\"global_batch\":8,\"launcher\":\"direct\",\"shard_optimizer\":false,\"grad_compression\":\"none\","
      "\"optimizer_state_bytes_per_rank\":0,\"optimizer_state_bytes_total\":0}");
  EXPECT_TRUE(fs::is_regular_file(opt.report_file));
  fs::remove_all(dir);
}

FinalFacts some_final_facts() {
  FinalFacts f;
  f.steps = 4;
  f.epochs = 2.0;
  f.startup_s = 0.25;
  f.images_per_s = 1000.25;
  f.test_accuracy = 0.9;
  f.test_loss = 0.25;
  f.params_hash = "0123456789abcdef";
  f.model = "fc:10";
  f.wall_s = 1.5;
  f.eval_s = 0.3;
  f.peak_rss_kib = {111575, 102400};
  f.per_step = StepTiming{0.125, 0.0625, 0.25, 0.5, 0.03125, 40};
  f.params = 10;
  f.checkpoints.written = 2;
  f.checkpoints.bytes = 1234;
  f.checkpoints.capture_ms = 3;
  f.checkpoints.write_ms = 5;
  f.checkpoints.others_wait_ms = 0.5;
  f.checkpoints.others_wait_baseline_ms = 0.25;
  f.skipped_steps = 1;
  return f;
}

// some_final_facts() and every field it leaves empty: two ranks, a straggler, a target reached.
FinalFacts full_final_facts() {
  FinalFacts f = some_final_facts();
  f.target = TargetFacts{.accuracy = 0.98, .reached = true, .step = 3, .validation_accuracy = 0.981,
                         .time_from_process_start_s = 1.25};
  f.ranks = {RankTimes{0, "a", StepTiming{.forward = 6e-3, .backward = 0.013}},
             RankTimes{1, "b", StepTiming{.forward = 9e-3, .backward = 0.02}}};
  f.straggler = Straggler{.rank = 1, .host = "b", .phase = "backward", .slower = 0.5, .phase_slower = 0.54,
                          .others_waited_s = 0.2};
  return f;
}

// Note in include/mnist_mpi/report/run_summary.hpp: the "final" event reads back as the summary it
// was written from: the same facts, the same time, the same figures.
TEST(RunSummary, TheFinalEventReadsBackAsTheSameSummary) {
  RunSummary s;
  s.config = "configs/lenet.ini";
  s.model = "flatten,fc:10";
  s.precision = "bf16";
  s.optimizer = "sgd";
  s.exact_sums = true;
  s.seed = 7;
  s.world_size = 2;
  s.global_batch = 100;
  s.steps_per_epoch = 32;
  s.end = full_final_facts();
  s.buckets = 5;
  s.process_s = 14.0;
  s.time = {{"start-up", 0.3}, {"data", 0.1}, {"forward", 3.0}, {"backward", 7.0}, {"exposed communication", 0.2},
            {"optimizer", 0.6}, {"evaluation", 0.9}, {"other", 1.9}};
  const Json start{{"event", "start"},          {"config", s.config},        {"model", s.model},
                   {"precision", s.precision},  {"exact_sums", s.exact_sums}, {"optimizer", s.optimizer},
                   {"seed", s.seed},            {"steps_per_epoch", 32},     {"world_size", 2},
                   {"global_batch", 100}};
  const Json final_event = Json::parse(json_text(s.final_event()));  // through the text, as a file holds it
  const RunSummary r = RunSummary::from_events(start, final_event);
  EXPECT_EQ(r.facts(), s.facts());
  ASSERT_EQ(r.time.size(), s.time.size());
  for (std::size_t i = 0; i < s.time.size(); ++i) {
    EXPECT_EQ(r.time[i].name, s.time[i].name);
    EXPECT_EQ(r.time[i].seconds, s.time[i].seconds);
  }
  EXPECT_EQ(r.process_s, s.process_s);
  EXPECT_EQ(r.buckets, 5);
  EXPECT_EQ(r.end.eval_s, 0.3);
  EXPECT_EQ(r.end.per_step.backward, s.end.per_step.backward);
  EXPECT_EQ(r.end.per_step.reduced_bytes, s.end.per_step.reduced_bytes);
  EXPECT_EQ(r.end.checkpoints.written, 2);
  EXPECT_EQ(r.end.checkpoints.write_ms, 5);  // a total: written as 2.5 ms each
  EXPECT_EQ(r.end.target.step, 3);
  EXPECT_EQ(r.end.straggler.rank, 1);
  EXPECT_EQ(r.end.straggler.phase, "backward");
  ASSERT_EQ(r.end.ranks.size(), 2u);
  EXPECT_EQ(r.end.ranks[1].per_step.backward, 0.02);
  EXPECT_EQ(r.straggler_line(), s.straggler_line());
  EXPECT_NE(s.straggler_line().find("rank 1 on host b"), std::string::npos) << s.straggler_line();
  EXPECT_EQ(r.end.peak_rss_kib, s.end.peak_rss_kib);
  // A file of an earlier version (no "time_s"): the steps' phases from the means per step.
  Json old = final_event;
  old.erase("time_s");
  const RunSummary o = RunSummary::from_events(start, old);
  ASSERT_EQ(o.time.size(), 6u);
  EXPECT_EQ(o.time[3].name, "backward");
  EXPECT_DOUBLE_EQ(o.time[3].seconds, 0.25 * 4);
}

// The report drawn at the end of training (--report) and `mnist_mpi report` on the run's metrics
// file show the same facts under the same names and the same time: both come from one summary.
TEST(RunSummary, TheLiveReportAndTheReportCommandAgree) {
  auto comm = make_mpi_communicator(MPI_COMM_SELF);
  const fs::path dir = fresh_dir("summary");
  MonitorOptions opt;
  opt.quiet = true;
  opt.config_file = "configs/tiny.ini";
  opt.metrics_file = (dir / "m.jsonl").string();
  opt.report_file = (dir / "r.html").string();
  Monitor m(opt, small_setup());
  m.on_start(StartFacts{});
  FinalFacts f = full_final_facts();
  f.ranks.resize(1);  // a one-rank run
  f.straggler = Straggler{};
  m.on_log(1, 0.5, 0.01, 100.0);
  m.on_final(f);
  ::testing::internal::CaptureStdout();
  m.finish(*comm, f);
  ::testing::internal::GetCapturedStdout();
  const auto embedded = [](const std::string& path) {
    std::ifstream in(path);
    const std::string html((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const std::string open = "<script type=\"application/json\" id=\"mnist-mpi-report\">\n";
    const std::size_t a = html.find(open), b = html.find("\n</script>", a);
    EXPECT_NE(a, std::string::npos) << path;
    return Json::parse(html.substr(a + open.size(), b - a - open.size()));
  };
  const Json live = embedded(opt.report_file);
  const LabelledRun run = read_metrics_file(opt.metrics_file);
  ReportData from_file = run.data;
  ASSERT_FALSE(from_file.facts.empty());
  EXPECT_EQ(from_file.facts.front().first, "file");
  from_file.facts.erase(from_file.facts.begin());
  Json facts = Json::object();
  for (const auto& [k, v] : from_file.facts) facts[k] = v;
  EXPECT_EQ(live["facts"], facts);
  EXPECT_EQ(live["facts"]["wall time of training"], "1.50 s");
  EXPECT_EQ(live["facts"]["config"], "configs/tiny.ini");
  ASSERT_EQ(live["time_s"].size(), from_file.time.size());
  for (const TimeShare& t : from_file.time) EXPECT_EQ(live["time_s"][t.name].get<double>(), t.seconds) << t.name;
  fs::remove_all(dir);
}

TEST(Monitor, MetricsFileThatIsADirectoryOrAFifoIsRefusedAtSetUp) {
  const fs::path dir = fresh_dir("monbad");
  const std::string fifo = (dir / "fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& path : {fifo, dir.string()}) {
    MonitorOptions opt;
    opt.quiet = true;
    opt.metrics_file = path;
    try {
      Monitor m(opt, small_setup());
      FAIL() << "no error for " << path;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ExitCode::kUsage);
      EXPECT_NE(std::string(e.what()).find("--metrics-file '" + path + "' is " +
                                           (path == fifo ? "a FIFO (named pipe)" : "a directory")),
                std::string::npos)
          << e.what();
    }
  }
  fs::remove_all(dir);
}

// ---- JSON (Note [Numbers in JSON]) and every event of the metrics file ----

TEST(Json, NumbersAreNullWhenNotFiniteWholeWithoutAFractionElseExact) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const Json j{{"nan", json_number(std::nan(""))}, {"inf", json_number(kInf)},        {"-inf", json_number(-kInf)},
               {"two", json_number(2.0)},          {"tenth", json_number(0.1)},       {"third", json_number(1.0 / 3.0)},
               {"big", json_number(1e300)},        {"us", json_number(1234567 / 1e3)}};
  EXPECT_EQ(json_text(j),
            "{\"nan\":null,\"inf\":null,\"-inf\":null,\"two\":2,\"tenth\":0.1,"
            "\"third\":0.3333333333333333,\"big\":1e+300,\"us\":1234.567}");
  EXPECT_EQ(json_text(Json(kInf)), "null");  // even a double that did not go through json_number
}

TEST(Json, TextThatIsNotUtf8IsReplacedNotThrown) {
  std::string text;
  EXPECT_NO_THROW(text = json_text(Json{{"host", "a\xff<\"\n"}}));
  EXPECT_EQ(text, "{\"host\":\"a\xef\xbf\xbd<\\\"\\n\"}");
}

std::vector<std::string> lines_of(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

TEST(Monitor, WritesEveryMetricsEventWithItsMembersInOrder) {
  auto comm = make_mpi_communicator(MPI_COMM_SELF);
  const fs::path dir = fresh_dir("events");
  MonitorOptions opt;
  opt.model = Options{}.model;  // the banner's default model
  opt.quiet = true;
  opt.metrics_file = (dir / "m.jsonl").string();
  MonitorSetup ms = small_setup();
  ms.buckets = 1;
  Monitor m(opt, ms);
  StartFacts start;
  start.launch.launcher = "srun";
  start.launch.slurm_job_id = "42";
  start.launch.slurm_job_name = "j";
  start.shard_optimizer = true;
  start.optimizer_state_bytes = 31400;
  start.optimizer_state_total_bytes = 62800;
  const auto t = Monitor::Clock::now();
  constexpr double kInf = std::numeric_limits<double>::infinity();
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  m.on_start(start);
  m.on_step(0, StepTiming{}, t);
  m.on_step(1, StepTiming{}, t);
  m.on_log(1, std::nan(""), kInf, -kInf);  // a diverged loss; a rate over no time
  m.on_eval(2, 0, "validation", 0.875, 0.5, t, t);
  m.on_eval(4, 1, "test", 0.9, 0.25, t, t, true);
  m.on_preempted(PreemptedFacts{"SIGTERM", 4, true, "ck/step-4.ckpt"});
  m.on_final(some_final_facts());
  m.finish(*comm, FinalFacts{});
  EXPECT_EQ(::testing::internal::GetCapturedStdout().find("params_hash"), std::string::npos);  // --quiet
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err,
            "mnist_mpi: stopped by SIGTERM after step 4 of 4: checkpoint ck/step-4.ckpt written; rerun with "
            "--resume auto to continue (exit code 75)\n");
  const std::string slurm = ",\"slurm_job_id\":\"42\",\"slurm_job_name\":\"j\",\"slurm_restart_count\":0}";
  const std::vector<std::string> want{
      "{\"event\":\"start\",\"format\":1,\"version\":\"" MNIST_MPI_VERSION "\",\"config\":\"\",\"model\":\"conv:5x5:32:same,relu,maxpool:2,conv:5x5:64:same,relu,maxpool:2,flatten,fc:1024,relu,dropout:0.5,fc:10\",\"precision\":\"fp32\",\"exact_sums\":false,"
      "\"optimizer\":\"adam\",\"lr\":0.001,\"seed\":42,\"steps_per_epoch\":2,\"total_steps\":4,\"world_size\":1,\"global_batch\":8,\"launcher\":\"srun\"" +
          slurm.substr(0, slurm.size() - 1) +
          ",\"shard_optimizer\":true,\"grad_compression\":\"none\",\"optimizer_state_bytes_per_rank\":31400,\"optimizer_state_bytes_total\":62800}",
      "{\"event\":\"step\",\"step\":2,\"epoch\":1,\"loss\":null,\"lr\":null,\"images_per_s\":null}",
      "{\"event\":\"eval\",\"split\":\"validation\",\"step\":2,\"epoch\":1,\"accuracy\":0.875,\"loss\":0.5}",
      "{\"event\":\"eval\",\"split\":\"test\",\"step\":4,\"accuracy\":0.9,\"loss\":0.25}",
      "{\"event\":\"preempted\",\"signal\":\"SIGTERM\",\"step\":4,\"checkpoint\":\"ck/step-4.ckpt\"" + slurm,
      "{\"event\":\"final\",\"test_accuracy\":0.9,\"test_loss\":0.25,\"steps\":4,\"epochs\":2,\"world_size\":1,"
      "\"global_batch\":8,\"wall_s\":1.5,\"images_per_s\":1000.25,\"startup_s\":0.25,\"eval_s\":0.3,"
      "\"peak_rss_mb\":[108.9599609375,100],\"step_ms\":{\"data\":125,\"forward\":62.5,\"backward\":250,"
      "\"exposed_comm\":500,\"optimizer\":31.25},\"reduced_bytes_per_step\":40,\"buckets\":1,\"skipped_steps\":1,\"exact_chunk\":0,\"exact_sum_probes\":0,"
      "\"params_hash\":\"0123456789abcdef\",\"checkpoints\":{\"written\":2,\"bytes\":1234,\"capture_ms\":1.5,"
      "\"write_ms\":2.5,\"others_wait_ms\":0.5,\"others_wait_baseline_ms\":0.25},\"ranks\":[],\"straggler\":null,"
      "\"process_s\":P,\"time_s\":{\"start-up\":0.25,\"data\":0,\"forward\":0,\"backward\":0,"
      "\"exposed communication\":0,\"optimizer\":0,\"evaluation\":0,\"other\":0}" +
          slurm};
  std::vector<std::string> got = lines_of(opt.metrics_file);
  // process_s is this process's time since small_setup(): a plain number, replaced before comparing.
  // (By hand, not std::regex: its templates took 10 s of this file's 38 s to compile under ASan.)
  ASSERT_FALSE(got.empty());
  const std::string key = "\"process_s\":";
  const std::size_t at = got.back().find(key);
  ASSERT_NE(at, std::string::npos) << got.back();
  const std::size_t first = at + key.size();
  const std::size_t end = got.back().find_first_not_of("0123456789.e+-", first);
  ASSERT_TRUE(end != std::string::npos && end > first && std::isdigit(static_cast<unsigned char>(got.back()[first])) &&
              got.back()[end] == ',')
      << got.back();
  got.back().replace(first, end - first, "P");
  EXPECT_EQ(got, want);
  fs::remove_all(dir);
}

TEST(Monitor, PrintsTheBannerSkippedStepsAndTheFinalReport) {
  auto comm = make_mpi_communicator(MPI_COMM_SELF);
  MonitorOptions opt;
  opt.progress = "lines";
  opt.data_dir = "d";
  opt.skip_nonfinite_steps = true;
  MonitorSetup ms = small_setup();
  ms.buckets = 1;
  Monitor m(opt, ms);
  StartFacts start;
  start.backend = "cpu";
  start.threads = 2;
  start.launch.launcher = "mpirun";
  start.train_images = 100;
  start.validation_images = 10;
  start.test_images = 20;
  start.model = "fc:10";
  start.params = 7850;
  start.layers = "  layer 0 fc:10 (10,1,1): fc\n";
  start.per_rank_batch = 8;
  start.gradient_progress = "summed on a communication thread while backward runs";
  start.optimizer_state_bytes = start.optimizer_state_total_bytes = 62800;  // Adam's m and v
  ::testing::internal::CaptureStdout();
  m.on_start(start);
  m.on_skipped_step(2, "the loss was not finite on rank 0");
  m.on_final(some_final_facts());
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(out,
            "mnist_mpi " MNIST_MPI_VERSION
            ": 1 rank(s), backend cpu, 2 thread(s) per rank\n"
            "launch: mpirun\n"
            "data: 100 train, 10 validation, 20 test images from d\n"
            "model: fc:10 (7850 parameters)\n"
            "  layer 0 fc:10 (10,1,1): fc\n"
            "batch: 8 global, 8 per rank; 2 steps per epoch, 4 steps\n"
            "gradients: 1 bucket(s) of at most 4 MB (first 1 MB), summed on a communication thread while backward "
            "runs\n"
            "optimizer state: 0.1 MB per rank (not sharded)\n"
            "epoch 2 step 3/4 skipped: non-finite gradient (the loss was not finite on rank 0)\n"
            "test accuracy 0.9000 loss 0.2500 after 4 steps (2.00 epochs)\n"
            "1000 images/s steady, wall 1.5 s (+ evaluation 0.3 s), start-up 0.25 s, peak RSS per rank "
            "109.0, 100.0 MB\n"
            "per step: data 125.00 ms, forward 62.50 ms, backward 250.00 ms, exposed communication 500.00 ms, "
            "optimizer 31.25 ms; 0.0 MB reduced\n"
            "checkpoints: 2 written, 0.00 MB each (parameters and optimizer state 0.00 MB + 1.1 KB); rank 0 copied the "
            "state in 1.50 ms, wrote it in 2.5 ms (in the background); the other ranks waited 0.50 ms at a checkpoint "
            "step (0.25 ms at other steps)\n"
            "1 non-finite step(s) skipped\n"
            "params_hash 0123456789abcdef\n");
  ::testing::internal::CaptureStdout();
  m.finish(*comm, FinalFacts{});
  ::testing::internal::GetCapturedStdout();
}

// ---- progress ----

TEST(Progress, LinesModePrintsTheLogLineOnly) {
  Progress p(ProgressMode::kLines, 20, 10, 50);
  ::testing::internal::CaptureStdout();
  const auto t = Progress::Clock::now();
  for (int s = 0; s < 5; ++s) p.step_done(s, t + std::chrono::seconds(s));
  p.log(4, 2.25, 0.001, 1234.4);
  p.line("epoch 1 step 5: validation accuracy 0.5000 loss 1.0000");
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(out,
            "epoch 1 step 5/20 loss 2.2500 lr 0.001 1234 img/s\n"
            "epoch 1 step 5: validation accuracy 0.5000 loss 1.0000\n");
}

TEST(Progress, BarRedrawsAtMostFourTimesASecondAndEndsEachEpochWithANewline) {
  Progress p(ProgressMode::kBar, 20, 10, 50);
  const auto t0 = Progress::Clock::now();
  p.start(t0);
  ::testing::internal::CaptureStdout();
  // Steps 0..9 within 100 ms: no redraw until the epoch's last step.
  for (int s = 0; s < 10; ++s) p.step_done(s, t0 + std::chrono::milliseconds(10 * (s + 1)));
  // Epoch 2: one step a second, so each is drawn.
  p.log(9, 1.5, 0.001, 0);
  for (int s = 10; s < 12; ++s) p.step_done(s, t0 + std::chrono::seconds(s - 8));
  p.line("an evaluation");
  const std::string out = ::testing::internal::GetCapturedStdout();
  const std::string first = "\repoch 1 [########################] 10/10 loss - 5000 img/s took 0:00\033[K\n";
  ASSERT_EQ(out.substr(0, first.size()), first);
  EXPECT_NE(out.find("\repoch 2 [##......................] 1/10 loss 1.5000 "), std::string::npos);
  EXPECT_NE(out.find("\repoch 2 [####....................] 2/10 loss 1.5000 34 img/s ETA 0:12"), std::string::npos);
  EXPECT_NE(out.find("\r\033[Kan evaluation\n"), std::string::npos);
  EXPECT_EQ(std::count(out.begin(), out.end(), '\r'), 4);  // epoch end, two redraws, the clear before the line
}

TEST(Progress, ModeOptionAndQuiet) {
  EXPECT_EQ(resolve_progress_mode("bar", false), ProgressMode::kBar);
  EXPECT_EQ(resolve_progress_mode("lines", false), ProgressMode::kLines);
  EXPECT_EQ(resolve_progress_mode("bar", true), ProgressMode::kOff);
  EXPECT_THROW(resolve_progress_mode("fancy", false), Error);
}

}  // namespace
}  // namespace mnist_mpi
