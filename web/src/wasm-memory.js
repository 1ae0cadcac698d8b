// Wasm memory past 2 GiB for tvmjs (@mlc-ai/web-runtime 0.27).
//
// The CPU library's memory may grow to wasm32's 4 GiB (a 0.5B model in float32 takes 2.2 GiB), but
// tvmjs's `Memory` indexes its views with signed shifts (`view[ptr >> 2]`) and takes the pointers
// wasm functions return as signed 32-bit numbers: an address past 2 GiB reads as a negative one, and
// a negative index reads `undefined`. Every accessor of `Memory` that takes an address is replaced by
// one that reads it as unsigned; the others reach memory only through these.

const VIEWS = [
  ["loadU8", "viewU8", 0],
  ["loadU16", "viewU16", 1],
  ["loadU32", "viewU32", 2],
  ["loadI32", "viewI32", 2],
  ["loadI64", "viewI32", 2], // tvmjs reads the low word only, as its own loadI64 does
  ["loadF32", "viewF32", 2],
  ["loadF64", "viewF64", 3],
];
// Accessors whose first argument is an address and that read it through a view themselves.
const ADDRESS_FIRST = ["loadRawBytes", "viewRawBytes", "loadCString", "storeRawBytes", "loadSmallStr", "loadSmallBytes"];
const PATCHED = Symbol("kiln: unsigned addresses");

/** Make the `Memory` class of tvmjs instance `tvm` read addresses as unsigned (once per class). */
export function useUnsignedAddresses(tvm) {
  const memory = Object.getPrototypeOf(tvm.memory);
  if (memory[PATCHED]) return;
  for (const [name, view, shift] of VIEWS) {
    memory[name] = function load(address) {
      if (this.buffer !== this.memory.buffer) this.updateViews();
      return this[view][address >>> shift];
    };
  }
  memory.loadU64 = function loadU64(address) {
    if (this.buffer !== this.memory.buffer) this.updateViews();
    const value = this.viewU32[address >>> 2] + this.viewU32[(address >>> 2) + 1] * 0x100000000;
    if (!Number.isSafeInteger(value)) throw new Error("Cannot represent uint64 value as a JavaScript number");
    return value;
  };
  for (const name of ADDRESS_FIRST) {
    const signed = memory[name];
    memory[name] = function unsigned(address, ...rest) {
      return signed.call(this, address >>> 0, ...rest);
    };
  }
  memory[PATCHED] = true;
}
