"""The tokenizer of a model (gateway.served_model says which): the default model's, a .gguf
file's, or a Hugging Face model directory's (tokenizer.json, tokenizer_config.json,
chat_template.jinja), read as transformers reads them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from gateway.tokenizer import Tokenizer, load_default_tokenizer

__all__ = ["from_hf_dir", "load_tokenizer"]


def load_tokenizer(source: str) -> Tokenizer:
    """source: "" for the default model's, a .gguf file, or an HF model directory."""
    if not source:
        return load_default_tokenizer()
    path = Path(source).expanduser()
    if path.is_dir():
        return from_hf_dir(path)
    return Tokenizer.from_gguf(path)


def from_hf_dir(path: Path) -> Tokenizer:
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path}: no tokenizer.json (only fast tokenizers are read)")
    backend = _HFTokenizer.from_file(str(path / "tokenizer.json"))
    settings = read_json(path / "tokenizer_config.json")
    bos = token_id(backend, settings.get("bos_token"))
    eos = token_id(backend, settings.get("eos_token"))
    if eos is None:
        eos = model_eos(path)
    if eos is None:
        raise ValueError(f"{path}: no eos_token in tokenizer_config.json nor config.json")
    size = backend.get_vocab_size(with_added_tokens=True)
    tokens = [backend.id_to_token(i) or "" for i in range(size)]
    added = backend.get_added_tokens_decoder()
    return Tokenizer(
        backend=backend,
        tokens=tokens,
        special_ids=frozenset(i for i, token in added.items() if token.special),
        eos_token_id=eos,
        bos_token_id=bos,
        # BOS/EOS come from tokenizer.json's post-processor, as transformers 5 adds them (it
        # ignores tokenizer_config.json's add_bos_token for a tokenizer.json)
        add_bos_token=False,
        chat_template=chat_template(path, settings),
        pre_tokenizer_type="tokenizer.json",
    )


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def token_id(backend: _HFTokenizer, token: str | dict | None) -> int | None:
    """tokenizer_config.json spells a special token as a string or an AddedToken dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return None if token is None else backend.token_to_id(token)


def model_eos(path: Path) -> int | None:
    for name in ("generation_config.json", "config.json"):
        eos = read_json(path / name).get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if eos is not None:
            return int(eos)
    return None


def chat_template(path: Path, settings: dict[str, Any]) -> str | None:
    """chat_template.jinja (transformers 5 saves it there), else tokenizer_config.json's, which
    may be a list of named templates: the one named "default"."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = settings.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        return named.get("default") or next(iter(named.values()), None)
    return template
