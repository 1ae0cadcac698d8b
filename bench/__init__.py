"""Speed benchmarks that print numbers: the native engine (`native`), the browser engine in
headless Chromium (`browser`), and both side by side (`report`). `kiln bench compile` times the
build itself and lives with it, in `kiln.compile.bench`."""
