// A helper thread of the CPU wasm library (wasm-threads.js): an instance of the library's module on
// the engine's shared memory that runs the tasks of TVM's parallel loops until the engine stops it.
self.onmessage = ({ data: { module, memory, stackTop, index } }) => {
  const imports = {};
  for (const { module: from, name, kind } of WebAssembly.Module.imports(module)) {
    imports[from] ??= {};
    imports[from][name] = kind === "memory" ? memory : () => {
      throw new Error(`${from}.${name} was called on a wasm helper thread, which runs kernels only`);
    };
  }
  const { exports } = new WebAssembly.Instance(module, imports);
  exports.stackRestore(stackTop);
  exports.kiln_threads_helper_enter(index);
  self.postMessage("started");
  exports.kiln_threads_helper_loop(index);
  self.close();
};
