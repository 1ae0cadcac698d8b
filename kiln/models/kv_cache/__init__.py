"""Kiln's changes to TVM's paged KV-cache kernels: fixes (CPU prefill over cached tokens, the GPU
merge of two attention parts, WebGPU decode workgroups), Kiln's CPU decode kernel, and Gemma 2's
attention soft-cap written into them."""
