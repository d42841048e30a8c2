"""Next-token choice: greedy, temperature, top-k, top-p; seeded draws are reproducible.

A seeded draw depends only on (seed, sample_index, logits): its generator is seeded from a hash
of (seed, sample_index), so batching and recomputation do not change it.

The order, as vLLM's: logit_bias, the min_tokens mask, the repetition penalty (prompt and
generated tokens), the presence and frequency penalties (generated tokens), the grammar's mask
(structured output: what it does not allow next is -inf); then temperature, min_p, top-k,
top-p. Greedy takes the argmax after the first five. Logprobs are those of the raw
model logits (vLLM's default), whatever the settings.

The rows whose only change to the logits is their grammar are masked in one op (their masks one
tensor, worker_svc/grammar.py's RowMasks): greedy ones take the argmax of that tensor, the others
are drawn from their row of it, one by one as every shaped row is (the same draws as a row
masked alone).
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from llmserve.runtime.sampling import SamplingParams
from worker_svc.work import TokenLogprobs

if TYPE_CHECKING:
    from worker_svc.grammar import RowMasks


def draw_seed(seed: int, sample_index: int) -> int:
    """A 63-bit generator seed from (seed, sample_index), stable across processes."""
    digest = hashlib.blake2b(f"{seed}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def fresh_generator() -> torch.Generator:
    return torch.Generator().manual_seed(secrets.randbits(63))


def sample_tokens(
    logits: torch.Tensor,  # [rows, vocab] fp32
    settings: list[SamplingParams],
    sample_indices: list[int],
    rng: torch.Generator,  # used for unseeded draws
    histories: Sequence[Sequence[int]] | None = None,  # per row: prompt + generated, if penalized
    masks: RowMasks | None = None,  # the constrained rows' grammar masks
) -> list[int]:
    """One token per row. A row's history is every token the request has processed (its prompt,
    then its sample_index generated tokens); only penalized rows need one. A row whose settings
    hold a grammar is masked by its row of `masks` (worker_svc/grammar.py)."""
    only, masked_rows = _grammar_only(logits, settings, masks)  # [rows, vocab], in one op
    masked = dict(zip(only, masked_rows, strict=True))  # row -> its logits under its grammar
    allowed = {} if masks is None else dict(zip(masks.rows, masks.allowed, strict=True))
    out = logits.argmax(dim=-1)  # [rows]: the greedy rows' tokens
    if only:
        out[only] = masked_rows.argmax(dim=-1)
    plain = [i for i, s in enumerate(settings) if _plain(s)]
    if plain:  # unseeded temperature-only rows: one batched draw
        temps = torch.tensor([settings[i].temperature for i in plain]).unsqueeze(1)  # [rows, 1]
        rows = logits[plain].float()
        probs = torch.softmax((rows - rows.max(dim=-1, keepdim=True).values) / temps, dim=-1)
        out[plain] = torch.multinomial(probs, 1, generator=rng).squeeze(1)
    drawn = set(plain)
    for row, s in enumerate(settings):
        shaped = s.shapes_logits and row not in masked
        if row in drawn or (s.greedy and not shaped):
            continue
        row_logits = masked.get(row, logits[row])
        if shaped:
            history = histories[row] if histories is not None else ()
            row_logits = shape_logits(row_logits, s, history, sample_indices[row], allowed.get(row))
        gen = rng
        if s.seed is not None and not s.greedy:
            gen = torch.Generator().manual_seed(draw_seed(s.seed, sample_indices[row]))
        out[row] = sample_one(row_logits, s, gen)
    return out.tolist()


def _grammar_only(
    logits: torch.Tensor, settings: list[SamplingParams], masks: RowMasks | None
) -> tuple[list[int], torch.Tensor]:
    """The rows whose grammar is their only change to the logits, and their logits masked."""
    if masks is None:
        return [], logits[:0]
    at = [k for k, row in enumerate(masks.rows) if not settings[row].shapes_beyond_grammar]
    rows = [masks.rows[k] for k in at]
    return rows, grammar_masked(logits[rows].float(), masks.allowed[at])


def _plain(s: SamplingParams) -> bool:
    """Unseeded, temperature only: rows that can share one batched draw."""
    return (
        not s.greedy
        and s.seed is None
        and s.top_k == 0
        and not _top_p_on(s)
        and s.min_p <= 0.0
        and not s.shapes_logits
    )


def _top_p_on(s: SamplingParams) -> bool:
    return 0.0 < s.top_p < 1.0  # 1 (and 0: unset) mean off


def shape_logits(
    logits: torch.Tensor,
    s: SamplingParams,
    history: Sequence[int],
    sample_index: int,
    allowed: torch.Tensor | None = None,  # [vocab] bool: its grammar's next tokens, if constrained
) -> torch.Tensor:
    """logits: [vocab]. logit_bias, the min_tokens mask, the penalties and the grammar's mask,
    in vLLM's order; history: prompt + generated tokens, the last sample_index of them
    generated."""
    logits = logits.float().clone()
    if s.logit_bias:
        logits[list(s.logit_bias)] += torch.tensor(list(s.logit_bias.values()))
    if sample_index < s.min_tokens and s.stop_token_ids:
        logits[list(s.stop_token_ids)] = -math.inf
    if s.penalized and history:
        seen = torch.tensor(history)  # [tokens]
        if s.repetition_penalty != 1.0:
            rp, old = s.repetition_penalty, logits[seen]
            logits[seen] = torch.where(old > 0, old / rp, old * rp)
        counts = torch.bincount(seen[len(history) - sample_index :], minlength=logits.shape[0])
        logits -= s.frequency_penalty * counts + s.presence_penalty * (counts > 0)  # [vocab]
    if allowed is not None:
        logits = grammar_masked(logits, allowed)
    return logits


def grammar_masked(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits: [..., vocab]; allowed: [..., vocab] bool, the grammar's next tokens. Where the
    min_tokens mask took every token the grammar allows (a complete answer allows only EOS), the
    grammar wins: its tokens keep their raw place (0) rather than leave the row with nothing to
    draw."""
    masked = logits.masked_fill(~allowed, -math.inf)
    empty = ~torch.isfinite(masked).any(dim=-1, keepdim=True)  # [..., 1]
    if bool(empty.any()):
        raw = torch.zeros_like(logits).masked_fill(~allowed, -math.inf)
        masked = torch.where(empty, raw, masked)
    return masked


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """logits: [vocab], raw. The sampled token's log-softmax and the `top` most likely."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logp.topk(min(top, logp.shape[0]))
    return TokenLogprobs(float(logp[token]), tuple(ids.tolist()), tuple(values.tolist()))


def sample_one(logits: torch.Tensor, s: SamplingParams, gen: torch.Generator) -> int:
    """logits: [vocab] fp32; s.temperature > 0."""
    if s.greedy:
        return int(logits.argmax())
    logits = logits.float()
    scaled = (logits - logits.max()) / s.temperature  # [vocab]; <= 0, finite for tiny T
    if s.min_p > 0.0:  # keep p >= min_p * p_max, that is scaled >= log(min_p)
        scaled = scaled.masked_fill(scaled < math.log(s.min_p), -math.inf)
    nucleus = _top_p_on(s)
    ids: torch.Tensor | None = None
    if 0 < s.top_k < scaled.shape[0]:
        scaled, ids = scaled.topk(s.top_k)  # sorted, descending
    elif nucleus:
        scaled, ids = scaled.sort(descending=True)
    probs = torch.softmax(scaled, dim=-1)
    if nucleus:
        # keep the smallest prefix whose mass reaches top_p (the top token always stays)
        before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(before >= s.top_p, 0.0)
        probs[0] = probs[0].clamp_min(1e-30)
    choice = int(torch.multinomial(probs, 1, generator=gen))
    return choice if ids is None else int(ids[choice])
