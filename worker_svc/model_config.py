"""Shape and hyperparameters of a Llama-family decoder (what the runner needs to know)."""

from __future__ import annotations

from dataclasses import dataclass, replace

ROPE_SCALING_KINDS = ("linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Context-extension scaling of the RoPE frequencies (HF's rope_type "linear" or "llama3";
    the llama3 fields are those of Llama 3.1's config and unused by "linear")."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALING_KINDS:
            raise ValueError(f"RoPE scaling {self.kind!r} is not one of {ROPE_SCALING_KINDS}")
        if self.factor <= 0:
            raise ValueError("RoPE scaling factor must be > 0")
        if self.kind == "llama3" and not self.low_freq_factor < self.high_freq_factor:
            raise ValueError("llama3 RoPE scaling needs low_freq_factor < high_freq_factor")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_context: int
    tie_embeddings: bool
    bos_token_id: int
    eos_token_ids: tuple[int, ...]
    name: str
    rope_scaling: RopeScaling | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for RoPE")


def smollm2_135m_config() -> ModelConfig:
    """SmolLM2-135M-Instruct, as its GGUF metadata describes it (for reference and tests)."""
    return ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        max_context=8192,
        tie_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
        name="SmolLM2-135M-Instruct",
    )


def tiny_config() -> ModelConfig:
    """A tiny random model of the SmolLM2 architecture and vocabulary, for fast tests."""
    return replace(
        smollm2_135m_config(),
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_context=2048,
        name="tiny",
    )


def llama3_family(name: str, rope_factor: float, **shape) -> ModelConfig:
    """A Llama 3 model's shape: what the family shares (vocabulary, special tokens, RoPE and its
    llama3 scaling, context) with the model's own sizes in `shape`."""
    return ModelConfig(
        vocab_size=128256,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        max_context=131072,
        bos_token_id=128000,
        eos_token_ids=(128001,),
        name=name,
        rope_scaling=RopeScaling("llama3", rope_factor, 1.0, 4.0, 8192),
        **shape,
    )


def llama32_1b_config() -> ModelConfig:
    """Llama-3.2-1B's shape (its config.json): random weights of this shape time like the real
    ones (the GPU check builds them from this config; nothing is downloaded)."""
    return llama3_family(
        "Llama-3.2-1B-shape",
        32.0,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        tie_embeddings=True,
    )


def llama31_8b_config() -> ModelConfig:
    """Llama-3.1-8B's shape (its config.json), for sizing the KV pool from a GPU's memory."""
    return llama3_family(
        "Llama-3.1-8B-shape",
        8.0,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        tie_embeddings=False,
    )
