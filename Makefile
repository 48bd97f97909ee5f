# `make demo` runs the capstone, `make test` the suite; both create/refresh .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: bytecode demo test test-fast lint format config-doc resume bench venv clean text-demo multinode gpu-wheels

venv: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	@$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

# distlib's modules compiled once (compileall skips those already cached). Python caches them
# itself at the first import, but not where PYTHONDONTWRITEBYTECODE is set (as on these machines):
# then every process compiled all 112 modules, ~0.2 s of CPU, 4 ranks at each start.
bytecode: $(STAMP)
	$(PY) -m compileall -q distlib

demo: bytecode
	$(PY) -m torch.distributed.run --nproc_per_node 4 train.py

# The suite on PYTEST_WORKERS pytest-xdist workers, then alone the tests whose wall-clock bound has
# little slack (marker `serial`; tests/conftest.py says why). `pytest` by itself runs everything in one process.
# Its last line is the wall time and the machine kind (tests/suite_time.py), with a warning when
# over the 12-minute goal; the exit status is the suite's.
PYTEST_WORKERS ?= 2
test: lint bytecode
	@start=$$(date +%s); status=0; \
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder -m "not serial" --durations=25 \
		|| status=$$?; \
	if [ $$status -eq 0 ]; then $(PY) -m pytest -q -m serial || status=$$?; fi; \
	$(PY) tests/suite_time.py $$start; exit $$status

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

test-fast: bytecode
	$(PY) -m pytest -q -m "not slow"

resume: bytecode
	bash scripts/resume.sh

# Every benchmark, each against torch's own tool in the same run (< 10 min on 2 shared cores);
# tables on stdout, JSON in benchmarks/results/. benchmarks/README.md explains the numbers.
bench: bytecode
	$(PY) benchmarks/collectives.py --quick --worlds 2 4 8
	$(PY) benchmarks/step.py
	$(PY) benchmarks/scaling.py
	$(PY) benchmarks/startup.py
	$(PY) benchmarks/checkpoint.py --params 10e6 --world-size 4
	$(PY) benchmarks/recovery.py
	$(PY) benchmarks/snapshots.py
	$(PY) benchmarks/context.py
	$(PY) benchmarks/ring_documents.py
	$(PY) benchmarks/experts.py
	$(PY) benchmarks/chaos.py
	$(PY) benchmarks/pipeline.py --pp 2 4
	$(PY) benchmarks/plan.py
	$(PY) benchmarks/plan_time.py

# A small Llama on real text (docs/models.md, "The text demo"): a BPE tokenizer trained on data/sample.txt,
# 4 ranks, ZeRO-1, validation every 50 steps; then exported as a Hugging Face directory and continued by
# transformers' own generate(). TEXT_DEMO and TEXT_STEPS may be overridden, and TEXT_ARGS adds
# training overrides (e.g. data.cache_dir=DIR, where the token cache goes instead of beside the text).
TEXT_DEMO := outputs/text-demo
TEXT_STEPS := 200
TEXT_ARGS :=
text-demo: bytecode
	rm -rf $(TEXT_DEMO)
	$(PY) train.py data=text data.tokenizer=bpe data.vocab_size=1024 model=llama_tiny \
		model.seq_len=64 dist.world_size=4 zero=stage1 optimizer.lr=0.003 train.steps=$(TEXT_STEPS) \
		train.eval_every=50 checkpoint.every_steps=$(TEXT_STEPS) checkpoint.verify_resume=true metrics.progress_every=50 \
		hydra.run.dir=$(TEXT_DEMO) \
		$(TEXT_ARGS)
	$(PY) scripts/export_hf.py $(TEXT_DEMO)/checkpoints/step_$$(printf %08d $(TEXT_STEPS)) $(TEXT_DEMO)/hf
	$(PY) scripts/generate_hf.py $(TEXT_DEMO)/hf --prompt "Rank zero" --tokens 40
	$(PY) scripts/generate_hf.py $(TEXT_DEMO)/hf --prompt "Every rank" --tokens 40 --temperature 0.8 --top-k 20

# Two hosts in two network namespaces (needs root and iproute2; docs/beyond.md).
multinode: bytecode
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
