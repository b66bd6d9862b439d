# Two commands do all set-up: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test install clean

install: $(STAMP)

# torch is pinned and installed first: a bare `torch` requirement on an empty venv
# would pull a multi-GB CUDA build; 2.13.0 is the CPU build this project is tested on.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

# the demo's model lands in runs/demo/final, which examples/lora-sft.yaml fine-tunes
demo: $(STAMP)
	rm -rf runs/demo
	$(VENV)/bin/trainforge train --output runs/demo

# tests run torch on one thread each (tests/conftest.py), so one worker per core halves the wall time
# on the 2-core CI machine; worksteal hands a queued test to whichever worker is idle (with the default
# scheduling one worker could sit idle for minutes while the other worked through its queue of slow
# integration tests); --durations names the slowest tests in every run's output
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal --durations=15

clean:
	rm -rf $(VENV) runs .pytest_cache
