// A stand-in for libFuzzer's main in builds without it (WSYNC_FUZZ off, any compiler):
// runs LLVMFuzzerTestOneInput once on every file named on the command line, and on every
// regular file inside each directory named there. Arguments starting with '-' (libFuzzer's
// flags, such as -runs=0) are ignored, so one command line serves both builds. Exits 1 when
// a path cannot be read or no input was found; a crash in the target ends the process as
// it would under libFuzzer.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

bool RunFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "cannot read %s\n", path.c_str());
    return false;
  }
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // A copy of exactly `size` bytes, so that an overread is one past a heap block.
  std::vector<uint8_t> input(bytes.begin(), bytes.end());
  LLVMFuzzerTestOneInput(input.empty() ? nullptr : input.data(), input.size());
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  int inputs = 0;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.starts_with("-")) continue;
    std::error_code ec;
    std::filesystem::path p(arg);
    if (std::filesystem::is_directory(p, ec)) {
      std::vector<std::filesystem::path> files;
      for (const auto& e : std::filesystem::directory_iterator(p, ec)) {
        if (e.is_regular_file()) files.push_back(e.path());
      }
      std::sort(files.begin(), files.end());
      for (const auto& f : files) {
        if (!RunFile(f)) return 1;
        ++inputs;
      }
    } else {
      if (!RunFile(p)) return 1;
      ++inputs;
    }
  }
  if (inputs == 0) {
    std::fprintf(stderr, "no inputs: name seed files or directories\n");
    return 1;
  }
  std::printf("ran %d input(s)\n", inputs);
  return 0;
}
