"""HF model directories built in memory for tests: small random transformers models (saved with
save_pretrained) and small byte-level BPE tokenizers with a tokenizer_config.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

VOCAB = 96
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """transformers' init (std 0.02, zero biases, unit norms) leaves logits near uniform and the
    biases untested: draw every parameter instead, at scales where each one shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise * p.shape[1] ** -0.5)


def save_hf_model(kind: str, overrides: dict, directory: Path, seed: int = 0):
    """A random transformers model of this shape saved to directory (config.json +
    model.safetensors); returns it in fp32 eval mode, the oracle."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[kind]
    config = config_class(**{**SMALL, "tie_word_embeddings": False, **overrides})
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = model_class(config).float().eval()
    randomize(model, seed)
    model.save_pretrained(directory)
    return model


CORPUS = [
    "The capital of France is Paris. The capital of Japan is Tokyo.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Once upon a time, in a small village, there lived an old clockmaker.",
    "Photosynthesis converts light into chemical energy; 12 + 30 = 42.",
    "naïve café résumé 中文 😀",
]
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_bpe(specials: list[str], post_processor=None) -> HFTokenizer:
    """A small byte-level BPE trained in memory, with special tokens at the front."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    if post_processor is not None:
        tok.post_processor = post_processor
    return tok


def write_dir(path: Path, backend: HFTokenizer, settings: dict, template_file: str = "") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **settings}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if template_file:
        (path / "chat_template.jinja").write_text(template_file)
    return path


def qwen2_style(path: Path) -> Path:
    """No BOS, ChatML in chat_template.jinja (transformers 5 saves it there)."""
    backend = byte_level_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    settings = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    return write_dir(path, backend, settings, template_file=CHATML_TEMPLATE)
