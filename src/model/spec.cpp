// Parses the layer spec string, resolves every layer's shapes and padding, and lays out the
// parameter tensors in the flat buffers. Initialisers live here too (they need only the layout).
#include "mnist_mpi/model/spec.hpp"

#include <cmath>
#include <sstream>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/rng.hpp"

namespace mnist_mpi {
namespace {

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char ch : s) {
    if (ch == sep) {
      out.push_back(cur);
      cur.clear();
    } else if (ch != ' ' && ch != '\t' && ch != '\n' && ch != '\r') {
      cur += ch;
    }
  }
  out.push_back(cur);
  return out;
}

[[noreturn]] void bad(const std::string& token, const std::string& why) {
  throw_error(ExitCode::kUsage, "model spec: bad layer '" + token + "': " + why +
                                    " (see README.md, 'Writing a model spec')");
}

int to_int(const std::string& token, const std::string& s) {
  std::size_t pos = 0;
  int v = 0;
  try {
    v = std::stoi(s, &pos);
  } catch (const std::exception&) {
    bad(token, "'" + s + "' is not an integer");
  }
  if (pos != s.size()) bad(token, "'" + s + "' is not an integer");
  if (v <= 0) bad(token, "'" + s + "' must be positive");
  return v;
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
    throw_error(ExitCode::kUsage, what + ": '" + s + "' is not a number");
  return v;
}

}  // namespace

