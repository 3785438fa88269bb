// The one JSON writer of the program: nlohmann::json, in the order the members were added
// (ordered_json), so that every line reads the same from run to run. The metrics file, the
// timeline (one event at a time: Note [Streaming the timeline] in src/report/timeline.cpp), the
// HTML report's data and the Slurm fields of the launch are built with it; nothing escapes JSON
// text by hand.
//
// Note [Numbers in JSON]
// JSON has no NaN or infinity: a number that is not finite (a diverged loss, a rate over zero
// seconds) is written as null. nlohmann already does that for any double, but json_number() says
// so where the value is made, and readers may count on it. A whole number is written without a
// fraction ("epochs":2, as the metrics files of earlier versions had it, and as greps of them
// expect), not nlohmann's "2.0"; any other double as the shortest text that reads back as the same
// double. Earlier versions rounded to 10 significant digits, so a learning rate of 0.01 x 0.7 read
// 0.007; it now reads 0.006999999999999999, the double the run used.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace mnist_mpi {

using Json = nlohmann::ordered_json;

// A double as a JSON value (Note [Numbers in JSON]).
Json json_number(double v);

// The compact text of j (no spaces, no newline: one line of a JSON-lines file). Bytes that are not
// UTF-8 (a host or job name from the environment) become U+FFFD instead of throwing.
std::string json_text(const Json& j);

}  // namespace mnist_mpi
