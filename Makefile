# The README's commands: `make demo` and `make test` (`make test-fast`: all but the multi-process and planner-trace
# tests, marked in tests/conftest.py). They install what they need.
# A local .venv is created unless a virtual environment is already active.
ifdef VIRTUAL_ENV
PYTHON := python
STAMP := $(VIRTUAL_ENV)/.megatron_lc-install-stamp
else
PYTHON := .venv/bin/python
STAMP := .venv/.megatron_lc-install-stamp
endif
# The CPU build of torch for tests and the demo; the package itself asks for a range.
TORCH_CPU := torch==2.13.0

.PHONY: install test test-fast demo bench clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
ifndef VIRTUAL_ENV
	test -x .venv/bin/python || python3 -m venv .venv
endif
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q $(TORCH_CPU)
	$(PYTHON) -m pip install -q -e ".[test]"
	touch $(STAMP)

test: install
	$(PYTHON) -m pytest tests -x -n 2 --dist loadfile --durations=15

test-fast: install
	$(PYTHON) -m pytest tests -x -n 2 --dist loadfile --durations=10 -m "not multiprocess and not planner_trace"

demo: install
	$(PYTHON) examples/quickstart/demo.py

clean:
	rm -rf runs build *.egg-info .pytest_cache
