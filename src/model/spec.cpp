// Parses the layer spec string, resolves every layer's shapes and padding, and lays out the
// parameter tensors in the flat buffers. Initialisers live here too (they need only the layout).
#include "mnist_mpi/model/spec.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <optional>
#include <sstream>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/rng.hpp"
#include "mnist_mpi/spec_text.hpp"

namespace mnist_mpi {
namespace {

// Every message quotes the user's text through quote_input() (Note [Quoting what the user wrote] in
// include/mnist_mpi/check.hpp): a spec of megabytes gives a one-line message.
[[noreturn]] void bad(const std::string& token, const std::string& why) {
  throw_error(ExitCode::kUsage, "model spec: bad layer " + quote_input(token) + ": " + why +
                                    " (see docs/usage.md, 'Writing a model spec')");
}

constexpr std::int64_t kMaxDim = std::numeric_limits<int>::max();

int to_int(const std::string& token, const std::string& s) {
  std::size_t pos = 0;
  long long v = 0;
  try {
    v = std::stoll(s, &pos);
  } catch (const std::out_of_range&) {
    bad(token, quote_input(s, 40) + " is too large (at most " + std::to_string(kMaxDim) + ")");
  } catch (const std::exception&) {
    bad(token, quote_input(s, 40) + " is not an integer");
  }
  if (pos != s.size()) bad(token, quote_input(s, 40) + " is not an integer");
  if (v <= 0) bad(token, quote_input(s, 40) + " must be positive");
  if (v > kMaxDim) bad(token, quote_input(s, 40) + " is too large (at most " + std::to_string(kMaxDim) + ")");
  return static_cast<int>(v);
}

float to_float(const std::string& what, const std::string& s) {
  std::size_t pos = 0;
  float v = 0;
  try {
    v = std::stof(s, &pos);
  } catch (const std::exception&) {
    pos = 0;
  }
  if (pos != s.size() || s.empty() || !std::isfinite(v))
    throw_error(ExitCode::kUsage, what + ": " + quote_input(s, 40) + " is not a number");
  return v;
}

// Note [Sizes of a model]
// Every size here comes from the user's spec, so it is computed in 64 bits with overflow checks
// (checked_mul / checked_add) and refused with a usage error naming the layer when it cannot be
// represented: `conv:1:3000000,flatten,fc:10` flattens to 2.35e9 values per image, which was
// cast to int and crashed init_params. Our kernels, cuDNN's and oneDNN's descriptors take a
// per-sample activation size and a weight's fan-in as int, so those are kept <= INT32_MAX; the
// parameter count and the offsets into the flat buffers are int64. Whether the model then fits in
// memory for a batch size is check_model_fits_memory()'s question.
void check_activation(const std::string& what, const Shape& out) {
  const std::optional<std::int64_t> hw = checked_mul(out.h, out.w);
  const std::optional<std::int64_t> n = hw ? checked_mul(out.c, *hw) : std::nullopt;
  if (n && *n <= kMaxDim) return;
  throw_error(ExitCode::kUsage, "model spec: " + what + " " + std::to_string(out.c) + "x" + std::to_string(out.h) +
                                    "x" + std::to_string(out.w) + (n ? " = " + std::to_string(*n) : std::string()) +
                                    " values per image, more than the " + std::to_string(kMaxDim) +
                                    " a tensor can hold; use fewer channels or units, or pool before it");
}

// One layer of a spec from its token (f: its fields split at ':'), on an input of shape cur: its
// kind, fields and output shape; a bad token is an Error(kUsage) naming it.
LayerSpec parse_layer(const std::string& token, const std::vector<std::string>& f, Shape cur) {
  LayerSpec l;
  l.text = token;
  l.in = cur;
  const std::string& kind = f[0];
  // Only a token of the table is a layer (Note [A layer kind's facts]), and every row has its case.
  if (std::none_of(std::begin(kLayerTraits), std::end(kLayerTraits), [&](const LayerTraits& t) { return kind == t.token; })) {
    std::string kinds;
    for (const LayerTraits& t : kLayerTraits) kinds += (kinds.empty() ? "" : ", ") + std::string(t.token);
    bad(token, "unknown layer kind " + quote_input(kind, 40) + " (" + kinds + ")");
  }
  if (kind == "conv") {
    if (f.size() < 3 || f.size() > 5) bad(token, "expected conv:KHxKW:CHANNELS[:same|valid][:sSTRIDE]");
    std::vector<std::string> k = split_spec_text(f[1], 'x');
    if (k.size() == 1) k.push_back(k[0]);
    if (k.size() != 2) bad(token, "kernel must be KxK or K");
    l.kind = LayerKind::kConv;
    l.kernel_h = to_int(token, k[0]);
    l.kernel_w = to_int(token, k[1]);
    l.channels = to_int(token, f[2]);
    l.same = true;
    for (std::size_t i = 3; i < f.size(); ++i) {
      if (f[i] == "same")
        l.same = true;
      else if (f[i] == "valid")
        l.same = false;
      else if (f[i].size() > 1 && f[i][0] == 's')
        l.stride = to_int(token, f[i].substr(1));
      else
        bad(token, "unknown field " + quote_input(f[i], 40) + " (same, valid or sSTRIDE)");
    }
    // In 64 bits: a kernel or stride near INT32_MAX overflows the sums in int (Note [Sizes of a model]).
    auto resolve = [&](int in, int ksize, int& lo, int& hi) {
      const std::int64_t in64 = in, k64 = ksize, s64 = l.stride;
      std::int64_t out = 0;
      if (l.same) {
        out = (in64 + s64 - 1) / s64;
        const std::int64_t total = std::max<std::int64_t>((out - 1) * s64 + k64 - in64, 0);
        if (total / 2 + 1 > kMaxDim) bad(token, "its padding " + std::to_string(total) + " is too large");
        lo = static_cast<int>(total / 2);  // TensorFlow's SAME: the extra row/column goes at the end
        hi = static_cast<int>(total - total / 2);
      } else {
        if (in < ksize) bad(token, "kernel larger than its input " + std::to_string(in));
        out = (in64 - k64) / s64 + 1;
        lo = hi = 0;
      }
      return static_cast<int>(out);  // <= in
    };
    l.out.c = l.channels;
    l.out.h = resolve(cur.h, l.kernel_h, l.pad_top, l.pad_bottom);
    l.out.w = resolve(cur.w, l.kernel_w, l.pad_left, l.pad_right);
  } else if (kind == "maxpool") {
    if (f.size() < 2 || f.size() > 3) bad(token, "expected maxpool:K[:STRIDE]");
    l.kind = LayerKind::kMaxPool;
    l.kernel_h = l.kernel_w = to_int(token, f[1]);
    l.stride = f.size() == 3 ? to_int(token, f[2]) : l.kernel_h;
    if (cur.h < l.kernel_h || cur.w < l.kernel_w) bad(token, "window larger than its input");
    l.out = {cur.c, (cur.h - l.kernel_h) / l.stride + 1, (cur.w - l.kernel_w) / l.stride + 1};
  } else if (kind == "relu") {
    if (f.size() != 1) bad(token, "relu takes no fields");
    l.kind = LayerKind::kRelu;
    l.out = cur;
  } else if (kind == "flatten") {
    if (f.size() != 1) bad(token, "flatten takes no fields");
    l.kind = LayerKind::kFlatten;
    l.out = {static_cast<int>(cur.size()), 1, 1};  // <= kMaxDim: checked for the input and every layer
  } else if (kind == "fc") {
    if (f.size() != 2) bad(token, "expected fc:UNITS");
    l.kind = LayerKind::kFc;
    l.channels = to_int(token, f[1]);
    l.out = {l.channels, 1, 1};  // an fc on a (C, H, W) input flattens it in C, H, W order
  } else if (kind == "dropout") {
    if (f.size() != 2) bad(token, "expected dropout:RATE");
    l.kind = LayerKind::kDropout;
    l.drop_rate = to_float("model spec: dropout rate in " + quote_input(token), f[1]);
    if (!(l.drop_rate >= 0.0f && l.drop_rate < 1.0f)) bad(token, "rate must be in [0, 1)");
    l.out = cur;
  } else if (kind == "batchnorm") {
    if (f.size() > 3) bad(token, "expected batchnorm[:MOMENTUM[:EPS]]");
    l.kind = LayerKind::kBatchNorm;
    if (f.size() >= 2) l.momentum = to_float("model spec: batchnorm momentum in " + quote_input(token), f[1]);
    if (f.size() == 3) l.eps = to_float("model spec: batchnorm eps in " + quote_input(token), f[2]);
    if (!(l.momentum > 0.0f && l.momentum <= 1.0f)) bad(token, "momentum must be in (0, 1]");
    if (!(l.eps > 0.0f)) bad(token, "eps must be positive");
    l.channels = cur.c;  // statistics per channel (per unit after an fc)
    l.out = cur;
  } else {
    throw_error(ExitCode::kRuntime, "model spec: layer kind '" + kind + "' has a row in kLayerTraits but no case here");
  }
  MNIST_CHECK(kind == layer_traits(l.kind).token, ExitCode::kRuntime,
              "model spec: the case of '" + kind + "' makes a layer of another kind's row");
  return l;
}

// Note [Reverse layer order]
// Parameters, gradients and optimiser state each live in one flat buffer, and the tensors are laid
// out from the LAST layer to the first. Backward produces gradients in that order, so the
// gradients that are ready first sit at the start of the buffer and a bucket is always one
// contiguous range [begin, end) of it: the allreduce runs in place, with no copy into a bucket.
// Within a layer the weight comes before the bias.
// The model state (Note [State that is not trained]) is laid out in the same order.
void lay_out_parameters(ModelSpec& spec) {
  std::int64_t offset = 0, state_offset = 0;
  for (int i = static_cast<int>(spec.layers.size()) - 1; i >= 0; --i) {
    const LayerSpec& l = spec.layers[static_cast<std::size_t>(i)];
    // Note [A layer kind's facts]: the row names the parameters of exactly the kinds laid out below.
    const char* middle = layer_traits(l.kind).param_prefix;
    const auto disagree = [&] {
      throw_error(ExitCode::kRuntime, "model spec: layer kind '" + std::string(layer_traits(l.kind).token) +
                                          "': its row in kLayerTraits and its parameter layout here disagree");
    };
    const std::string prefix = std::to_string(i) + (middle ? middle : "");
    ParamTensor w, b;
    std::optional<std::int64_t> fan_in, fan_out;  // Note [Sizes of a model]
    if (l.kind == LayerKind::kBatchNorm) {  // scale and shift, C each (<= kMaxDim: check_activation)
      w.shape = {l.channels};
      fan_in = fan_out = 1;
      w.is_scale = true;
      spec.state.push_back({prefix + ".running_mean", state_offset, l.channels, i, 0.0f});  // Note [State
      spec.state.push_back({prefix + ".running_var", state_offset + l.channels, l.channels, i, 1.0f});  // that is not trained]
      state_offset += 2 * static_cast<std::int64_t>(l.channels);
    } else if (l.kind == LayerKind::kConv) {
      w.shape = {l.channels, l.in.c, l.kernel_h, l.kernel_w};
      const std::optional<std::int64_t> window = checked_mul(l.kernel_h, l.kernel_w);
      fan_in = window ? checked_mul(l.in.c, *window) : std::nullopt;
      fan_out = window ? checked_mul(l.channels, *window) : std::nullopt;
    } else if (l.kind == LayerKind::kFc) {
      w.shape = {l.channels, static_cast<int>(l.in.size())};  // l.in.size() <= kMaxDim: check_activation
      fan_in = l.in.size();
      fan_out = l.channels;
    } else {
      if (middle) disagree();
      continue;  // no parameters
    }
    if (!middle) disagree();
    const std::string where = "model spec: layer " + std::to_string(i) + " " + quote_input(l.text);
    if (!fan_in || !fan_out || *fan_in > kMaxDim || *fan_out > kMaxDim)
      throw_error(ExitCode::kUsage, where + ": each of its " + std::to_string(l.channels) + " outputs sums " +
                                        (fan_in ? std::to_string(*fan_in) : std::string("more than 2^63")) +
                                        " inputs (a kernel takes at most " + std::to_string(kMaxDim) +
                                        "); use a smaller kernel, fewer channels or pool before it");
    w.fan_in = static_cast<int>(*fan_in);
    w.fan_out = static_cast<int>(*fan_out);
    w.name = prefix + ".weight";
    const std::optional<std::int64_t> weights =
        w.is_scale ? std::optional<std::int64_t>(l.channels) : checked_mul(l.channels, *fan_in);  // O * (I * KH * KW)
    if (!weights) throw_error(ExitCode::kUsage, where + " has more weights than 64 bits can count");
    w.size = *weights;
    b.name = prefix + ".bias";
    b.shape = {l.channels};
    b.size = l.channels;
    b.is_bias = true;
    b.fan_in = w.fan_in;
    b.fan_out = w.fan_out;
    w.layer = b.layer = i;
    w.offset = offset;
    const std::optional<std::int64_t> after = checked_add(offset, w.size);
    const std::optional<std::int64_t> end = after ? checked_add(*after, b.size) : std::nullopt;
    if (!end) throw_error(ExitCode::kUsage, where + ": the model has more parameters than 64 bits can count");
    b.offset = *after;
    offset = *end;
    spec.params.push_back(w);
    spec.params.push_back(b);
  }
  spec.param_count = offset;
  spec.state_count = state_offset;
}

}  // namespace

ModelSpec parse_model_spec(const std::string& text, Shape input, int num_classes) {
  ModelSpec spec;
  spec.text = text;
  spec.input = input;
  Shape cur = input;
  check_activation("the input has", input);  // from the data, or from a checkpoint being evaluated
  for (const std::string& token : split_spec_text(text, ',')) {
    if (token.empty())
      throw_error(ExitCode::kUsage, "model spec " + quote_input(text) + ": empty layer " +
                                        std::to_string(spec.layers.size()) + " (two commas?)");
    const LayerSpec l = parse_layer(token, split_spec_text(token, ':'), cur);
    check_activation("layer " + std::to_string(spec.layers.size()) + " " + quote_input(token) + " outputs", l.out);
    cur = l.out;
    spec.layers.push_back(l);
  }
  if (spec.layers.empty() || cur.size() != num_classes)
    throw_error(ExitCode::kUsage, "model spec " + quote_input(text) + " ends with " + std::to_string(cur.size()) +
                                      " outputs; the data has " + std::to_string(num_classes) +
                                      " classes (end it with fc:" + std::to_string(num_classes) + ")");
  lay_out_parameters(spec);
  return spec;
}

InitSpec parse_init_spec(const std::string& text) {
  InitSpec s;
  s.text = text;
  std::vector<std::string> f = split_spec_text(text, ':');
  const std::string what = "initialiser " + quote_input(text);
  auto need_value = [&](float dflt) {
    if (f.size() > 2) throw_error(ExitCode::kUsage, what + ": too many fields");
    return f.size() == 2 ? to_float(what, f[1]) : dflt;
  };
  if (f[0] == "truncated_normal") {
    s.kind = InitSpec::Kind::kTruncatedNormal;
    s.value = need_value(0.1f);
  } else if (f[0] == "normal") {
    s.kind = InitSpec::Kind::kNormal;
    s.value = need_value(0.1f);
  } else if (f[0] == "xavier" || f[0] == "glorot") {
    s.kind = InitSpec::Kind::kXavierUniform;
    need_value(0.0f);
  } else if (f[0] == "he") {
    s.kind = InitSpec::Kind::kHeNormal;
    need_value(0.0f);
  } else if (f[0] == "zeros") {
    if (f.size() != 1) throw_error(ExitCode::kUsage, what + ": zeros takes no value");
    s.kind = InitSpec::Kind::kConstant;
    s.value = 0.0f;
  } else if (f[0] == "constant") {
    s.kind = InitSpec::Kind::kConstant;
    s.value = need_value(0.0f);
  } else {
    throw_error(ExitCode::kUsage, what +
                                      ": unknown kind (truncated_normal:STD, normal:STD, xavier, he, "
                                      "zeros, constant:V)");
  }
  if (s.kind != InitSpec::Kind::kConstant && f.size() == 2 && !(s.value > 0.0f))
    throw_error(ExitCode::kUsage, what + ": stddev must be positive");
  return s;
}

// Note [Will the model fit?]
// A model that cannot fit used to end in std::bad_alloc (no layer named), or worse in the kernel's
// OOM killer after minutes of swapping, or in a segfault where a size wrapped. The trainer asks
// first: the bytes of the buffers it will allocate, added up with overflow checks (an overflow
// means "more than any machine has"), against the machine's physical memory. The message names the
// total and the layer holding the most, so the user knows what to shrink.
namespace {

std::string bytes_text(std::int64_t bytes) {
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 6) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
  return buf;
}

}  // namespace

