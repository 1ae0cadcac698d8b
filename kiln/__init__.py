"""Kiln: compile quantized LLMs with Apache TVM for the browser, native and mobile."""

__version__ = "0.1.0"
