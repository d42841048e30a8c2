"""Settings of the worker service (flags are derived from these fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    host: str = "127.0.0.1"
    port: int = 50061
    name: str = ""  # shown in metrics and status; default "worker-<port>"
    model: str = "smollm2"  # smollm2 | tiny | sim | path to a .gguf file | Hugging Face model dir
    dtype: str = "bf16"  # bf16 | fp32
    device: str = "auto"  # auto (CUDA when there is one) | cpu | cuda | cuda:N
    kv_capacity: int = 0  # token positions in the preallocated KV pool; 0 = sized from memory
    memory_fraction: float = 0.9  # sizing from memory: the share of the device this worker uses
    cpu_memory_gib: float = 1.0  # sizing from memory on the CPU: the memory it may use
    profile_tokens: int = 256  # sizing from memory: tokens of the peak forward (the token budget)
    cuda_graphs: bool = True  # decode steps replay CUDA graphs (on a GPU; never on the CPU)
    block_size: int = 16
    threads: int = 0  # torch threads; 0 = torch's default
    metrics_port: int = 0  # Prometheus HTTP port; 0 = off
    drain_timeout: float = 60.0  # on SIGTERM: seconds to finish the requests held here
    max_context: int = 0  # positions one request may reach; 0 = the model's context
    scheduler: str = ""  # register with this scheduler at start (and keep registering)
    advertise: str = ""  # the address the scheduler reaches this worker at; "" = host:port
    sim_step_ms: float = 5.0  # --model sim: each execution takes this long ...
    sim_token_us: float = 0.0  # ... plus this per token processed
    internal_token_file: str = ""  # every call must carry this token; also $LLMSERVE_INTERNAL_TOKEN

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
