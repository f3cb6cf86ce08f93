# make demo: create .venv, install, run the main job on the bundled example.
# make test: the whole test suite.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
PD := $(VENV)/bin/precisiondiff
RUNS ?= runs

.PHONY: venv frameworks demo test test-portability test-frameworks bench clean

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,report]"
	touch $@

venv: $(VENV)/.installed

# The framework jobs' packages (setup.cfg's `frameworks` extra), beside the pinned torch: a constraints
# file holds torch at the version installed, so DeepSpeed's or torchtitan's own pins cannot replace it.
# DeepSpeed's CPU comm op is built here, once (about 1.5 min of CPU, into ~/.cache/torch_extensions),
# not by the first test that starts DeepSpeed, where concurrent starts would wait on its lock.
# Beside it, on the other core, the test suite's stand-in MLU (tests/mlu_backend, ~25 s of CPU,
# cached in build/mlu_standin); a failure there is left to tests/test_mlu_standin.py to report.
$(VENV)/.frameworks: $(VENV)/.installed setup.cfg
	$(PY) -c 'import torch; print("torch==" + torch.__version__.split("+")[0])' > $(VENV)/constraints.txt
	$(PY) -m pip install -q -c $(VENV)/constraints.txt -e ".[test,report,frameworks]"
	@set -e; (PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -c 'import tests.mlu_backend as b; b.build()' \
	  > /dev/null 2>&1 || echo "the stand-in MLU did not build here: tests/test_mlu_standin.py will say why") & \
	DS_ACCELERATOR=cpu $(PY) -c 'from deepspeed.accelerator import get_accelerator as a; a().create_op_builder("ShareMemCommBuilder").load()'; \
	wait
	touch $@

frameworks: $(VENV)/.frameworks

EXAMPLE := examples/tiny_transformer.py:build

BUGGY := examples/tiny_transformer.py:build_with_bug

# The main job on the bundled example: capture on the default device under test (the first of
# mlu, cuda, cpu, in bf16) and on the float64 reference, list, compare, report, then bisect the
# variant with a planted fused-kernel bug. compare/bisect exit 1 when they find divergence:
# that is their finding, not a failure of the demo.
demo: venv
	rm -rf $(RUNS)/dut $(RUNS)/ref
	$(PD) capture $(EXAMPLE) -o $(RUNS)/dut --level all --mode tensors
	$(PD) capture $(EXAMPLE) -o $(RUNS)/ref --target cpu/float64 --level all --mode tensors
	$(PD) ls $(RUNS)/dut --kind module --limit 12
	$(PD) ls $(RUNS)/ref --kind module --limit 12
	$(PD) compare $(RUNS)/dut $(RUNS)/ref --top 15 || test $$? -eq 1
	$(PD) report $(RUNS)/dut $(RUNS)/ref -o $(RUNS)/report.html || test $$? -eq 1
	@echo "HTML report: $(RUNS)/report.html"
	$(PD) bisect $(BUGGY) --format table || test $$? -eq 1

# The main pass runs on two pytest-xdist workers (PYTEST_WORKERS=0 runs it in one process), the framework
# jobs of tests/frameworks included (DS_ACCELERATOR=cpu: DeepSpeed on the CPU, gloo). Then the tests that
# exercise stock CPU kernels run again on every narrower vector path this CPU can take
# (tools/cpu_capabilities.py: default and avx2 on an AVX-512 machine, default on an AVX2 one; PyTorch
# reads ATEN_CPU_CAPABILITY at start-up): the verdicts must be the same on every CPU. Each pass has
# its own inductor cache: a shared one would hand kernels built for another instruction set.
PYTEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS))
DS_ENV := $(if $(DS_ACCELERATOR),,DS_ACCELERATOR=cpu)

test: venv frameworks
	$(DS_ENV) $(PY) -m pytest -q $(XDIST)
	$(MAKE) --no-print-directory test-portability

test-portability: venv
	@set -e; for cap in $$($(PY) tools/cpu_capabilities.py); do \
	  echo "== stock-kernel tests under ATEN_CPU_CAPABILITY=$$cap"; \
	  ATEN_CPU_CAPABILITY=$$cap TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/build/inductor-$$cap \
	    $(PY) -m pytest -q -m stock_kernels $(XDIST); \
	done

# The framework jobs alone (docs/frameworks.md).
test-frameworks: venv frameworks
	$(DS_ENV) $(PY) -m pytest -q $(XDIST) tests/frameworks

bench: venv
	$(PY) benchmarks/bench_capture.py

clean:
	rm -rf $(VENV) $(RUNS)