MemoryEstimate estimate_model_memory(const ModelSpec& spec, std::int64_t train_batch, std::int64_t eval_batch,
                                     OptimizerKind optimizer, bool evaluates) {
  MemoryEstimate e;
  const std::int64_t f = sizeof(float);
  // checked a * b * c (nullopt on overflow)
  auto mul3 = [](std::int64_t a, std::int64_t b, std::int64_t c) -> std::optional<std::int64_t> {
    const std::optional<std::int64_t> ab = checked_mul(a, b);
    return ab ? checked_mul(*ab, c) : std::nullopt;
  };
  auto add = [&](std::int64_t& to, std::optional<std::int64_t> v) {
    const std::optional<std::int64_t> sum = v ? checked_add(to, *v) : std::nullopt;
    if (!sum)
      e.overflow = true;
    else
      to = *sum;
    return sum.has_value();
  };
  const std::int64_t state_copies = 2 + traits(optimizer).moments;  // parameters, gradients, moments
  const std::int64_t eval = evaluates ? eval_batch : 0;
  std::vector<std::int64_t> per_layer(spec.layers.size(), 0);
  // The input batch (no gradient), then each layer's output; flatten's output aliases its input.
  const std::optional<std::int64_t> input_images = checked_add(train_batch, eval);
  add(e.activation_bytes, input_images ? mul3(*input_images, spec.input.size(), f) : std::nullopt);
  for (std::size_t i = 0; i < spec.layers.size() && !e.overflow; ++i) {
    const LayerSpec& l = spec.layers[i];
    if (l.kind == LayerKind::kFlatten) continue;
    const std::int64_t copies = 2 * train_batch;  // activation and its gradient
    const std::optional<std::int64_t> images = checked_add(copies, eval);
    const std::optional<std::int64_t> bytes = images ? mul3(*images, l.out.size(), f) : std::nullopt;
    if (!add(per_layer[i], bytes) || !add(e.activation_bytes, bytes)) e.largest_layer = static_cast<int>(i);
  }
  for (const ParamTensor& p : spec.params) {
    if (e.overflow) break;
    const std::optional<std::int64_t> bytes = mul3(p.size, state_copies, f);
    if (!add(per_layer[static_cast<std::size_t>(p.layer)], bytes) || !add(e.state_bytes, bytes))
      e.largest_layer = p.layer;
  }
  if (!e.overflow) add(e.total_bytes, checked_add(e.state_bytes, e.activation_bytes));
  if (e.overflow) {
    e.total_bytes = std::numeric_limits<std::int64_t>::max();
    if (e.largest_layer >= 0) e.largest_layer_bytes = std::numeric_limits<std::int64_t>::max();
    return e;
  }
  for (std::size_t i = 0; i < per_layer.size(); ++i)
    if (per_layer[i] > e.largest_layer_bytes) {
      e.largest_layer_bytes = per_layer[i];
      e.largest_layer = static_cast<int>(i);
    }
  return e;
}

