"""TVMScript's parser, walking the stack without reading source lines.

Each `@T.prim_func` and each `T.macro` call walks the stack (`inspect.stack()`,
`inspect.getouterframes()`) to find the closure of the function it parses. It reads only the
frames' locals and globals, but the walk also looks up every frame's source line, and a frame
whose file is no module (the `kiln` script, a spawned compile process's `<string>`) sends
`inspect.getmodule` through all of `sys.modules`, some 2,000 with torch imported. A library takes
some 60 walks: about 1.5 s of CPU a target of the tiny Qwen2's 9-s compiles, side by side.

The one thing the parser asks of a frame's source line is whether the function is a method of an
`@I.ir_module` class (`is_defined_in_class`); no kernel of Kiln's or of TVM's KV cache is.
"""

from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager
from types import FrameType, ModuleType
from typing import Any, Iterator

from tvm.script.parser.core import parser as script_parser
from tvm.tirx.script.parser import entry as prim_func_entry

# TVM's parser modules that walk the stack through their module global `inspect`.
STACK_WALKERS = (prim_func_entry, script_parser)


def frames_without_source(frame: FrameType | None) -> list[inspect.FrameInfo]:
    """`inspect.getouterframes(frame)`, with no frame's code_context looked up (None)."""
    frames = []
    while frame is not None:
        code = frame.f_code
        frames.append(inspect.FrameInfo(frame, code.co_filename, frame.f_lineno, code.co_name, None, None))
        frame = frame.f_back
    return frames


class SourcelessInspect(ModuleType):
    """The `inspect` module, but for stack() and getouterframes(), which give frames_without_source."""

    def __getattr__(self, name: str) -> Any:
        return getattr(inspect, name)

    @staticmethod
    def stack(context: int = 1) -> list[inspect.FrameInfo]:
        return frames_without_source(sys._getframe(1))

    @staticmethod
    def getouterframes(frame: FrameType, context: int = 1) -> list[inspect.FrameInfo]:
        return frames_without_source(frame)


@contextmanager
def frames_without_source_lines() -> Iterator[None]:
    """Within: TVM's parser walks the stack without reading source lines."""
    for module in STACK_WALKERS:
        module.inspect = SourcelessInspect("inspect")
    try:
        yield
    finally:
        for module in STACK_WALKERS:
            module.inspect = inspect