// Note [Reverse layer order]
// Parameters, gradients and optimiser state each live in one flat buffer, and the tensors are laid
// out from the LAST layer to the first. Backward produces gradients in that order, so the
// gradients that are ready first sit at the start of the buffer and a bucket is always one
// contiguous range [begin, end) of it: the allreduce runs in place, with no copy into a bucket.
// Within a layer the weight comes before the bias.
ModelSpec parse_model_spec(const std::string& text, Shape input, int num_classes) {
  ModelSpec spec;
  spec.text = text;
  spec.input = input;
  Shape cur = input;
  for (const std::string& token : split(text, ',')) {
    if (token.empty()) throw_error(ExitCode::kUsage, "model spec '" + text + "': empty layer (two commas?)");
    std::vector<std::string> f = split(token, ':');
    LayerSpec l;
    l.text = token;
    l.in = cur;
    const std::string& kind = f[0];
    if (kind == "conv") {
      if (f.size() < 3 || f.size() > 5) bad(token, "expected conv:KHxKW:CHANNELS[:same|valid][:sSTRIDE]");
      std::vector<std::string> k = split(f[1], 'x');
      if (k.size() == 1) k.push_back(k[0]);
      if (k.size() != 2) bad(token, "kernel must be KxK or K");
      l.kind = LayerKind::kConv;
      l.kernel_h = to_int(token, k[0]);
      l.kernel_w = to_int(token, k[1]);
      l.channels = to_int(token, f[2]);
      l.same = true;
      for (std::size_t i = 3; i < f.size(); ++i) {
        if (f[i] == "same") l.same = true;
        else if (f[i] == "valid") l.same = false;
        else if (f[i].size() > 1 && f[i][0] == 's') l.stride = to_int(token, f[i].substr(1));
        else bad(token, "unknown field '" + f[i] + "' (same, valid or sSTRIDE)");
      }
      auto resolve = [&](int in, int ksize, int& lo, int& hi) {
        int out = 0;
        if (l.same) {
          out = (in + l.stride - 1) / l.stride;
          int total = std::max((out - 1) * l.stride + ksize - in, 0);
          lo = total / 2;  // TensorFlow's SAME: the extra row/column goes at the end
          hi = total - lo;
        } else {
          if (in < ksize) bad(token, "kernel larger than its input " + std::to_string(in));
          out = (in - ksize) / l.stride + 1;
          lo = hi = 0;
        }
        return out;
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
      l.out = {static_cast<int>(cur.size()), 1, 1};
    } else if (kind == "fc") {
      if (f.size() != 2) bad(token, "expected fc:UNITS");
      l.kind = LayerKind::kFc;
      l.channels = to_int(token, f[1]);
      l.out = {l.channels, 1, 1};  // an fc on a (C, H, W) input flattens it in C, H, W order
    } else if (kind == "dropout") {
      if (f.size() != 2) bad(token, "expected dropout:RATE");
      l.kind = LayerKind::kDropout;
      l.drop_rate = to_float("model spec: dropout rate in '" + token + "'", f[1]);
      if (!(l.drop_rate >= 0.0f && l.drop_rate < 1.0f)) bad(token, "rate must be in [0, 1)");
      l.out = cur;
    } else {
      bad(token, "unknown layer kind '" + kind + "' (conv, maxpool, relu, flatten, fc, dropout)");
    }
    cur = l.out;
    spec.layers.push_back(l);
  }
  if (spec.layers.empty() || cur.size() != num_classes)
    throw_error(ExitCode::kUsage, "model spec '" + text + "' ends with " + std::to_string(cur.size()) +
                                      " outputs; the data has " + std::to_string(num_classes) +
                                      " classes (end it with fc:" + std::to_string(num_classes) + ")");

  std::int64_t offset = 0;
  for (int i = static_cast<int>(spec.layers.size()) - 1; i >= 0; --i) {
    const LayerSpec& l = spec.layers[static_cast<std::size_t>(i)];
    const std::string prefix = std::to_string(i) + (l.kind == LayerKind::kConv ? ".conv" : ".fc");
    ParamTensor w, b;
    if (l.kind == LayerKind::kConv) {
      w.shape = {l.channels, l.in.c, l.kernel_h, l.kernel_w};
      w.fan_in = l.in.c * l.kernel_h * l.kernel_w;
      w.fan_out = l.channels * l.kernel_h * l.kernel_w;
    } else if (l.kind == LayerKind::kFc) {
      w.shape = {l.channels, static_cast<int>(l.in.size())};
      w.fan_in = static_cast<int>(l.in.size());
      w.fan_out = l.channels;
    } else {
      continue;
    }
    w.name = prefix + ".weight";
    w.size = 1;
    for (int d : w.shape) w.size *= d;
    b.name = prefix + ".bias";
    b.shape = {l.channels};
    b.size = l.channels;
    b.is_bias = true;
    b.fan_in = w.fan_in;
    b.fan_out = w.fan_out;
    w.layer = b.layer = i;
    w.offset = offset;
    offset += w.size;
    b.offset = offset;
    offset += b.size;
    spec.params.push_back(w);
    spec.params.push_back(b);
  }
  spec.param_count = offset;
  return spec;
}

InitSpec parse_init_spec(const std::string& text) {
  InitSpec s;
  s.text = text;
  std::vector<std::string> f = split(text, ':');
  const std::string what = "initialiser '" + text + "'";
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
    throw_error(ExitCode::kUsage, what + ": unknown kind (truncated_normal:STD, normal:STD, xavier, he, "
                                         "zeros, constant:V)");
  }
  if (s.kind != InitSpec::Kind::kConstant && f.size() == 2 && !(s.value > 0.0f))
    throw_error(ExitCode::kUsage, what + ": stddev must be positive");
  return s;
}

void init_params(const ModelSpec& spec, const InitSpec& weight_init, const InitSpec& bias_init,
                 std::uint64_t seed, float* params) {
  for (std::size_t t = 0; t < spec.params.size(); ++t) {
    const ParamTensor& p = spec.params[t];
    const InitSpec& init = p.is_bias ? bias_init : weight_init;
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
        case InitSpec::Kind::kNormal: v = init.value * normal(i, 0); break;
        case InitSpec::Kind::kHeNormal: v = std::sqrt(2.0 / p.fan_in) * normal(i, 0); break;
        case InitSpec::Kind::kXavierUniform: {
          double limit = std::sqrt(6.0 / (p.fan_in + p.fan_out));
          v = limit * (2.0 * rng::uniform_open(rng::key(seed, 0x1417, t, static_cast<std::uint64_t>(i), 7)) - 1.0);
          break;
        }
        case InitSpec::Kind::kConstant: v = init.value; break;
      }
      out[i] = static_cast<float>(v);
    }
  }
}

}  // namespace mnist_mpi
