# fitllm: top-level entry points. `make test` and `make demo` set everything up
# on a fresh Debian machine (installing missing packages when run as root,
# otherwise printing the exact apt-get command), build, and run.

BUILD      ?= build
ASAN_BUILD ?= build-asan
JOBS       ?= $(shell nproc 2>/dev/null || echo 2)
# openmpi-*: multi-process collectives (src/comm/comm_mpi.c); the build also works without them
# libcurl4-openssl-dev: `fitllm download` (src/io/hf_hub.c); the build also works without it
# libjpeg62-turbo-dev, libpng-dev: image decoding (src/image/)
DEB_PKGS   := cmake make gcc g++ libc6-dev libopenblas-dev libdnnl-dev libyaml-dev libpcre2-dev openmpi-bin libopenmpi-dev \
              libcurl4-openssl-dev libjpeg62-turbo-dev libpng-dev xz-utils
# optional: gnuplot-nox, the lab's PNG charts (without it `fitllm lab` writes the data and notes it in report.md);
# iproute2, the two-node test's network namespaces (tests/netns_test.sh skips without it)
DEB_OPT_PKGS := gnuplot-nox iproute2
# clang with libFuzzer (libclang-rt-dev: a separate package from clang on Debian) and LLVM's OpenMP:
# the fuzz build (fuzz/build.sh), needed by `make test` (its fuzz smoke stage) and the fuzz targets only
FUZZ_DEB_PKGS := clang libclang-rt-dev libomp-dev
FITLLM_DATA ?= ../shared/data
export FITLLM_DATA

.PHONY: all setup build test test-full test-fast asan asan-build demo bench bench-t5 bench-adam8bit bench-pp-compose bitident clean help fuzz fuzz-build fuzz-smoke

all: build

help:
	@echo "make demo   - build and run the memory lab, quick suite (fitllm lab: table, lab/report.md, charts)"
	@echo "make test   - build and run the quick tier of the test suite, what CI runs (release, CLI, MPI, the fuzz seeds replayed,"
	@echo "              AddressSanitizer pass; every code path once: sweeps thinned, release-only repeats skipped under ASan)"
	@echo "make test-full - the same stages, every case (FITLLM_TEST_TIER=full: all sweeps, all under ASan, long CLI/MPI"
	@echo "              cases, 10 s of libFuzzer per harness); before a release or after changing what a sweep covers"
	@echo "make build  - configure and build into $(BUILD)/ (CUDA=1: with the CUDA plugin, even without a GPU here)"
	@echo "make asan   - build with ASan/UBSan and run the whole suite under it"
	@echo "make bench  - fitllm vs PyTorch training-step benchmark (needs a torch virtualenv)"
	@echo "make bench-t5 - a t5-small training step, fitllm vs transformers' T5ForConditionalGeneration (torch venv)"
	@echo "make bench-adam8bit - 8-bit AdamW on the CPU, fitllm vs bitsandbytes' AdamW8bit (PY=a python with torch + bitsandbytes)"
	@echo "make bench-pp-compose - issue 35's compositions on 4 CPU ranks (TP x interleaved PP, DP x PP offload, T5 stages) vs torch.distributed.pipelining (torch venv, mpirun)"
	@echo "make fuzz   - libFuzzer (clang) on every input parser, FUZZ_TIME s each (default 600), FUZZ_JOBS at a time"
	@echo "make fuzz-smoke - the same, 30 s each"
	@echo "make bitident BASE=DIR - does this build train bit for bit like the build in DIR (tests/bitident)"

setup:
	@missing=""; for p in $(DEB_PKGS) $(SETUP_EXTRA_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = "0" ]; then \
	    echo "installing:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null || exit 1; \
	  else \
	    echo "missing Debian packages:$$missing"; \
	    echo "run:  sudo apt-get update && sudo apt-get install -y$$missing"; exit 1; \
	  fi; \
	fi; \
	opt=""; for p in $(DEB_OPT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || opt="$$opt $$p"; done; \
	if [ -n "$$opt" ]; then \
	  if [ "$$(id -u)" = "0" ]; then \
	    echo "installing (optional):$$opt"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$opt >/dev/null) || \
	      echo "note: could not install$$opt; the lab will skip its charts (gnuplot-nox), the two-node test will skip (iproute2)"; \
	  else \
	    echo "note: optional$$opt missing (lab charts, two-node test): sudo apt-get install -y$$opt"; \
	  fi; \
	fi

# CUDA=1 (or ON): also build the CUDA plugin libfitllm_cuda.so (nvcc, minutes), with or without a GPU
# here; CUDA=0: never; unset: FL_CUDA=auto, the plugin only where nvcc is found and a GPU can be used
# (so a CPU machine never runs nvcc). Remembered by $(BUILD)/ until given again.
CUDA ?=
$(BUILD)/Makefile: CMakeLists.txt
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release >/dev/null

build: setup $(BUILD)/Makefile
	$(if $(CUDA),cmake -S . -B $(BUILD) -DFL_CUDA=$(CUDA) >/dev/null)
	cmake --build $(BUILD) -j $(JOBS)

