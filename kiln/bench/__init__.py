"""Benchmarks that print numbers: the native engine (`native`), the browser engine in headless
Chromium (`browser`), both side by side (`report`), and the build's stages and what quantization
costs in perplexity (`compile`)."""
