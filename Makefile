# Set-up and main commands (see README.md).
#   make run    install into .venv, then run the embedded default (tiny MPT on CPU, whole chain)
#   make test   install into .venv (+ the Slurm test cluster's Debian packages when root), then the test suite
#   make lm-eval  add the optional second harness (envs/lm-eval.lock: lm-evaluation-harness) to .venv
#   make install-torch211  the second lock (torch 2.11.0 CUDA 13 build, the GPU figures' stack) into .venv-torch211;
#                 WHEELS=<folder>: offline, from the folder `make wheels-torch211` fills (.whl-torch211)
#   make test-torch211  on that venv: the tiny chain in a scratch results_dir and the compile/FSDP/eval crash test
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
# google.api_core's notice that it drops Python 3.11 in 2027, printed while Snakemake imports smart_open, before the
# workflow's code can filter it: ignored by category and module in the commands run here (docs/installation.md)
export PYTHONWARNINGS ?= ignore::FutureWarning:google.api_core._python_version_support

.PHONY: install lm-eval run test test-fast slurm-packages clean install-torch211 wheels-torch211 test-torch211

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

# The second lock, in its own venv. --no-deps: composer 0.32.1 and llm-foundry 0.22.0 pin torch<2.7.1 (composer also
# torchvision<0.22.1), so pip's resolver would refuse torch 2.11.0; the lock lists every package, no resolver needed.
LOCK211    = envs/requirements-torch2.11-cu13.lock
VENV211   ?= .venv-torch211
WHEELS    ?=
WHEELS_OUT ?= .whl-torch211
PY211      = $(VENV211)/bin/python
PIP211_SRC = $(if $(WHEELS),--no-index --find-links $(WHEELS))

$(VENV211)/.installed: $(LOCK211) pyproject.toml
	$(PYTHON) -m venv $(VENV211)
	$(PY211) -m pip install -q $(PIP211_SRC) --no-deps -r $(LOCK211)
	$(PY211) -m pip install -q $(PIP211_SRC) --no-deps -e .
	@# pip check may report only the known torch/torchvision pins, nothing missing
	@out=$$($(PY211) -m pip check | grep -v -E \
	  '^(mosaicml 0\.32\.1 has requirement torch(vision)?[<>=]|llm-foundry 0\.22\.0 has requirement torch[<>=])'); \
	if [ -n "$$out" ]; then echo "$$out"; echo "pip check: more than the known torch pins"; exit 1; fi
	touch $@

install-torch211: $(VENV211)/.installed

# The wheel folder for an offline machine, for the Python that runs it (PYTHON=python3.12 for a 3.12 cluster).
# pip wheel, not pip download: it also builds connection_pool 0.0.3 (published as an sdist only) into a wheel, so
# the offline install needs no build tools; every other file is PyPI's wheel as downloaded.
wheels-torch211:
	$(PYTHON) -m pip wheel -q --no-deps -w $(WHEELS_OUT) -r $(LOCK211)

# On the second lock: the tiny chain (what `make run` does) in a scratch results_dir and job-state folder, then the
# compile + FSDP + eval crash test. The scratch folder is removed when both pass.
test-torch211: install-torch211
	@tmp=$$(mktemp -d $${TMPDIR:-/tmp}/llmpipe-torch211.XXXXXX) && start=$$(date +%s) && \
	$(VENV211)/bin/snakemake --cores all $$tmp/results/mpt-tiny/eval.json $$tmp/results/mpt-tiny/generate.json \
	  --config results_dir=$$tmp/results "dispatch={state_dir: $$tmp/jobs}" && \
	echo "torch 2.11 tiny chain: $$(( $$(date +%s) - start )) s" && \
	$(PY211) -m pytest -q -p no:cacheprovider --timeout 1800 tests/test_compile_fsdp_eval.py && \
	rm -rf $$tmp || { echo "test-torch211 failed; its results: $$tmp"; exit 1; }

run: install
	$(VENV)/bin/snakemake --cores all results/mpt-tiny/eval.json results/mpt-tiny/generate.json

slurm-packages:
	@if [ "$$(id -u)" = 0 ]; then bash .ci/slurm.sh install; else echo "not root: Slurm tests will skip"; fi

# Two pytest-xdist workers, one test file at a time (module fixtures once): one worker starts with the files that use
# the Slurm test cluster, as one unit (one cluster per host; tests/conftest.py's scheduler), the other runs the rest;
# then both take what is left. TEST_WORKERS=1 runs the suite in one process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# then the second lock's checks (test-torch211) whether or not the suite passed; `make`, not $(MAKE), so that
# `make -n test` only prints this line instead of running it. Last, the suite in a few lines (failures, tests that
# never reported, the slowest; tests/helpers/suite_digest.py), since CI shows only the end of the output, and every
# test file's seconds beside the log (the basis of tests/file-seconds.json: docs/testing.md).
# -v: the log names the test that runs. --timeout-method=signal: a test over its time fails in its own worker, which
# goes on with the next test (pytest-xdist stalls after replacing a worker that the thread method ends with
# os._exit). A test stuck in C code that never returns to Python stops neither; faulthandler's watchdog prints every
# stack 60 s later, and `timeout` ends the suite after 75 minutes so that CI (90 minutes) still reports.
test: install lm-eval slurm-packages
	@if [ "$$(id -u)" = 0 ]; then export LLMPIPE_REQUIRE_SLURM=1; fi; \
	export LLMPIPE_REQUIRE_LM_EVAL=1; \
	trap 'bash .ci/slurm.sh cleanup >/dev/null 2>&1 || true' EXIT; \
	log=$$(mktemp $${TMPDIR:-/tmp}/llmpipe-test.XXXXXX); \
	{ timeout --foreground --kill-after=30 4500 $(PY) -m pytest -v -p no:cacheprovider $(XDIST) --timeout 1200 \
	  --timeout-method=signal -o faulthandler_timeout=1260 --durations=0 tests; echo $$? > $$log.rc; } 2>&1 | tee $$log; \
	suite_rc=$$(cat $$log.rc); rc=$$suite_rc; \
	env -u LLMPIPE_REQUIRE_SLURM -u LLMPIPE_REQUIRE_LM_EVAL make --no-print-directory test-torch211 || rc=1; \
	echo "--- the suite in short (whole log: $$log) ---"; $(PY) tests/helpers/suite_digest.py $$log $$suite_rc --write-seconds $$log.file-seconds.json; \
	exit $$rc

test-fast: install lm-eval
	$(PY) -m pytest -q -p no:cacheprovider $(XDIST) -m "not slow and not slurm" tests

clean:
	rm -rf results .snakemake .llmpipe
