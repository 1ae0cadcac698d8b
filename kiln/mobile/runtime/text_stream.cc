#include "text_stream.h"

#include <algorithm>

namespace kiln {
namespace {

const std::string kReplacementCharacter = "\xEF\xBF\xBD";

bool EndsWith(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

TextStream::TextStream(const Tokenizer& tokenizer, std::vector<std::string> stop_strings) : tokenizer_(tokenizer) {
  std::copy_if(stop_strings.begin(), stop_strings.end(), std::back_inserter(stop_strings_),
               [](const std::string& stop) { return !stop.empty(); });
}

TextStream::Piece TextStream::Push(int32_t id) {
  ids_.push_back(id);
  text_ = tokenizer_.Decode(ids_);
  size_t stop_at = std::string::npos;
  for (const std::string& stop : stop_strings_) stop_at = std::min(stop_at, text_.find(stop));
  if (stop_at != std::string::npos) {
    text_.resize(stop_at);
    return {Flush(), true};
  }
  if (EndsWith(text_, kReplacementCharacter)) return {"", false};
  size_t end = std::max(SafeEnd(), emitted_);
  Piece piece{text_.substr(emitted_, end - emitted_), false};
  emitted_ = end;
  return piece;
}

// Where the text may be shown up to: before any ending that could be the start of a stop string.
size_t TextStream::SafeEnd() const {
  size_t safe = text_.size();
  for (const std::string& stop : stop_strings_) {
    for (size_t length = std::min(stop.size() - 1, text_.size()); length > 0; --length) {
      if (EndsWith(text_, stop.substr(0, length))) {
        safe = std::min(safe, text_.size() - length);
        break;
      }
    }
  }
  return safe;
}

std::string TextStream::Flush() {
  std::string delta = emitted_ < text_.size() ? text_.substr(emitted_) : "";
  emitted_ = text_.size();
  return delta;
}

}  // namespace kiln
