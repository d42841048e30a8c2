"""The gateway's tokenizer from an HF model directory (tokenizer.json + tokenizer_config.json or
chat_template.jinja) against transformers' AutoTokenizer on the same directory (offline)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
from tokenizers import processors

from gateway.tokenizer import Tokenizer
from gateway.tokenizer_files import load_tokenizer
from llmserve.stack import Stack, StackSettings
from tests.hf_dirs import byte_level_bpe, qwen2_style, write_dir

TEXTS = [
    "The capital of Spain is",
    "  two leading spaces and trailing   ",
    "numbers 1234 and 3.14\nnew line\tand tab",
    "unknown words: zyxw qqq 😀👍🏽 中文",
    "special <|eot_id|> inside <|start_header_id|>user<|end_header_id|> text",
    "",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Japan?"},
]
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def llama3_style(path: Path) -> Path:
    """BOS added by tokenizer.json's post-processor, and spelled again by the template (as
    Llama 3's): a rendered chat must still hold one."""
    specials = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
    bos = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", 0)],
    )
    settings = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": {"__type": "AddedToken", "content": "<|eot_id|>", "special": True},
        "chat_template": LLAMA3_TEMPLATE,
    }
    return write_dir(path, byte_level_bpe(specials, bos), settings)


def llama2_style(path: Path) -> Path:
    """BOS from the post-processor (add_bos_token in tokenizer_config.json says the same), and
    the template is one of a list of named templates."""
    bos = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend = byte_level_bpe(["<unk>", "<s>", "</s>"], bos)
    settings = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": True,
        "add_eos_token": False,
        "chat_template": [
            {"name": "tool_use", "template": "unused"},
            {"name": "default", "template": "{% for m in messages %}[{{ m.content }}]{% endfor %}"},
        ],
    }
    return write_dir(path, backend, settings)


STYLES = {"llama3": llama3_style, "qwen2": qwen2_style, "llama2": llama2_style}


@pytest.fixture(scope="module", params=sorted(STYLES))
def pair(request, tmp_path_factory) -> tuple[Tokenizer, object]:
    transformers = pytest.importorskip("transformers")
    directory = STYLES[request.param](tmp_path_factory.mktemp(request.param))
    return load_tokenizer(str(directory)), transformers.AutoTokenizer.from_pretrained(directory)


def test_encode_matches_transformers_with_and_without_special_tokens(pair) -> None:
    ours, theirs = pair
    for text in TEXTS:
        assert ours.encode(text) == theirs(text).input_ids, text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(
            text, add_special_tokens=False
        ), text


def test_decode_matches_transformers(pair) -> None:
    ours, theirs = pair
    for text in TEXTS:
        ids = theirs(text).input_ids
        for skip in (False, True):
            expected = theirs.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
            )
            assert ours.decode(ids, skip_special_tokens=skip) == expected, text


def test_special_tokens_match_transformers(pair) -> None:
    ours, theirs = pair
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.bos_token_id == theirs.bos_token_id
    added = theirs.added_tokens_decoder.items()
    assert ours.special_token_ids == frozenset(i for i, token in added if token.special)
    assert ours.vocab_size == len(theirs)
    assert [ours.id_to_token(i) for i in range(len(theirs))] == theirs.convert_ids_to_tokens(
        list(range(len(theirs)))
    )


def test_chat_prompt_renders_and_tokenizes_as_transformers(pair) -> None:
    """The text as apply_chat_template renders it; its ids (as the gateway encodes a chat:
    without adding special tokens) as apply_chat_template tokenizes it, so one BOS only."""
    ours, theirs = pair
    text = ours.apply_chat_template(MESSAGES)
    assert text == theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    expected = theirs.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    if not isinstance(expected, list):  # transformers 5 returns a BatchEncoding
        expected = expected["input_ids"]
    assert ours.encode(text, add_special_tokens=False) == expected
    if ours.bos_token_id is not None:
        assert expected.count(ours.bos_token_id) <= 1


def test_directory_without_tokenizer_json_is_refused(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_up_gives_the_gateway_the_workers_model(tmp_path) -> None:
    """A directory (or file) is given to the gateway too; a packaged model it learns from the
    workers, so that nothing can disagree."""
    directory = qwen2_style(tmp_path / "model")
    (directory / "config.json").write_text("{}")
    commands = Stack(StackSettings(model=str(directory)), tmp_path).commands()
    for name in ("gateway", "worker0"):
        flags = commands[name]
        assert flags[flags.index("--model") + 1] == str(directory.resolve()), name
    commands = Stack(StackSettings(model="tiny"), tmp_path).commands()
    assert "--model" not in commands["gateway"]
    worker = commands["worker0"]
    assert worker[worker.index("--model") + 1] == "tiny"
