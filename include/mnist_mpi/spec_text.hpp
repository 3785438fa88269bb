// The text of a model spec (--model) cut into its layers' tokens and a token into its fields: the
// one reading of the spec's grammar, for its parser (src/model/spec.cpp) and for the option checks
// that need a layer's kind before the input's shape is known (src/config/combinations.cpp).
#pragma once

#include <string>
#include <vector>

namespace mnist_mpi {

// s split at every sep, blanks (space, tab, newline, carriage return) dropped: "conv: 5x5 , relu"
// at ',' gives "conv:5x5" and "relu". An empty s gives one empty piece.
inline std::vector<std::string> split_spec_text(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (const char ch : s) {
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

}  // namespace mnist_mpi