std::int64_t physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return 0;
  return checked_mul(pages, page).value_or(std::numeric_limits<std::int64_t>::max());
}

void check_model_fits_memory(const ModelSpec& spec, std::int64_t train_batch, std::int64_t eval_batch,
                             OptimizerKind optimizer, bool evaluates) {
  const std::int64_t physical = physical_memory_bytes();
  const MemoryEstimate e = estimate_model_memory(spec, train_batch, eval_batch, optimizer, evaluates);
  if (physical <= 0 || (!e.overflow && e.total_bytes <= physical)) return;
  const auto amount = [&](std::int64_t b) {
    return e.overflow ? std::string("more than 8 EiB") : "about " + bytes_text(b);
  };
  std::string msg = "the model needs " + amount(e.total_bytes) + " of memory on this rank (" +
                    std::to_string(spec.param_count) + " parameters with their gradients and " +
                    name_of(optimizer) + " state";
  if (!e.overflow) msg += ": " + bytes_text(e.state_bytes);
  msg += "; activations for a batch of " + std::to_string(train_batch) +
         (evaluates ? " and an evaluation batch of " + std::to_string(eval_batch) : std::string()) +
         (e.overflow ? std::string() : ": " + bytes_text(e.activation_bytes)) + "), more than this machine's " +
         bytes_text(physical);
  if (e.largest_layer >= 0) {
    const LayerSpec& l = spec.layers[static_cast<std::size_t>(e.largest_layer)];
    msg += "; the largest layer is " + std::to_string(e.largest_layer) + " " + quote_input(l.text) + " (" +
           amount(e.largest_layer_bytes) + ")";
  }
  throw_error(ExitCode::kUsage, msg + "; use a smaller --model or --batch-size");
}

