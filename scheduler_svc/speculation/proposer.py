"""The proposers a scheduler drafts with (`--speculative`): prompt lookup in the request's own
tokens, the suffix index over finished requests, or both (prompt lookup first: a match in the
request's own text is the likelier continuation; the suffix index where it finds none)."""

from __future__ import annotations

import weakref

from scheduler_svc.config import CoreConfig, Speculative
from scheduler_svc.sequence import Finish, Sequence
from scheduler_svc.speculation.ngram import Packed, propose_packed
from scheduler_svc.speculation.suffix import SuffixIndex


class Proposer:
    def __init__(self, config: CoreConfig, suffix: SuffixIndex | None = None) -> None:
        self.mode = config.speculative
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max
        self.ngram = self.mode in (Speculative.NGRAM, Speculative.NGRAM_SUFFIX)
        self.suffix: SuffixIndex | None = None
        # each request's tokens packed for prompt lookup, extended as it samples (weakly: they
        # go with the request)
        self.packed: weakref.WeakKeyDictionary[Sequence, Packed] = weakref.WeakKeyDictionary()
        if self.mode in (Speculative.SUFFIX, Speculative.NGRAM_SUFFIX):
            same = suffix is not None and (suffix.n_min, suffix.n_max) == (self.n_min, self.n_max)
            self.suffix = suffix if same else SuffixIndex(self.n_min, self.n_max)

    @staticmethod
    def of(
        config: CoreConfig, before: Proposer | None = None, kept: SuffixIndex | None = None
    ) -> Proposer | None:
        """The proposer of `config` (None with speculation off); the suffix index of `before`,
        else `kept` (one set aside while speculation was off or lookup only), carries over
        where its n-gram lengths are the same."""
        if config.speculative is Speculative.OFF:
            return None
        suffix = before.suffix if before is not None and before.suffix is not None else kept
        return Proposer(config, suffix)

    def propose(self, seq: Sequence, k: int, skip: int = 0) -> list[int]:
        """Up to `k` tokens to follow `seq`'s tokens and `skip` unknown ones (a token in flight:
        the proposal's first `skip` tokens stand for it and are dropped)."""
        want, draft = k + skip, []
        if self.ngram:
            packed = self.packed.get(seq)
            if packed is None:
                packed = self.packed[seq] = Packed()
            data = packed.update(seq.prompt_ids, seq.output_ids)
            draft = propose_packed(data, want, self.n_min, self.n_max)
        if not draft and self.suffix is not None:
            draft = self.suffix.propose(seq.cache_salt, _tail(seq, self.n_max), want)
        return draft[skip:]

    def learn(self, seq: Sequence) -> None:
        """A request finished: its tokens join the suffix index (not an error's or a cancel's)."""
        if self.suffix is not None and seq.finish in (Finish.STOP, Finish.LENGTH):
            self.suffix.add(seq.cache_salt, seq.tokens)


def _tail(seq: Sequence, n: int) -> list[int]:
    """The last `n` of its known tokens (without joining the whole prompt and output)."""
    tail = seq.output_ids[-n:]
    if len(tail) < n and seq.prompt_ids:
        tail = seq.prompt_ids[-(n - len(tail)) :] + tail
    return tail
