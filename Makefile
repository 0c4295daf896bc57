# Two commands on a fresh machine: `make test` (whole CPU suite) and `make demo` (the main job).
# Both create .venv with python3.12 when it is missing; the demo installs the runtime only (no torch, optax or
# matplotlib: .installed-demo), the tests everything (.installed), which also serves the demo. Installs go through uv
# (pip-installed into the venv first): it downloads and unpacks in parallel and writes no bytecode (Python writes it
# for the modules a run imports). A fresh test install on the 2-core machine: pip 111 s, uv 46 s with its cache cold
# (docs/LOG.md). Where uv cannot be had, pip does it (--no-compile: no bytecode either).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
# Prefer a python3.12 on PATH; fall back to pyenv's 3.12 (where `python3.12` may be a broken shim).
PYTHON312 ?= $(shell for p in python3.12 $$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12.*/bin/python3.12 2>/dev/null | sort -V -r); do \
	if command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then command -v $$p; break; fi; done)

.PHONY: test demo venv clean

# Runs write bytecode even where the environment says not to (PYTHONDONTWRITEBYTECODE): the installs write none, and
# without it every process parses jax, torch and transformers from source again (14 s of imports against 5 s with
# bytecode, on the 2-core machine); the suite's subprocesses and a second demo run reuse the first one's.
RUN := env -u PYTHONDONTWRITEBYTECODE

# $(call install,ARGS): `uv pip install ARGS` into the venv, or pip's where uv does not install. (The extras live in a
# variable: a comma in call's arguments would split them.)
TEST_EXTRAS := .[test,train,bench]
install = { $(PY) -m pip install -q uv && $(PY) -m uv pip install -q --python $(PY) $(1); } || \
	{ echo "uv failed; installing with pip" >&2; $(PY) -m pip install -q --no-compile $(1); }

$(VENV)/.installed: pyproject.toml
	@if [ -z "$(PYTHON312)" ]; then echo "error: python3.12 not found (install it, or set PYTHON312=/path/to/python3.12)" >&2; exit 2; fi
	@[ -x $(PY) ] || $(PYTHON312) -m venv $(VENV)
	$(call install,-e '$(TEST_EXTRAS)')
	@touch $@

# The runtime only; an up-to-date test install already holds it.
$(VENV)/.installed-demo: pyproject.toml
	@if [ ! $(VENV)/.installed -nt pyproject.toml ]; then \
		if [ -z "$(PYTHON312)" ]; then echo "error: python3.12 not found (install it, or set PYTHON312=/path/to/python3.12)" >&2; exit 2; fi; \
		[ -x $(PY) ] || $(PYTHON312) -m venv $(VENV) || exit 2; \
		echo "installing the runtime into $(VENV) (no torch: make test adds the test extras)"; \
		$(call install,-e .) || exit 2; \
	fi
	@touch $@

venv: $(VENV)/.installed

test: $(VENV)/.installed
	$(RUN) JAX_PLATFORMS=cpu $(PY) -m pytest -n 2 --dist loadfile tests

demo: $(VENV)/.installed-demo
	$(RUN) JAX_PLATFORMS=cpu $(PY) -m specdec_jax generate --method ngram --gamma 8 --compare-ar --max-new-tokens 128 \
		--prompt 'def read_json(path):\n    """Load and return the JSON document stored at path."""'

clean:
	rm -rf $(VENV) .pytest_cache
