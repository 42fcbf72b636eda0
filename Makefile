# The two commands: `make run` serves the default model, `make test` runs the whole suite.
# Both create the virtual environment on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# Reinstalled when the project's definition or the native kernels' source change (the install builds them).
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml setup.py node/engine/kernels/cpu_kernels.cpp | cksum | cut -d' ' -f1)
HOST ?= 127.0.0.1
PORT ?= 8080

.PHONY: run test lint venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py node/engine/kernels/cpu_kernels.cpp
	# pip is upgraded once, as the environment is created; a reinstall (a changed stamp) leaves it as it is.
	test -x $(PY) || python3 -m venv --upgrade-deps $(VENV)
	# The CPU wheel first: a bare torch requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	# Builds the native CPU kernels too (setup.py); without a compiler the install still succeeds.
	$(PY) -m pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

run: $(STAMP)
	$(VENV)/bin/tenzro node serve --model default --host $(HOST) --port $(PORT)

# One test process per core, at most 4 (each holds models, and its servers more); a file's tests stay in one
# process, so its module fixtures are built once. Every test process and server runs torch on one thread.
PARALLEL := -n auto --maxprocesses 4 --dist loadfile

# The whole suite, then the engine tests and the reuse matrix again on transformers' forward (TENZRO_NATIVE=off),
# so both forward paths are tested on a machine that runs the native kernels; where they do not load, the first
# pass already ran transformers' forward and the second would repeat it. The server's API, metering and hostile
# input do not depend on the forward: they run once. -rs prints every skip's reason.
FORWARD_TESTS := tests/node/engine tests/node/test_reuse_matrix.py
NATIVE_LOADS := from node.engine.cpu_kernels import load_kernels; found = load_kernels(); print(found.reason); \
	raise SystemExit(found.kernels is None)
test: $(STAMP)
	$(PY) -m pytest -q -rs $(PARALLEL) tests
	if $(PY) -c "$(NATIVE_LOADS)"; then TENZRO_NATIVE=off $(PY) -m pytest -q -rs $(PARALLEL) $(FORWARD_TESTS); \
	else echo "no second pass on transformers' forward: the first one ran it"; fi

lint: $(STAMP)
	$(VENV)/bin/ruff check node cache metering attestation policies router bench client tests scripts setup.py
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV)
