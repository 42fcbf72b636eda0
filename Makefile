# The two commands: `make run` serves the default model, `make test` runs the whole suite.
# Both create the virtual environment on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
HOST ?= 127.0.0.1
PORT ?= 8080

.PHONY: run test lint venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU wheel first: a bare torch requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

run: $(STAMP)
	$(VENV)/bin/tenzro node serve --model default --host $(HOST) --port $(PORT)

test: $(STAMP)
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check node cache metering tests
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV)
