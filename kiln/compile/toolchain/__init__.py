"""What turns compiled kernels into the files a platform loads: the TVM web runtime and its wasm
linking (emscripten), static system libraries for apps, and the OpenCL kernel check (PoCL)."""