# Release suite, the CLI and MPI (mpirun -np 2 and 4) tests, a libFuzzer smoke run of every harness,
# then the unit tests again under ASan+UBSan (fault-injection sweeps and bad-input files must not leak or crash).
# tests/run_all.sh runs the stages in order, goes on after a failing one, and ends with a table (stage, counts,
# wall time) and one line "make test: N passed, N failed, N skipped"; logs in $(BUILD)/test-logs/.
# Two tiers (tests/run_all.sh's header): `make test` the quick one (every path once, <= 15 min on 2 busy cores with
# the builds), `make test-full` every case (FITLLM_TEST_TIER=full).
TEST_TIER ?= quick
# clang and libFuzzer for the full tier's fuzz campaigns only (the quick tier replays the seeds through the ASan build)
test: SETUP_EXTRA_PKGS = $(if $(filter full,$(TEST_TIER)),$(FUZZ_DEB_PKGS))
test: build
	BUILD=$(BUILD) ASAN_BUILD=$(ASAN_BUILD) ASAN_FILTER="" JOBS=$(JOBS) FUZZ_JOBS=$(FUZZ_JOBS) FITLLM_TEST_TIER=$(TEST_TIER) tests/run_all.sh

test-full:
	$(MAKE) --no-print-directory test TEST_TIER=full

test-fast: build
	./$(BUILD)/fitllm_tests $(FILTER)

ASAN_FILTER ?=
# FL_CUDA=OFF: the sanitizers check host code; the GPU plugin (nvcc, 4 architectures) is built by the
# release pass where it is (a GPU here, or CUDA=1), and the same kernel sources run here under the emulator (host C++)
# -g1 (line tables): the sanitizers' stack traces keep their file:line; full -g costs 15-25% more compile time
# (trainer.c, model.c, test_poff.c with ASan: 2.4 / 1.7 / 1.4 CPU s at -O2 -g, 2.0 / 1.35 / 1.15 at -O2 -g1; medians of 2)
ASAN_FLAGS ?= -O2 -g1 -DNDEBUG
# the tests' own sources (tests/*.c) at -O1: a third less of their compile time; the time of the ASan pass goes
# to the library and the emulated kernels (-O2 above)
ASAN_TEST_OPT ?= -O1
# the library's orchestration sources (CMake FL_GLUE_OPT: src/model, train, lab, io, ...; not the backends' kernels,
# core or the collectives) at -O1: ASan + UBSan compile them in 64% of -O2's time (132 -> 84 CPU s) and the ASan
# pass takes the same CPU time (514 vs 536 s, one run each, side by side); -O0 saved 36 s more compile but cost the
# pass 75 s (the tests' float64 references and the lab's loops; docs/BENCHMARKS.md "make test's time")
ASAN_GLUE_OPT ?= -O1
# asan-build: configure and compile only: the unit tests and the fuzz harnesses' seed-replay binaries (fuzz_replay);
# tests/run_all.sh runs it in the background during the CLI stage
asan-build: setup
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFL_SANITIZE=ON -DFL_NATIVE=ON -DFL_CUDA=OFF \
	  -DCMAKE_C_FLAGS_RELWITHDEBINFO="$(ASAN_FLAGS)" -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$(ASAN_FLAGS)" -DFL_TESTS_OPT="$(ASAN_TEST_OPT)" -DFL_GLUE_OPT="$(ASAN_GLUE_OPT)" >/dev/null
	cmake --build $(ASAN_BUILD) -j $(JOBS) --target fitllm_tests fuzz_replay

asan: asan-build
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 ./$(ASAN_BUILD)/fitllm_tests $(ASAN_FILTER)

# The main job on its built-in default: the lab's experiments on scaled presets,
# no downloads, no ../shared/data needed (writes lab/).
demo: build
	./$(BUILD)/fitllm lab --suite quick

bench: build
	bench/run_bench_step.sh

# issue 31: fitllm's T5 step against transformers' (docs/BENCHMARKS.md); not part of make test
bench-t5: build
	bench/run_bench_t5.sh

# 8-bit AdamW on the CPU against bitsandbytes' AdamW8bit (a python with torch and bitsandbytes: PY=...); not in make test
bench-adam8bit: build
	BUILD=$(BUILD) bench/run_adam8bit_bench.sh

# issue 35: TP inside the interleaved schedule and offload on DP x PP grids, fitllm (mpirun, 4 CPU ranks) against
# torch.distributed.pipelining with DTensor TP / FSDP2 CPUOffloadPolicy stages (docs/BENCHMARKS.md); not in make test
PP_CASES ?= tp2-interleaved dp2-zero2-offload dp2-fsdp-offload t5-pp2
PP_ROUNDS ?= 5
PP_STEPS ?= 2
bench-pp-compose: build
	CASES="$(PP_CASES)" ROUNDS=$(PP_ROUNDS) STEPS=$(PP_STEPS) WARMUP=1 bench/run_pp_bench.sh

# Does this build train bit-identically to another one (BASE=its build folder)? tests/bitident/README.md
bitident: build
	@test -n "$(BASE)" || { echo "make bitident BASE=<build folder of the commit to compare against>"; exit 2; }
	tests/bitident/compare.sh $(BASE) $(BUILD)

# Coverage-guided fuzzing (clang + libFuzzer, ASan/UBSan; `make test` runs each harness for 10 s only): every parser of
# untrusted input, FUZZ_TIME seconds per harness, FUZZ_JOBS at a time (nice 19). Corpora, logs and
# crash inputs in build-fuzz/; docs/FUZZING.md. One harness: fuzz/run.sh NAME SECONDS.
FUZZ_TIME ?= 600
FUZZ_JOBS ?= 2
FUZZ_NAMES ?=
fuzz-build: SETUP_EXTRA_PKGS = $(FUZZ_DEB_PKGS)
fuzz-build: setup
	JOBS=$(JOBS) fuzz/build.sh

fuzz: fuzz-build
	fuzz/run_all.sh $(FUZZ_TIME) $(FUZZ_JOBS) $(FUZZ_NAMES)

fuzz-smoke: fuzz-build
	fuzz/run_all.sh 30 $(FUZZ_JOBS) $(FUZZ_NAMES)

clean:
	rm -rf $(BUILD) $(ASAN_BUILD)
