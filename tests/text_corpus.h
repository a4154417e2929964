// Real text for the tokenizer tests: Debian's KJV (bible-kjv), fortunes and licence texts, each
// piece named for the failure messages.
#pragma once

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "test_util.h"

namespace shardrl::testing {

inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

inline void write_json(const std::string& path, const nlohmann::json& value) {
  std::ofstream(path, std::ios::binary) << value.dump();
}

// Texts and where each came from, for the failure messages.
struct Corpus {
  std::vector<std::string> names;
  std::vector<std::string> texts;
  void add(std::string name, std::string text) {
    names.push_back(std::move(name));
    texts.push_back(std::move(text));
  }
};

// Debian's KJV (bible-kjv), one text per book: large pieces keep the Python round trip cheap. A
// chapter heading ("1 Samuel 3") is the only unindented line after an empty one.
inline void add_bible(Corpus& corpus, const std::string& verses) {
  const auto result = run_process({"bible", verses});
  const std::string& text = result.output;
  if (result.exit_code != 0 || text.size() < 1000) {
    throw std::runtime_error("bible (package bible-kjv) failed: " + text.substr(0, 1000));
  }
  std::string book;
  size_t book_start = 0;
  for (size_t line = 0; line < text.size();) {
    const size_t end = std::min(text.find('\n', line), text.size());
    if (end > line && text[line] != ' ' && (line < 2 || text[line - 2] == '\n')) {
      const std::string heading = text.substr(line, end - line);
      const std::string name = heading.substr(0, heading.rfind(' '));
      if (name != book) {
        if (!book.empty()) corpus.add("KJV " + book, text.substr(book_start, line - book_start));
        book = name, book_start = line;
      }
    }
    line = end + 1;
  }
  corpus.add("KJV " + book, text.substr(book_start));
}

// Every file in `dir` (links followed, folders skipped) not ending in one of `skip`, by name.
inline void add_files(Corpus& corpus, const std::string& dir,
                      const std::vector<std::string>& skip) {
  std::vector<std::string> paths;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string path = entry.path().string();
    const bool skipped = std::any_of(skip.begin(), skip.end(), [&](const std::string& suffix) {
      return path.size() >= suffix.size() &&
             path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0;
    });
    if (entry.is_regular_file() && !skipped) paths.push_back(path);
  }
  if (paths.empty()) throw std::runtime_error("no text files in " + dir);
  std::sort(paths.begin(), paths.end());
  for (const auto& path : paths) corpus.add(path, read_text(path));
}

// JSON's quoting: newlines stay on one line, and a token's partial UTF-8 is shown as U+FFFD.
inline std::string quoted(const std::string& text) {
  return nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// Fails with the first difference of two id sequences and a few ids either side, each with its
// text (`piece(id)` for ids below `vocab_size`): a whole book's ids would bury it.
template <typename Piece>
void expect_same_id_sequences(const std::vector<int64_t>& got, const std::vector<int64_t>& want,
                              const std::string& name, int64_t vocab_size, const Piece& piece) {
  if (got == want) return;
  const size_t at =
      std::mismatch(got.begin(), got.end(), want.begin(), want.end()).first - got.begin();
  const auto around = [&](const std::vector<int64_t>& ids) {
    std::ostringstream out;
    for (size_t k = at < 4 ? 0 : at - 4; k < std::min(ids.size(), at + 5); ++k) {
      out << (k == at ? " >>" : " ") << ids[k];
      if (ids[k] >= 0 && ids[k] < vocab_size) out << " " << quoted(piece(ids[k]));
    }
    return out.str();
  };
  ADD_FAILURE() << name << ": " << got.size() << " ids where " << want.size()
                << " were expected; first difference at " << at << "\n  got: " << around(got)
                << "\n  want:" << around(want);
}

}  // namespace shardrl::testing
