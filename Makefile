# make demo: venv if missing, then the built-in default recipe.  make test: same set-up, then the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# the dependency versions make setup installs (constraints.txt: those the suite last passed with); CONSTRAINTS= for
# the newest releases pyproject.toml's lower bounds allow
CONSTRAINTS ?= constraints.txt
# pytest processes for make test (each starts 2-4 ranks at a time): TEST_WORKERS=1 runs one file at a time
TEST_WORKERS ?= 2

.PHONY: demo test setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# no CUDA here: take the CPU build of torch first, so the unpinned lower bound does not pull CUDA wheels
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/python -m pip install -q torch==2.13.0; fi
	$(BIN)/python -m pip install -q -e '.[test]' $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	touch $(STAMP)

demo: $(STAMP)
	# a new output folder each time: the toolkit never overwrites a run (it would offer --resume)
	$(BIN)/toolkit train recipes/minilm-sst.yaml --set output_dir=runs/demo-$$(date +%Y%m%d-%H%M%S)

test: $(STAMP)
	# beside the set-up below, the DeepSpeed JIT op the tests load (CPU Adam, ~40 s of compiling once per machine);
	# the report test renders report.html in headless Chromium (Debian package); mypy: settings in pyproject.toml.
	# Each preparation has a time limit: one that hangs leaves the tests that need it to say so, not the whole run
	timeout 900 $(BIN)/python tests/prepare_deepspeed_ops.py > $(VENV)/deepspeed-ops.log 2>&1 & ops=$$!; \
	  (command -v chromium >/dev/null 2>&1 || (timeout 900 apt-get update -qq \
	    && DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq chromium >/dev/null)) \
	  && $(BIN)/python -m mypy; status=$$?; wait $$ops; grep -v WARNING $(VENV)/deepspeed-ops.log; exit $$status
	# two test files at a time (pytest-xdist; a file stays whole on one worker, runs several files share are made
	# once per worker): a third of the two cores sat idle in one pytest, on the single-threaded parts of starting
	# processes (on this machine: 35:23 of tests against 43:50-45:52 one at a time). The slowest tests listed: the
	# suite must stay under 30 min
	# the toolkit's and the tests' bytecode, written once here: where PYTHONDONTWRITEBYTECODE is set (as on the CI
	# machine) every process of the suite compiled each module it imported from source (~0.5 s a process)
	$(BIN)/python -m compileall -q toolkit tests
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=60 tests

clean:
	rm -rf runs
