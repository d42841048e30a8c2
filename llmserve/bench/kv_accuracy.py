"""The accuracy guard of --kv-cache-dtype: next-token distributions with the KV pool in int8
against the pool in bf16, both against the model run in fp32, where every token is a decode
step that reads its context from the pool.

python -m llmserve.bench.kv_accuracy [--source smollm2] [--cache-dtypes auto,int8] [--tokens 24]

The prompts are quant_accuracy's (passages, and the demo's questions in the chat template), and
one long prompt of all of them in a row (its last positions read ~600 cached ones). Each prompt's
first token is a prompt step; every later token is fed as a decode step (teacher forcing: the
prompt's own next token, whatever a setting would pick), so each row's attention reads its whole
context from the pool as served decodes do. Then each prompt as one chunk (every position's
logits; a chunk attends to its own K/V as the pool holds them). Figures: top-1 agreement with
the fp32 reference and mean KL(fp32 || setting) in nats; then the demo's greedy answers under
each setting.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from llmserve.bench.quant_accuracy import (  # noqa: E402
    BLOCK,
    agreement,
    chat_ids,
    greedy,
    next_token_logits,
    prompt_set,
)
from llmserve.demo_questions import QUESTIONS  # noqa: E402
from worker_svc.cpu_features import host_features  # noqa: E402
from worker_svc.loader import load_model  # noqa: E402
from worker_svc.runner import ModelRunner  # noqa: E402
from worker_svc.work import WorkItem  # noqa: E402


def make_runner(
    source: str, cache_dtype: str, quantization: str, max_tokens: int, dtype: torch.dtype
) -> ModelRunner:
    config, weights = load_model(source, dtype, quantization)
    return ModelRunner(
        config, weights, -(-max_tokens // BLOCK), BLOCK, dtype, cache_dtype=cache_dtype
    )


def decoded_logits(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    """[positions, vocab] fp32: the distribution after each prompt token, every token after the
    first fed as a decode step."""
    rows = []
    for ids in prompts:
        table = list(range(-(-len(ids) // BLOCK)))
        rows.append(runner.compute_logits([WorkItem("p", ids[:1], 0, table)]))
        for position in range(1, len(ids)):
            item = WorkItem("p", [ids[position]], position, table, sample_index=position)
            rows.append(runner.compute_logits([item]))
    return torch.cat(rows).float()


def main(argv: list[str] | None = None) -> None:
    from gateway.tokenizer import load_default_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default="smollm2")
    parser.add_argument("--cache-dtypes", default="auto,int8")
    parser.add_argument("--quantization", default="auto", help="the layers' (--quantization)")
    parser.add_argument("--tokens", type=int, default=24, help="greedy tokens per question")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    tokenizer = load_default_tokenizer()
    prompts = prompt_set(tokenizer)
    prompts.append([t for ids in prompts for t in ids])  # one long context
    longest = max(len(ids) for ids in prompts) + args.tokens + BLOCK
    reference = decoded_logits(
        make_runner(args.source, "auto", "none", longest, torch.float32), prompts
    )
    settings = args.cache_dtypes.split(",")
    runners = {
        c: make_runner(args.source, c, args.quantization, longest, torch.bfloat16) for c in settings
    }
    print(
        f"{args.source}: {reference.shape[0]} decode positions in {len(prompts)} prompts (the "
        f"longest {len(prompts[-1])}), bf16 model, --quantization {args.quantization}, against "
        f"fp32 with an fp32 pool; cpu flags: {' '.join(sorted(host_features().flags))}"
    )
    print(f"{'KV pool':<8}{'top-1':>8}{'mean KL':>10}{'max KL':>9}   (every token a decode step)")
    for setting, runner in runners.items():
        a = agreement(reference, decoded_logits(runner, prompts))
        print(f"{setting:<8}{a.top1:>8.3f}{a.mean_kl:>10.4f}{a.max_kl:>9.3f}")
    chunked = next_token_logits(
        make_runner(args.source, "auto", "none", longest, torch.float32), prompts
    )
    print(f"{'KV pool':<8}{'top-1':>8}{'mean KL':>10}{'max KL':>9}   (each prompt one chunk)")
    for setting, runner in runners.items():
        a = agreement(chunked, next_token_logits(runner, prompts))
        print(f"{setting:<8}{a.top1:>8.3f}{a.mean_kl:>10.4f}{a.max_kl:>9.3f}")
    stop = (tokenizer.eos_token_id,)
    same = 0
    for question in QUESTIONS:
        print(f"\n> {question}")
        answers = {}
        for setting, runner in runners.items():
            answers[setting] = greedy(runner, chat_ids(tokenizer, question), args.tokens, stop)
            text = tokenizer.decode(answers[setting], skip_special_tokens=True).strip()
            print(f"  {setting:<5} {text!r}")
        same += len({tuple(a) for a in answers.values()}) == 1
    print(f"\ngreedy answers identical under every setting: {same} of {len(QUESTIONS)}")


if __name__ == "__main__":
    main()
