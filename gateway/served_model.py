"""One model setting for the whole stack: the gateway tokenizes for the model its workers serve.

The gateway's `--model` takes the workers' values (smollm2, tiny, sim, a .gguf file, an HF
directory); empty, the gateway takes the workers' model when it is a packaged one (they name it).
Either way it serves only while every worker agrees: the same model name, and a vocabulary that
the gateway's tokenizer fits in (a model may pad its embeddings beyond the tokenizer's size, as
Qwen2 does; it may not be smaller) holding the workers' end-of-sequence ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmcommon.model_files import DEFAULT_GGUF_NAME, display_name

PACKAGED = ("smollm2", "tiny", "sim")  # all three tokenize with SmolLM2's packaged GGUF


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What a worker says it serves (its Describe); vocab_size 0 = not known."""

    name: str
    vocab_size: int = 0
    eos_token_ids: tuple[int, ...] = ()


def model_name(source: str) -> str:
    """The readable name a worker started with `--model source` reports."""
    if source in ("tiny", "sim"):
        return source
    if source == "smollm2":
        return display_name(Path(DEFAULT_GGUF_NAME))
    return display_name(Path(source).expanduser())


def tokenizer_source(source: str) -> str:
    """What `load_tokenizer` reads for a model: "" (the packaged one) for the packaged models."""
    return "" if source in PACKAGED else source


def resolve(given: str, served: str) -> str:
    """The gateway's model: `given` (its --model), else the packaged model the workers name.
    SystemExit when it cannot tell."""
    if given:
        return given
    for source in PACKAGED:
        if model_name(source) == served:
            return source
    raise SystemExit(
        f"the workers serve {served!r}, which is not a packaged model: start the gateway with "
        "--model set to the workers' --model (the .gguf file or model directory)"
    )


def mismatch(name: str, tokenizer_vocab: int, served: ServedModel) -> str | None:
    """Why a gateway of model `name` with a tokenizer of `tokenizer_vocab` tokens cannot serve
    for this worker, or None."""
    if served.name != name:
        return (
            f"the workers serve {served.name!r} but this gateway tokenizes for {name!r}: "
            "give the gateway and the workers the same --model"
        )
    if served.vocab_size and tokenizer_vocab > served.vocab_size:
        return (
            f"this gateway's tokenizer has {tokenizer_vocab} tokens but the workers' model "
            f"{served.name!r} has {served.vocab_size}: give the gateway the workers' --model"
        )
    outside = [i for i in served.eos_token_ids if i >= tokenizer_vocab]
    if outside:
        return (
            f"the workers' end-of-sequence ids {outside} are outside this gateway's tokenizer of "
            f"{tokenizer_vocab} tokens: give the gateway the workers' --model"
        )
    return None


def first_mismatch(name: str, tokenizer_vocab: int, served: list[ServedModel]) -> str | None:
    """The first worker's disagreement with the gateway, or None when all agree."""
    problems = (mismatch(name, tokenizer_vocab, s) for s in served)
    return next((p for p in problems if p), None)
