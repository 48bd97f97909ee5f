# `make demo` runs the capstone, `make test` the suite; both create/refresh .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast resume bench venv clean text-demo multinode

venv: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
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

# Real text (docs/beyond.md): 400 steps on data/sample.txt, 2 ranks, validation every 25 steps, then samples.
TEXT_DEMO := outputs/text-demo
text-demo: $(STAMP)
	rm -rf $(TEXT_DEMO)
	$(PY) train.py data=text dist.world_size=2 model.seq_len=64 model.dim=64 optimizer.lr=0.003 \
		train.steps=400 train.eval_every=25 checkpoint.every_steps=100 hydra.run.dir=$(TEXT_DEMO)
	$(PY) scripts/sample.py $(TEXT_DEMO)/checkpoints/step_00000400 --prompt "Rank zero" --tokens 300 \
		--temperature 0.8 --top-k 20

# Two hosts in two network namespaces (needs root and iproute2; docs/beyond.md).
multinode: $(STAMP)
	bash scripts/multinode.sh --verify outputs/multinode-$$(date +%Y%m%d-%H%M%S)

clean:
	rm -rf outputs multirun .pytest_cache data/*.u8.tokens
