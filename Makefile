# Two commands on a fresh machine: `make test` (whole CPU suite) and `make demo` (the main job).
# Both create .venv with python3.12 when it is missing; the demo installs the runtime only (no torch, optax or
# matplotlib: .installed-demo), the tests everything (.installed), which also serves the demo. --no-compile: pip
# writes no bytecode for the thousands of modules installed (torch, transformers); Python writes it for those a run
# imports. A fresh test install 153 -> 100 s on the 2-core machine; the first import of jax, flax, torch and
# transformers 9.1 -> 9.5 s (docs/LOG.md).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
# Prefer a python3.12 on PATH; fall back to pyenv's 3.12 (where `python3.12` may be a broken shim).
PYTHON312 ?= $(shell for p in python3.12 $$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12.*/bin/python3.12 2>/dev/null | sort -V -r); do \
	if command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then command -v $$p; break; fi; done)

.PHONY: test demo venv clean

$(VENV)/.installed: pyproject.toml
	@if [ -z "$(PYTHON312)" ]; then echo "error: python3.12 not found (install it, or set PYTHON312=/path/to/python3.12)" >&2; exit 2; fi
	@[ -x $(PY) ] || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -e '.[test,train,bench]'
	@touch $@

# The runtime only; an up-to-date test install already holds it.
$(VENV)/.installed-demo: pyproject.toml
	@if [ ! $(VENV)/.installed -nt pyproject.toml ]; then \
		if [ -z "$(PYTHON312)" ]; then echo "error: python3.12 not found (install it, or set PYTHON312=/path/to/python3.12)" >&2; exit 2; fi; \
		[ -x $(PY) ] || $(PYTHON312) -m venv $(VENV) || exit 2; \
		echo "installing the runtime into $(VENV) (no torch: make test adds the test extras)"; \
		$(PY) -m pip install -q --upgrade pip && $(PY) -m pip install -q --no-compile -e . || exit 2; \
	fi
	@touch $@

venv: $(VENV)/.installed

test: $(VENV)/.installed
	JAX_PLATFORMS=cpu $(PY) -m pytest -n 2 --dist loadfile tests

demo: $(VENV)/.installed-demo
	JAX_PLATFORMS=cpu $(PY) -m specdec_jax generate --method ngram --gamma 8 --compare-ar --max-new-tokens 128 \
		--prompt 'def read_json(path):\n    """Load and return the JSON document stored at path."""'

clean:
	rm -rf $(VENV) .pytest_cache
