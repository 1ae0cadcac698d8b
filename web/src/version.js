// The Kiln release this engine is part of: the Python package and every build record carry the same
// version (a test checks). TVM_SERIES is that of @mlc-ai/web-runtime (tvmjs): a model library embeds
// the TVM runtime it was built with, and tvmjs calls into it across the wasm boundary.
export const KILN_VERSION = "0.1.0";
export const TVM_SERIES = "0.27";
