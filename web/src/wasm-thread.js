// A helper thread of the CPU wasm library (wasm-threads.js): an instance of the library's module on
// the engine's shared memory that runs the tasks of TVM's parallel loops until the engine stops it.
// A kernel's large workspace comes from the heap, which may grow the memory: the growth is told to
// emscripten_notify_memory_growth, for JS views of the memory, and a helper keeps none.
const HELPER_IMPORTS = { emscripten_notify_memory_growth: () => {} };

self.onmessage = ({ data: { module, memory, stackTop, index } }) => {
  const imports = {};
  for (const { module: from, name, kind } of WebAssembly.Module.imports(module)) {
    imports[from] ??= {};
    imports[from][name] = kind === "memory" ? memory : HELPER_IMPORTS[name] ?? (() => {
      throw new Error(`${from}.${name} was called on a wasm helper thread, which runs kernels only`);
    });
  }
  const { exports } = new WebAssembly.Instance(module, imports);
  exports.stackRestore(stackTop);
  exports.kiln_threads_helper_enter(index);
  self.postMessage("started");
  exports.kiln_threads_helper_loop(index);
  self.close();
};
