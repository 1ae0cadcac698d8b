"""The browser engine driven from Python: headless Chromium (`driver`), the page's engine behind
the native model's interface (`model`), and the parity check of browser against native (`parity`)."""
