# make demo: create .venv, install, run the main job on the bundled example.
# make test: the whole test suite.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
PD := $(VENV)/bin/precisiondiff
RUNS ?= runs

.PHONY: venv demo test bench clean

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,report]"
	touch $@

venv: $(VENV)/.installed

EXAMPLE := examples/tiny_transformer.py:build

demo: venv
	rm -rf $(RUNS)/dut $(RUNS)/ref
	$(PD) capture $(EXAMPLE) -o $(RUNS)/dut --level all --mode tensors
	$(PD) capture $(EXAMPLE) -o $(RUNS)/ref --target cpu/float64 --level all --mode tensors
	$(PD) ls $(RUNS)/dut --limit 25
	$(PD) ls $(RUNS)/ref --limit 25

test: venv
	$(PY) -m pytest -q

bench: venv
	$(PY) benchmarks/bench_capture.py

clean:
	rm -rf $(VENV) $(RUNS)
