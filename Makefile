# `make demo` runs the capstone, `make test` the suite; both create/refresh .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast resume bench venv clean

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	@$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m torch.distributed.run --nproc_per_node 4 train.py

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

resume: $(STAMP)
	bash scripts/resume.sh

# Every benchmark, each against torch's own tool in the same run (< 10 min on 2 shared cores);
# tables on stdout, JSON in benchmarks/results/. benchmarks/README.md explains the numbers.
bench: $(STAMP)
	$(PY) benchmarks/collectives.py --quick
	$(PY) benchmarks/step.py
	$(PY) benchmarks/scaling.py
	$(PY) benchmarks/startup.py
	$(PY) benchmarks/checkpoint.py --params 10e6 --world-size 4

clean:
	rm -rf outputs multirun .pytest_cache
