"""Next-token choice: greedy, temperature, top-k, top-p; seeded draws are reproducible.

A seeded draw depends only on (seed, sample_index, logits): its generator is seeded from a hash
of (seed, sample_index), so batching and recomputation do not change it.

The order, as vLLM's: logit_bias, the min_tokens mask, the repetition penalty (prompt and
generated tokens), the presence and frequency penalties (generated tokens), the grammar's mask
(structured output: what it does not allow next is -inf); then temperature, min_p, top-k,
top-p. Greedy takes the argmax after the first five. Logprobs are those of the raw
model logits (vLLM's default), whatever the settings.

The rows whose only change to the logits is their grammar (their masks one tensor,
worker_svc/grammar.py's RowMasks) are drawn over what their grammar allows. Where it allows at
most 1/NARROW_SHARE of the vocabulary (a key, an enum, a digit: most of a JSON answer), the row
is drawn over those ids alone, a draw of a few (or no) numbers rather than one over the whole
vocabulary: the same distribution, and seeded it depends only on (seed, sample_index, the
allowed ids' logits). A token the grammar forces is taken without a draw. The wider rows are
masked in one op and drawn as each would be masked alone (the same draws).
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from llmcommon.sampling import SamplingParams
from worker_svc.work import TokenLogprobs

if TYPE_CHECKING:
    from worker_svc.grammar import RowMasks


def draw_seed(seed: int, sample_index: int) -> int:
    """A 63-bit generator seed from (seed, sample_index), stable across processes."""
    digest = hashlib.blake2b(f"{seed}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def fresh_generator() -> torch.Generator:
    return torch.Generator().manual_seed(secrets.randbits(63))


NARROW_SHARE = 8  # a grammar that allows at most vocab / 8 tokens: drawn over their ids alone


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
    out = logits.argmax(dim=-1)  # [rows]: the greedy rows' tokens
    done = set(_grammar_only(logits, settings, sample_indices, rng, masks, out))
    allowed = {} if masks is None else dict(zip(masks.rows, masks.allowed, strict=True))
    plain = [i for i, s in enumerate(settings) if _plain(s)]
    if plain:  # unseeded temperature-only rows: one batched draw
        temps = torch.tensor([settings[i].temperature for i in plain]).unsqueeze(1)  # [rows, 1]
        rows = logits[plain].float()
        probs = torch.softmax((rows - rows.max(dim=-1, keepdim=True).values) / temps, dim=-1)
        out[plain] = torch.multinomial(probs, 1, generator=rng).squeeze(1)
    done.update(plain)
    for row, s in enumerate(settings):
        if row in done or (s.greedy and not s.shapes_logits):
            continue
        row_logits = logits[row]
        if s.shapes_logits:
            history = histories[row] if histories is not None else ()
            row_logits = shape_logits(row_logits, s, history, sample_indices[row], allowed.get(row))
        out[row] = sample_one(row_logits, s, _generator(s, sample_indices[row], rng))
    return out.tolist()


def _generator(s: SamplingParams, sample_index: int, rng: torch.Generator) -> torch.Generator:
    """A seeded row's own generator for this draw; the worker's for the rest."""
    if s.seed is None or s.greedy:
        return rng
    return torch.Generator().manual_seed(draw_seed(s.seed, sample_index))


def _grammar_only(
    logits: torch.Tensor,
    settings: list[SamplingParams],
    sample_indices: list[int],
    rng: torch.Generator,
    masks: RowMasks | None,
    out: torch.Tensor,  # [rows]: their tokens are written here
) -> list[int]:
    """The tokens of the rows whose grammar is their only change to the logits; those rows."""
    if masks is None:
        return []
    at = [k for k, row in enumerate(masks.rows) if not settings[row].shapes_beyond_grammar]
    rows, allowed = [masks.rows[k] for k in at], masks.allowed[at]  # [len(at), vocab]
    counts = allowed.sum(dim=-1).tolist()
    vocab = logits.shape[-1]
    narrow = [j for j, n in enumerate(counts) if 0 < n * NARROW_SHARE <= vocab]
    wide = [j for j, n in enumerate(counts) if not 0 < n * NARROW_SHARE <= vocab]
    if narrow:  # each row's allowed ids, ascending, in one op
        ids = allowed[narrow].nonzero()[:, 1].split([counts[j] for j in narrow])
        for j, row_ids in zip(narrow, ids, strict=True):
            out[rows[j]] = _draw_among(
                logits[rows[j]], row_ids, settings[rows[j]], sample_indices[rows[j]], rng
            )
    if wide:  # raw logits are finite: a grammar's mask alone leaves each row something to draw
        masked = logits[[rows[j] for j in wide]].float().masked_fill(~allowed[wide], -math.inf)
        for j, row_logits in zip(wide, masked, strict=True):
            out[rows[j]] = _pick(row_logits, settings[rows[j]], sample_indices[rows[j]], rng)
    return rows


def _draw_among(
    logits: torch.Tensor,
    ids: torch.Tensor,
    s: SamplingParams,
    sample_index: int,
    rng: torch.Generator,
) -> int:
    """logits: [vocab]; ids: the allowed tokens, ascending. A token of `ids`, drawn as `s` says
    from their logits alone (greedy: the first of the highest); one id is taken as it is."""
    if len(ids) == 1:
        return int(ids[0])
    return int(ids[_pick(logits[ids].float(), s, sample_index, rng)])


def _pick(logits: torch.Tensor, s: SamplingParams, sample_index: int, rng: torch.Generator) -> int:
    """logits: [n]. The argmax of a greedy row, else a draw with the row's generator."""
    if s.greedy:
        return int(logits.argmax())
    return sample_one(logits, s, _generator(s, sample_index, rng))


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
