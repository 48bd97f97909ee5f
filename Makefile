# `make demo` runs the capstone, `make test` the suite; both create/refresh .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint format config-doc resume bench venv clean text-demo multinode gpu-wheels

venv: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	@$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m torch.distributed.run --nproc_per_node 4 train.py

test: lint
	$(PY) -m pytest -q

# ruff (pyproject.toml [tool.ruff]): the whole tree lints clean and is formatted; `make format` fixes both.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# docs/config.md from the config code (tests/test_config_reference.py fails when it is stale).
config-doc: $(STAMP)
	$(PY) -m distlib.launch.config_reference

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

resume: $(STAMP)
	bash scripts/resume.sh

# Every benchmark, each against torch's own tool in the same run (< 10 min on 2 shared cores);
# tables on stdout, JSON in benchmarks/results/. benchmarks/README.md explains the numbers.
bench: $(STAMP)
	$(PY) benchmarks/collectives.py --quick --worlds 2 4 8
	$(PY) benchmarks/step.py
	$(PY) benchmarks/scaling.py
	$(PY) benchmarks/startup.py
	$(PY) benchmarks/checkpoint.py --params 10e6 --world-size 4
	$(PY) benchmarks/recovery.py
	$(PY) benchmarks/pipeline.py --pp 2 4

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

# The wheels scripts/gpu_check.sh installs offline on a GPU machine (Python 3.12, x86_64; docs/gpu.md).
GPU_WHEELS := .gpu_wheels
gpu-wheels: $(STAMP)
	mkdir -p $(GPU_WHEELS)
	$(PY) -m pip download --quiet --no-deps -d $(GPU_WHEELS) hydra-core==1.3.2 omegaconf==2.3.0 packaging pytest \
		pluggy iniconfig pygments
	$(PY) -m pip wheel --quiet --no-deps -w $(GPU_WHEELS) antlr4-python3-runtime==4.9.3
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d $(GPU_WHEELS) \
		safetensors==0.8.0 PyYAML numpy

clean:
	rm -rf outputs multirun .pytest_cache data/*.u8.tokens data/*.bpe*.tokens data/*.bpe*.tokenizer.json
