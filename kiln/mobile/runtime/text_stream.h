// The text of generated tokens as it streams, as web/src/engine.js's TextStream gives it: the whole
// reply decoded each step, held back while it ends in an incomplete character (U+FFFD) or in the
// start of a stop string, and cut at the first stop string.
#ifndef KILN_TEXT_STREAM_H_
#define KILN_TEXT_STREAM_H_

#include <cstdint>
#include <string>
#include <vector>

#include "tokenizer.h"

namespace kiln {

class TextStream {
 public:
  TextStream(const Tokenizer& tokenizer, std::vector<std::string> stop_strings);

  struct Piece {
    std::string delta;
    bool stopped = false;
  };
  Piece Push(int32_t id);
  // The text not given yet.
  std::string Flush();

  const std::vector<int32_t>& ids() const { return ids_; }
  const std::string& text() const { return text_; }

 private:
  size_t SafeEnd() const;

  const Tokenizer& tokenizer_;
  std::vector<std::string> stop_strings_;
  std::vector<int32_t> ids_;
  std::string text_;
  size_t emitted_ = 0;
};

}  // namespace kiln

#endif  // KILN_TEXT_STREAM_H_
