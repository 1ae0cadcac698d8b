# Kiln — `make demo` and `make test` set up everything they need on a fresh Debian machine.
VENV     ?= .venv
PY       := $(VENV)/bin/python
PORT     ?= 8000
DIST     ?= dist
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` (0: none, one test after another). The workers share the builds
# (tests/conftest.py) and run the browser tests on one of them. Not the default: on 2 cores, two workers
# ran the suite in 62 min against 72 with every test spread over both, and slower still with the browser
# tests on one, since SwiftShader and each worker's TVM thread pool all want both cores.
TEST_WORKERS ?= 0
SUDO     := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)

.PHONY: setup system python web runtime mobile-runtime lint test test-fast demo demo-build wheel clean

setup: system python web

# Debian packages: emscripten (the TVM web runtime and model wasm), Chromium (browser tests),
# Node.js + npm (the web package), LLVM's binutils (static archives for phones) and lld (the
# tests link them), PoCL and clang (the OpenCL kernel checks); for the mobile runtime on arm64,
# the aarch64 C++ library (it links there) and qemu-user (the tests run it). Installed only when missing.
system:
	@missing=""; \
	command -v emcc >/dev/null || missing="$$missing emscripten"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v node >/dev/null || missing="$$missing nodejs"; \
	command -v npm >/dev/null || missing="$$missing npm"; \
	command -v llvm-objcopy >/dev/null || missing="$$missing llvm"; \
	ls /usr/bin/ld.lld* >/dev/null 2>&1 || missing="$$missing lld"; \
	[ -e /etc/OpenCL/vendors/pocl.icd ] || missing="$$missing pocl-opencl-icd"; \
	ls /usr/bin/clang* >/dev/null 2>&1 || missing="$$missing clang"; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi
	@arm64=""; \
	command -v qemu-aarch64 >/dev/null || arm64="$$arm64 qemu-user"; \
	[ -e /usr/aarch64-linux-gnu/lib/libstdc++.so.6 ] || arm64="$$arm64 libstdc++-12-dev-arm64-cross"; \
	if [ -n "$$arm64" ]; then \
	  echo "installing Debian packages for arm64:$$arm64"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$arm64; \
	fi

python: $(VENV)/.installed

# torch is pinned to the local CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0" -e ".[test]"
	touch $@

web: web/node_modules/.installed

web/node_modules/.installed: web/package-lock.json
	cd web && npm ci --no-audit --no-fund
	touch $@

# The TVM web runtime, and the mobile runtime (arm64 Linux, this machine, this machine under
# AddressSanitizer) for the tests, compiled once per TVM version into ~/.cache/kiln.
runtime: setup
	$(VENV)/bin/kiln doctor --build-runtime

mobile-runtime: setup
	$(VENV)/bin/kiln doctor --build-mobile-runtime

# ruff lints and formats the Python (settings in pyproject.toml), clang-format the mobile runtime's C, C++ and
# Java (.clang-format), ESLint for the web package (web/eslint.config.js) and TypeScript for its JSDoc types
# (web/tsconfig.json).
CLANG_FORMATTED = $(filter-out %/unicode_tables.h,$(wildcard kiln/mobile/runtime/*.h kiln/mobile/runtime/*.cc \
	kiln/mobile/java/*.c kiln/mobile/java/ai/kiln/*.java tests/mobile/drivers/*))

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run --Werror $(CLANG_FORMATTED)
	cd web && npx eslint . && npx tsc -p tsconfig.json

# numpy asks for transparent huge pages for its arrays from 4 MB up. On the 2-core EPYC VMs the suite runs
# on, the first touch of a huge page costs ten times a small page's (a 1 GiB copy's buffers: 5.4 s against
# 0.5 s), which the suite's real-size builds, SmolLM2's and `kiln bench native`'s copy paid on every large
# array (a Qwen2.5-0.5B-sized cpu build: 37.2 s against 32.1).
TEST_ENV = NUMPY_MADVISE_HUGEPAGE=0

test: setup lint runtime mobile-runtime
	$(TEST_ENV) $(VENV)/bin/pytest -ra --durations=15 -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

test-fast: setup lint
	$(TEST_ENV) $(VENV)/bin/pytest -ra -m "not slow and not browser" $(PYTEST_ARGS)

# A wheel that works outside the checkout: setup.py copies the served part of web/ into it.
wheel: python web
	rm -rf build
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w build/wheel .

SMOLLM2 = $(shell $(PY) tests/helpers/assets.py)

demo-build: setup runtime
	$(VENV)/bin/kiln compile "$(SMOLLM2)" -q q4f32_1 -t cpu,webgpu,webgpu-subgroups,wasm -o $(DIST) --model-id SmolLM2-135M-Instruct-q4f32_1
	$(VENV)/bin/kiln compile "$(SMOLLM2)" -q q4f16_1 -t webgpu,webgpu-subgroups -o $(DIST) --model-id SmolLM2-135M-Instruct-q4f16_1

demo: demo-build
	$(VENV)/bin/kiln serve --dist $(DIST) --port $(PORT)

clean:
	rm -rf $(DIST) .pytest_cache