void init_state(const ModelSpec& spec, float* state) {
  for (const StateTensor& s : spec.state) std::fill(state + s.offset, state + s.offset + s.size, s.initial);
}

void init_params(const ModelSpec& spec, const InitSpec& weight_init, const InitSpec& bias_init, std::uint64_t seed,
                 float* params) {
  const InitSpec one{InitSpec::Kind::kConstant, 1.0f, "constant:1"}, zero{InitSpec::Kind::kConstant, 0.0f, "zeros"};
  for (std::size_t t = 0; t < spec.params.size(); ++t) {
    const ParamTensor& p = spec.params[t];
    const bool norm = spec.layers[static_cast<std::size_t>(p.layer)].kind == LayerKind::kBatchNorm;
    const InitSpec& init = norm ? (p.is_scale ? one : zero) : p.is_bias ? bias_init : weight_init;
    float* out = params + p.offset;
    // Every element is a function of (seed, tensor, element, draw): no stream state.
    auto normal = [&](std::int64_t i, std::uint64_t draw) {
      double u1 = rng::uniform_open(rng::key(seed, 0x1417, t, static_cast<std::uint64_t>(i), 2 * draw));
      double u2 = rng::uniform_open(rng::key(seed, 0x1417, t, static_cast<std::uint64_t>(i), 2 * draw + 1));
      return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
    };
    for (std::int64_t i = 0; i < p.size; ++i) {
      double v = 0.0;
      switch (init.kind) {
        case InitSpec::Kind::kTruncatedNormal: {
          std::uint64_t draw = 0;
          do v = normal(i, draw++);  // resample beyond two standard deviations, as TensorFlow does
          while (std::abs(v) > 2.0);
          v *= init.value;
          break;
        }
        case InitSpec::Kind::kNormal:
          v = init.value * normal(i, 0);
          break;
        case InitSpec::Kind::kHeNormal:
          v = std::sqrt(2.0 / p.fan_in) * normal(i, 0);
          break;
        case InitSpec::Kind::kXavierUniform: {
          double limit = std::sqrt(6.0 / (p.fan_in + p.fan_out));
          v = limit * (2.0 * rng::uniform_open(rng::key(seed, 0x1417, t, static_cast<std::uint64_t>(i), 7)) - 1.0);
          break;
        }
        case InitSpec::Kind::kConstant:
          v = init.value;
          break;
      }
      out[i] = static_cast<float>(v);
    }
  }
}

}  // namespace mnist_mpi
