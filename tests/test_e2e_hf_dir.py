"""`llmserve up --model DIR` with an HF model directory (a random Qwen2 and its own tokenizer and
chat template): the gateway tokenizes with that tokenizer and the workers run that model, so a
greedy chat gives what transformers gives."""

from __future__ import annotations

import pytest
import torch

from llmserve import client
from tests.hf_dirs import qwen2_style, save_hf_model
from tests.stacks import running_stack, tiny_settings

MESSAGES = [("system", "Answer briefly."), ("user", "What is the capital of France?")]


def test_greedy_chat_through_the_stack_matches_transformers(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    directory = qwen2_style(tmp_path / "model")
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    shape = dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = save_hf_model("qwen2", {**shape, "vocab_size": len(theirs)}, directory)
    chat = [{"role": r, "content": c} for r, c in MESSAGES]
    prompt = theirs.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if not isinstance(prompt, list) else prompt)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=-1
        )  # never stops early: as ignore_eos
    expected = out[0, len(prompt) :].tolist()

    settings = tiny_settings(model=str(directory), kv_capacity=512, block_size=16)
    with running_stack(settings, tmp_path / "logs") as stack:
        request = client.make_request(
            messages=MESSAGES, max_tokens=8, temperature=0.0, ignore_eos=True
        )
        replies = list(client.stream(stack.settings.gateway, request, timeout=60))
    final = replies[-1].final
    assert final.usage.prompt_tokens == len(prompt)
    assert [t for r in replies[:-1] for t in r.delta.token_ids] == expected
    assert "".join(r.delta.text for r in replies[:-1]) == theirs.decode(
        expected, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
