"""What a user would otherwise run: transformers' static `generate` on padded batches, and its
continuous batching (`generate_batch`) where present, on the same prompts and output lengths.

The model comes from the same GGUF file, read by transformers' own GGUF reader. (The documented
`from_pretrained(dir, gguf_file=...)` needs `accelerate`, which this project does not install; this
builds the same model on the meta device and assigns the tensors, as tests/model_support.py does.)
"""

from __future__ import annotations

import os
import time
from itertools import groupby

from llmserve.bench.prompts import prompt_ids
from llmserve.bench.records import RequestRecord, RunResult
from llmserve.bench.workload import RequestSpec, Workload

PAD_ID = 2


def _ids(workload: Workload, spec: RequestSpec) -> list[int]:
    """The token ids the served stack gets for `spec` (the workload's content, or one word)."""
    if workload.content is None:
        return prompt_ids(spec.prompt_tokens)
    return workload.content.prompt_ids(spec, [])


def load_hf_model(dtype_name: str = "bf16", attention: str = "eager"):
    """SmolLM2 from the same GGUF as the served stack, read by transformers' own GGUF reader,
    with the given attention implementation. (from_pretrained(gguf_file=...) needs accelerate.)"""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from llmcommon.model_files import default_gguf_path

    path = default_gguf_path()
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    with torch.device("meta"):  # skip random init; every parameter is assigned below
        model = LlamaForCausalLM(config)
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    result = model.load_state_dict(parsed["tensors"], strict=False, assign=True)
    if set(result.missing_keys) - {"lm_head.weight"}:  # lm_head is tied to the embedding
        raise RuntimeError(f"the GGUF does not fill LlamaForCausalLM: {result}")
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config)  # its buffers were on meta
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    model.set_attn_implementation(attention)
    return model.to(dtype).eval()


def has_generate_batch(model) -> bool:
    return hasattr(model, "generate_batch")


def run_static(model, workload: Workload, batch_size: int) -> RunResult:
    """Batches of `batch_size` in request order, left-padded; each batch runs until its longest
    output is done (a request's tokens after its own length are computed and thrown away)."""
    import torch
    from transformers import StoppingCriteria

    class StepTimes(StoppingCriteria):  # called once per generated token: a clock per step
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    specs = workload.requests
    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    for first in range(0, len(specs), batch_size):
        batch = specs[first : first + batch_size]
        longest = max(s.prompt_tokens for s in batch)
        ids = torch.tensor(
            [[PAD_ID] * (longest - s.prompt_tokens) + _ids(workload, s) for s in batch]
        )
        mask = torch.tensor(
            [[0] * (longest - s.prompt_tokens) + [1] * s.prompt_tokens for s in batch]
        )
        steps = StepTimes()
        start = time.perf_counter() - t0
        new_tokens = max(s.output_tokens for s in batch)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=PAD_ID,
                stopping_criteria=[steps],
            )
        times = [t - t0 for t in steps.times]
        produced = out.shape[1] - longest
        for s in batch:
            n = min(s.output_tokens, produced)
            records.append(_record(s, start, start, times[:n]))
    return RunResult(
        "transformers static",
        records,
        [],
        time.perf_counter() - t0,
        config={
            "batch_size": batch_size,
            "padding": "left",
            "attention": model.config._attn_implementation,
        },
        kind="transformers",
    )


def run_generate_batch(model, workload: Workload, max_per_batch: int) -> RunResult | None:
    """transformers' continuous batching; None when absent or when output lengths differ
    (`generate_batch` takes one max_new_tokens for all prompts)."""
    if not has_generate_batch(model):
        return None
    lengths = [k for k, _ in groupby(sorted(s.output_tokens for s in workload.requests))]
    if len(lengths) != 1:
        return None
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gen = GenerationConfig(
        max_new_tokens=lengths[0], do_sample=False, eos_token_id=-1, pad_token_id=PAD_ID
    )
    cb = ContinuousBatchingConfig(max_requests_per_batch=max_per_batch)
    inputs = [_ids(workload, s) for s in workload.requests]
    t0 = time.perf_counter()
    outputs = model.generate_batch(
        inputs, generation_config=gen, continuous_batching_config=cb, record_timestamps=True
    )
    wall = time.perf_counter() - t0
    records = []
    for spec, out in zip(workload.requests, _in_order(outputs, len(inputs)), strict=True):
        created = out.created_time - t0
        records.append(
            _record(
                spec,
                created,
                created,
                [t - t0 for t in out.timestamps or []],
                produced=len(out.generated_tokens),
            )
        )
    return RunResult(
        "transformers generate_batch",
        records,
        [],
        wall,
        config={
            "max_requests_per_batch": max_per_batch,
            "attention": model.config._attn_implementation,
        },
        kind="transformers",
    )


def _in_order(outputs: dict, n: int) -> list:
    """generate_batch's results keyed 'req_0'..; back in input order."""
    by_index = sorted(outputs.values(), key=lambda o: int(str(o.request_id).rsplit("_", 1)[-1]))
    assert len(by_index) == n, f"{len(by_index)} results for {n} prompts"
    return by_index


def _record(
    spec: RequestSpec,
    scheduled: float,
    sent: float,
    token_times: list[float],
    produced: int | None = None,
) -> RequestRecord:
    n = len(token_times) if produced is None else produced
    record = RequestRecord(
        spec.index,
        spec.prompt_tokens,
        spec.output_tokens,
        scheduled,
        sent,
        completion_tokens=n,
        finish="length",
    )
    if token_times:
        record.first_token_s = token_times[0]
        record.token_gaps = [b - a for a, b in zip(token_times, token_times[1:], strict=False)]
        record.end_s = token_times[-1]
    else:
        record.end_s = sent
    return record
