"""Models for the GPU check without a download: random weights at real architectures' sizes,
built on the device from a config (a forward's time does not depend on the weights' values;
correctness against transformers is checked on the same random weights), and a model directory
of such weights with a byte-level tokenizer of the model's whole vocabulary, for the served stack.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from llmserve.bench.hf_reference import hf_config, hf_state_dict
from worker_svc.loader import random_weights
from worker_svc.model_config import (
    ModelConfig,
    llama31_8b_config,
    llama32_1b_config,
    smollm2_135m_config,
    tiny_config,
)
from worker_svc.weights import Weights

# the shapes, by the name the report gives them; --quick (a CPU rehearsal) uses "tiny" for all
SHAPES = {
    "smollm2-135m": smollm2_135m_config,
    "llama-3.2-1b": llama32_1b_config,
    "llama-3.1-8b": llama31_8b_config,
    "tiny": tiny_config,
}
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2, as SmolLM2's


def shape(name: str) -> ModelConfig:
    config = SHAPES[name]()
    return dataclasses.replace(config, name=f"{name}-random")


def random_model(
    name: str, dtype: torch.dtype, device: torch.device | str, seed: int = 0
) -> tuple[ModelConfig, Weights]:
    """The shape's config and random weights drawn on the device."""
    config = shape(name)
    return config, random_weights(config, dtype, seed=seed, device=device)


def byte_level_tokenizer(vocab_size: int):  # -> tokenizers.Tokenizer
    """A tokenizer of exactly vocab_size tokens that can encode any text and decode any id:
    the special tokens, GPT-2's 256 byte symbols, then filler tokens (random weights make any id
    as likely as any other; a real vocabulary's content changes no timing)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    symbols = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(symbols):
        vocab[symbol] = len(vocab)
    filler = 0
    while len(vocab) < vocab_size:
        vocab[f"w{filler}"] = len(vocab)
        filler += 1
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    return tokenizer


def write_model_dir(config: ModelConfig, weights: Weights, path: Path) -> Path:
    """An HF model directory (config.json, model.safetensors, tokenizer.json and its config) that
    the worker loads and the gateway tokenizes with: the same random model, served."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    raw = hf_config(config).to_dict()
    raw.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (path / "config.json").write_text(json.dumps(raw, indent=1))
    state = {name: t.detach().to("cpu") for name, t in hf_state_dict(config, weights).items()}
    save_file(state, str(path / "model.safetensors"))
    byte_level_tokenizer(config.vocab_size).save(str(path / "tokenizer.json"))
    eos = SPECIAL_TOKENS[config.eos_token_ids[0]] if config.eos_token_ids[0] < 3 else None
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": None}
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    return path
