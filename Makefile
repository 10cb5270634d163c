# Set-up and main commands (see README.md).
#   make run    install into .venv, then run the embedded default (tiny MPT on CPU, whole chain)
#   make test   install into .venv (+ the Slurm test cluster's Debian packages when root), then the test suite
#   make lm-eval  add the optional second harness (envs/lm-eval.lock: lm-evaluation-harness) to .venv
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python

.PHONY: install lm-eval run test test-fast slurm-packages clean

$(VENV)/.installed: envs/requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r envs/requirements.lock
	$(PY) -m pip install -q --no-deps -e .
	touch $@

install: $(VENV)/.installed

# the optional second harness; the tests need it (LLMPIPE_REQUIRE_LM_EVAL=1: its tests fail instead of skipping)
$(VENV)/.lm-eval: $(VENV)/.installed envs/lm-eval.lock
	$(PY) -m pip install -q -r envs/lm-eval.lock
	touch $@

lm-eval: $(VENV)/.lm-eval

run: install
	$(VENV)/bin/snakemake --cores all results/mpt-tiny/eval.json results/mpt-tiny/generate.json

slurm-packages:
	@if [ "$$(id -u)" = 0 ]; then bash .ci/slurm.sh install; else echo "not root: Slurm tests will skip"; fi

test: install lm-eval slurm-packages
	@if [ "$$(id -u)" = 0 ]; then export LLMPIPE_REQUIRE_SLURM=1; fi; \
	export LLMPIPE_REQUIRE_LM_EVAL=1; \
	trap 'bash .ci/slurm.sh cleanup >/dev/null 2>&1 || true' EXIT; \
	$(PY) -m pytest -q -p no:cacheprovider --timeout 1800 tests

test-fast: install lm-eval
	$(PY) -m pytest -q -m "not slow and not slurm" tests

clean:
	rm -rf results .snakemake .llmpipe
