# `make demo` and `make test` set everything up themselves in .venv (pip only).
PYTHON ?= python3
VENV   ?= .venv
NRANKS ?= 1 2 3 4 5
BIN    := $(VENV)/bin
MPIRUN := $(BIN)/mpiexec
# One numba thread per rank: N ranks x all-core thread pools would oversubscribe the cores.
MPIENV := NUMBA_NUM_THREADS=1

.PHONY: demo tour test test-unit test-mpi lint clean

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/activate setup.py pyproject.toml
	$(BIN)/python -m pip install -q -e ".[test,jobs]"
	touch $@

# The main job: data-parallel training on 4 ranks, once per codec, compared with float32.
demo: $(VENV)/.installed
	$(MPIENV) $(MPIRUN) -n 4 $(BIN)/python -m mpi4py -m jobs.train

# Every codec on one gradient-shaped tensor, one process.
tour: $(VENV)/.installed
	$(BIN)/python -m jobs.codec_tour

test: test-unit test-mpi

test-unit: $(VENV)/.installed
	$(BIN)/python -m pytest -q

test-mpi: $(VENV)/.installed
	@set -e; for n in $(NRANKS); do \
	  echo "== multi-rank tests on $$n ranks"; \
	  $(MPIENV) $(MPIRUN) -n $$n $(BIN)/python -m mpi4py -m pytest -q --with-mpi -m mpi -p no:cacheprovider; \
	done

lint: $(VENV)/.installed
	$(BIN)/python -m pip install -q ruff
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
