// The comparison of a command's inputs and outputs (Note [No output is an input] in
// include/mnist_mpi/io/file_roles.hpp).
#include "mnist_mpi/io/file_roles.hpp"

#include <sys/stat.h>

#include <filesystem>
#include <utility>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/io/file_kind.hpp"

namespace mnist_mpi {
namespace {

namespace fs = std::filesystem;

// What a path is: its device and inode when it exists (links followed), and its resolved absolute
// path, split into directory and name.
struct Identity {
  bool exists = false;
  bool device = false;  // a character device (/dev/null): any number of outputs may go there
  dev_t dev{};
  ino_t ino{};
  std::string resolved, dir, name;
};

Identity identify(const std::string& path) {
  Identity id;
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    id.exists = true;
    id.device = S_ISCHR(st.st_mode);
    id.dev = st.st_dev;
    id.ino = st.st_ino;
  }
  std::error_code ec;
  const fs::path absolute = fs::absolute(path, ec);
  fs::path r = fs::weakly_canonical(absolute, ec);
  if (ec) r = absolute.lexically_normal();
  if (!r.has_filename()) r = r.parent_path();  // "dir/" names "dir"
  id.resolved = r.string();
  id.dir = r.parent_path().string();
  id.name = r.filename().string();
  return id;
}

bool same_file(const Identity& a, const Identity& b) {
  return (a.exists && b.exists && a.dev == b.dev && a.ino == b.ino) || a.resolved == b.resolved;
}

// "--timeline and --report both name 'run.json'" or, when the texts differ (a link, another
// spelling), "--metrics-file 'm.jsonl' and --data-dir (the training images) 'data/x' are the same file".
std::string both(const std::string& opt_a, const std::string& path_a, const std::string& opt_b,
                 const std::string& path_b) {
  if (path_a == path_b) return opt_a + " and " + opt_b + " both name " + quote_input(path_a);
  return opt_a + " " + quote_input(path_a) + " and " + opt_b + " " + quote_input(path_b) + " are the same file";
}

}  // namespace

void FileRoles::input(std::string option, std::string path, std::string owner) {
  files_.push_back({std::move(option), std::move(path), std::move(owner), false});
}

void FileRoles::output(std::string option, std::string path) {
  files_.push_back({std::move(option), std::move(path), {}, true});
}

void FileRoles::replaced_output(const std::string& option, const std::string& path, const std::string& suffix) {
  output(option, path);
  if (file_kind(path) != FileKind::kCharDevice) output(option + " (its temporary file)", path + suffix);
}

void FileRoles::outputs_in(std::string option, std::string dir, std::function<bool(std::string_view)> matches,
                           std::string names, std::string owner) {
  families_.push_back({std::move(option), std::move(dir), std::move(names), std::move(owner), std::move(matches)});
}

void FileRoles::check() const {
  std::vector<Identity> ids;
  ids.reserve(files_.size());
  for (const File& f : files_) ids.push_back(identify(f.path));
  for (std::size_t o = 0; o < files_.size(); ++o) {
    const File& out = files_[o];
    if (!out.output || ids[o].device) continue;
    for (std::size_t i = 0; i < files_.size(); ++i) {  // the inputs first: losing one is the worse outcome
      if (i == o || files_[i].output || !same_file(ids[o], ids[i])) continue;
      throw_error(ExitCode::kUsage, both(out.option, out.path, files_[i].option, files_[i].path) +
                                        ": writing the output would destroy the input; give " + out.option +
                                        " another path");
    }
    for (std::size_t i = o + 1; i < files_.size(); ++i) {
      if (!files_[i].output || ids[i].device || !same_file(ids[o], ids[i])) continue;
      throw_error(ExitCode::kUsage, both(out.option, out.path, files_[i].option, files_[i].path) +
                                        ": one output would replace the other; give each its own path");
    }
  }
  for (const Family& fam : families_) {
    const std::string dir = identify(fam.dir).resolved;
    for (std::size_t i = 0; i < files_.size(); ++i) {
      const File& f = files_[i];
      if (ids[i].device || ids[i].dir != dir || !fam.matches(ids[i].name)) continue;
      if (!f.output && !fam.owner.empty() && f.owner == fam.owner) continue;
      throw_error(ExitCode::kUsage, f.option + " " + quote_input(f.path) + " is a name that " + fam.option + " " +
                                        quote_input(fam.dir) + " writes or removes (its " + fam.names + "): " +
                                        (f.output ? "give " + f.option + " another path"
                                                  : "the run would destroy it; move it, or give " + fam.option +
                                                        " another directory"));
    }
  }
}

}  // namespace mnist_mpi
