# Makefile: the usual commands around CMake.
#   make          build (Release) into build/
#   make demo     build and train a small GPT on the CPU (opfuse train; no Python, no PyPI)
#   make test     also set up the Python venv (requirements.txt, from PyPI), run
#                 the suite, then the same suite under AddressSanitizer + UBSan
#                 (both include a fixed-count run of each fuzz target), then
#                 20 s of libFuzzer per target where clang's libFuzzer links
#                 (FUZZ_SECS=0 skips it)
#   make test-clang build with clang into build-clang/ (Release, CPU only) and
#                 run the C tests there (the Python oracles, train and install
#                 runs stay with make test)
#   make bench    run every CPU benchmark (results: bench/RESULTS.md); installs
#                 PyTorch into .venv first, a large download (TORCH=0 skips it)
#   make install  install the library, headers, opfuse.pc and the CMake package
#                 under PREFIX (default /usr/local)
#   make fuzz     run both fuzz targets (public API, checkpoint loader) for 5
#                 minutes each (clang, libFuzzer; fuzz/README.md)
# Each first runs scripts/setup.sh, which installs missing Debian packages when
# run as root and otherwise names them. Builds are quiet (logs in build/*.log,
# shown when a step fails); V=1 shows everything.
JOBS   ?= $(shell nproc 2>/dev/null || echo 2)
CTEST  ?= ctest --output-on-failure -j $(JOBS)
LABELS_EXCLUDE ?= ^(gpu|mpi|long)$$
CLANG_LABELS_EXCLUDE ?= ^(gpu|mpi|long|oracle|train|install|setup)$$
PREFIX ?= /usr/local
TORCH  ?= 1
V      ?= 0
# The Python package's extension is built (and its tests run) by make test only.
PYEXT  ?= OFF
# Seconds of libFuzzer per fuzz target in make test.
FUZZ_SECS ?= 20

# The targets share build/ and apt's lock: one at a time.
.NOTPARALLEL:
.PHONY: all setup setup-test setup-bench build build-san build-clang test test-normal \
        test-san test-clang test-fuzz demo bench install fuzz clean

# $(call quietly,LOG,COMMAND): COMMAND's output goes to LOG and is shown, its
# errors first, only when it fails; with V=1 it all goes to the terminal.
ifeq ($(V),1)
quietly = $(2)
else
quietly = mkdir -p $(dir $(1)) && { $(2); } >$(1) 2>&1 || { \
	if grep -q -E 'error|Error' $(1); then grep -E -A5 'error|Error' $(1) | head -n 80; \
	else tail -n 40 $(1); fi; echo "make: failed; full log: $(1)" >&2; exit 1; }; \
	grep -E 'warning:' $(1) | head -n 20 || true
endif
# $(call cmake_build,DIR,CMAKE_ARGS): configure and build DIR.
cmake_build = $(call quietly,$(1)/configure.log,cmake -S . -B $(1) $(2)) && \
	$(call quietly,$(1)/build.log,cmake --build $(1) -j $(JOBS) $(if $(filter 1,$(V)),--verbose))

all: build

setup:
	@./scripts/setup.sh demo

setup-test:
	@./scripts/setup.sh test

setup-bench:
	@OPF_BENCH_TORCH=$(TORCH) ./scripts/setup.sh bench

build: setup
	@echo "make: building build/ (Release)"
	@$(call cmake_build,build,-DCMAKE_BUILD_TYPE=Release -DOPF_PYTHON_EXT=$(PYEXT))

build-san: setup
	@echo "make: building build-san/ (Debug, AddressSanitizer + UBSan)"
	@$(call cmake_build,build-san,-DCMAKE_BUILD_TYPE=Debug -DOPF_SANITIZE=ON)

# A second compiler catches what one accepts silently (feature-test macros,
# warnings of its own); CPU only, no sanitizer, to keep CI short.
build-clang: setup
	@command -v clang >/dev/null || { echo "make: build-clang needs clang (apt-get install clang)" >&2; exit 1; }
	@echo "make: building build-clang/ (Release, clang, CPU only)"
	@$(call cmake_build,build-clang,-DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=Release -DOPF_CUDA=OFF)

test-clang: build-clang
	@cd build-clang && $(CTEST) -LE '$(CLANG_LABELS_EXCLUDE)'

test-normal: PYEXT = ON
test-normal: setup-test build
	@cd build && $(CTEST) -LE '$(LABELS_EXCLUDE)'

test-san: setup-test build-san
	@cd build-san && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
		$(CTEST) -LE '$(LABELS_EXCLUDE)'

# The short libFuzzer runs, with a fixed seed so that a CI run can be
# repeated exactly (make fuzz explores with fresh seeds); skipped, saying
# why, where clang's libFuzzer is missing (the standalone fuzz drivers have
# run in both suites anyway).
test-fuzz:
	@if [ "$(FUZZ_SECS)" = 0 ]; then echo "make: libFuzzer runs skipped (FUZZ_SECS=0)"; \
	elif why=$$(./fuzz/run.sh --check); then FUZZ_SEED=1 ./fuzz/run.sh $(FUZZ_SECS); \
	else echo "make: skipping the $(FUZZ_SECS) s libFuzzer runs: $$why; the standalone fuzz drivers ran in ctest (label fuzz)"; fi

test: test-normal test-san test-fuzz

demo: build
	@OMP_WAIT_POLICY=passive ./build/opfuse train

bench: setup-bench build
	@./build/opfuse bench all

install: build
	@cmake --install build --prefix '$(PREFIX)'

fuzz: setup
	@./fuzz/run.sh 300

clean:
	rm -rf build build-san build-clang build-fuzz
