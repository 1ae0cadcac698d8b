// The error codes of kiln/mobile/runtime/errors.h, one a line: "<integer> <name>", from 1 on; then
// the code and message of an EngineError thrown and caught.
#include "errors.h"

#include <iostream>

int main() {
  for (int value = 1; *kiln::ErrorCodeName(static_cast<kiln::ErrorCode>(value)) != '\0'; ++value) {
    std::cout << value << ' ' << kiln::ErrorCodeName(static_cast<kiln::ErrorCode>(value)) << '\n';
  }
  try {
    throw kiln::EngineError(kiln::ErrorCode::kNoChatTemplate, "no template");
  } catch (const kiln::EngineError& error) {
    std::cout << "thrown " << kiln::ErrorCodeName(error.code()) << ' ' << error.what() << '\n';
  }
}
