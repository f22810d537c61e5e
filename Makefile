# Makefile: the usual commands around CMake.
#   make        build (Release) into build/
#   make test   install what is missing, build, run the suite, then the same
#               suite under AddressSanitizer + UBSan (build-san/)
#   make demo   build and run the demo on the CPU
#   make bench  run every CPU benchmark (results: bench/RESULTS.md)
#   make fuzz   fuzz the checkpoint loader for 5 minutes (clang, libFuzzer)
JOBS  ?= $(shell nproc 2>/dev/null || echo 2)
CTEST ?= ctest --output-on-failure -j $(JOBS)
LABELS_EXCLUDE ?= ^(gpu|mpi|long)$$

.PHONY: all setup build build-san test test-normal test-san demo bench fuzz clean

all: build

setup:
	@./scripts/setup.sh

build: setup
	@cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
	@cmake --build build -j $(JOBS)

build-san: setup
	@cmake -S . -B build-san -DCMAKE_BUILD_TYPE=Debug -DOPF_SANITIZE=ON >/dev/null
	@cmake --build build-san -j $(JOBS)

test-normal: build
	@cd build && $(CTEST) -LE '$(LABELS_EXCLUDE)'

test-san: build-san
	@cd build-san && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
		$(CTEST) -LE '$(LABELS_EXCLUDE)'

test: test-normal test-san

demo: build
	@./build/opfuse demo

bench: build
	@./scripts/setup.sh --bench
	@./build/opfuse bench all

fuzz: setup
	@./fuzz/run.sh 300

clean:
	rm -rf build build-san
