"""The accuracy guard of --quantization: each mode's next-token distributions against the
unquantized (none) path on a fixed prompt set, and the demo's greedy answers.

python -m llmserve.bench.quant_accuracy [--source smollm2] [--modes int8,int4,auto] [--tokens 24]
python -m llmserve.bench.quant_accuracy --reference fp32 --modes auto   (every bf16 mode, none
    too, against the file's values run in fp32; LLMSERVE_RESIDUAL=bf16 for the bf16 residual)
python -m llmserve.bench.quant_accuracy --reference fp32 --modes auto,auto@a8   (auto@a8: the
    int4 matmuls on int8 activations, --int4-activations int8)

Every position of every prompt is scored (teacher forcing: the prompt's own next token is fed,
whatever a mode would pick), so the figures compare distributions, not diverging generations:
top-1 agreement (the argmax is the same) and mean KL(none || mode) in nats. Every row goes
through the quantized kernels, as a decode step's few rows do (auto's dense copies of the int4
layers hold the same values, but its int8 output matrix's do not: scored by its dense copy, the
guard would not see it).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from llmserve.bench.quant_forward import A8, activations_of  # noqa: E402
from llmserve.demo_questions import QUESTIONS  # noqa: E402
from worker_svc.kernel_plan import quantized_linears  # noqa: E402
from worker_svc.linear import QuantizedLinear  # noqa: E402
from worker_svc.loader import load_model  # noqa: E402
from worker_svc.runner import ModelRunner  # noqa: E402
from worker_svc.work import WorkItem  # noqa: E402

PASSAGES = (
    "The river wound slowly through the valley, past fields of wheat and the old stone mill "
    "where the miller's family had worked for three generations.",
    "To make a cup of tea, boil fresh water, warm the pot, add one spoon of leaves per cup and "
    "let it steep for four minutes before pouring.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon "
    "dioxide to produce glucose and release oxygen into the air.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n",
    "In 1969 the Apollo 11 mission landed the first humans on the Moon; Neil Armstrong and "
    "Buzz Aldrin walked on its surface while Michael Collins orbited above.",
    "The meeting is moved to Thursday at three o'clock because the projector in the main room "
    "is broken and the technician cannot come before Wednesday.",
)
BLOCK = 16


@dataclass(frozen=True, slots=True)
class Agreement:
    positions: int
    top1: float  # share of positions whose argmax is the reference's
    mean_kl: float  # mean KL(reference || mode), nats
    max_kl: float


def prompt_set(tokenizer) -> list[list[int]]:
    """The passages as plain text, then the demo's questions in the chat template."""
    plain = [tokenizer.encode(p) for p in PASSAGES]
    chats = [chat_ids(tokenizer, q) for q in QUESTIONS]
    return plain + chats


def chat_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}])
    return tokenizer.encode(text, add_special_tokens=False)


def make_runner(
    source: str, quantization: str, max_tokens: int = 512, dtype: torch.dtype = torch.bfloat16
) -> ModelRunner:
    """A runner whose quantized matrices serve every row count (the small steps' path); a mode
    "x@a8" is x (run it within `activations_of`)."""
    config, weights = load_model(source, dtype, quantization.removesuffix(A8))
    runner = ModelRunner(config, weights, -(-max_tokens // BLOCK), BLOCK, dtype)
    linears = quantized_linears(runner.model.linears)  # the layers'
    if isinstance(runner.model.lm_head, QuantizedLinear):
        linears.append(runner.model.lm_head)  # auto's int8 output matrix
    for lin in linears:
        lin.dense = None
    return runner


def next_token_logits(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    """[positions of all prompts, vocab] fp32: the distribution after each prompt token."""
    rows = []
    for i, ids in enumerate(prompts):
        table = list(range(-(-len(ids) // BLOCK)))
        rows.append(runner.compute_logits([WorkItem(str(i), ids, 0, table)], all_positions=True))
    return torch.cat(rows).float()


def agreement(reference: torch.Tensor, logits: torch.Tensor) -> Agreement:
    ref, mode = reference.log_softmax(-1), logits.log_softmax(-1)
    kl = (ref.exp() * (ref - mode)).sum(-1)
    top1 = (ref.argmax(-1) == mode.argmax(-1)).float().mean()
    return Agreement(ref.shape[0], float(top1), float(kl.mean()), float(kl.max()))


def greedy(runner: ModelRunner, ids: list[int], tokens: int, stop: tuple[int, ...]) -> list[int]:
    """Greedy continuation of ids (up to `tokens`, ending at a stop token)."""
    table = list(range(-(-(len(ids) + tokens) // BLOCK)))
    out = runner.execute([WorkItem("g", ids, 0, table)])
    generated = [out[0]]
    while len(generated) < tokens and generated[-1] not in stop:
        position = len(ids) + len(generated) - 1
        item = WorkItem("g", [generated[-1]], position, table, sample_index=len(generated))
        generated.append(runner.execute([item])[0])
    return generated


def main() -> None:
    from gateway.tokenizer import load_default_tokenizer

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--source", default="smollm2")
    parser.add_argument("--modes", default="int8,int4,auto")
    parser.add_argument("--tokens", type=int, default=24, help="greedy tokens per question")
    parser.add_argument(
        "--reference", default="none", choices=("none", "fp32"),
        help="none: the bf16 unquantized path; fp32: the file's values run in fp32",
    )  # fmt: skip
    args = parser.parse_args()
    tokenizer = load_default_tokenizer()
    prompts = prompt_set(tokenizer)
    modes = ["none", *args.modes.split(",")]
    runners = {mode: make_runner(args.source, mode) for mode in modes}
    if args.reference == "fp32":
        reference = next_token_logits(
            make_runner(args.source, "none", dtype=torch.float32), prompts
        )
        scored = modes
    else:
        reference, scored = next_token_logits(runners["none"], prompts), modes[1:]
    print(f"{args.source}: {reference.shape[0]} positions in {len(prompts)} prompts, against "
          f"{args.reference}")  # fmt: skip
    print(f"{'mode':<8}{'top-1':>8}{'mean KL':>10}{'max KL':>9}")
    for mode in scored:
        with activations_of(mode):
            a = agreement(reference, next_token_logits(runners[mode], prompts))
        print(f"{mode:<8}{a.top1:>8.3f}{a.mean_kl:>10.4f}{a.max_kl:>9.3f}")
    stop = (tokenizer.eos_token_id,)
    for question in QUESTIONS:
        print(f"\n> {question}")
        for mode, runner in runners.items():
            with activations_of(mode):
                answer = greedy(runner, chat_ids(tokenizer, question), args.tokens, stop)
            text = tokenizer.decode(answer, skip_special_tokens=True).strip()
            print(f"  {mode:<7} {text!r}")


if __name__ == "__main__":
    main()
