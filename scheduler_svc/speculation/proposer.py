"""The proposers a scheduler drafts with (`--speculative`): prompt lookup in the request's own
tokens, the suffix index over finished requests, or both (prompt lookup first: a match in the
request's own text is the likelier continuation; the suffix index where it finds none)."""

from __future__ import annotations

from scheduler_svc.config import CoreConfig, Speculative
from scheduler_svc.sequence import Finish, Sequence
from scheduler_svc.speculation.ngram import propose_ngram
from scheduler_svc.speculation.suffix import SuffixIndex


class Proposer:
    def __init__(self, config: CoreConfig, suffix: SuffixIndex | None = None) -> None:
        self.mode = config.speculative
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max
        self.ngram = self.mode in (Speculative.NGRAM, Speculative.NGRAM_SUFFIX)
        self.suffix: SuffixIndex | None = None
        if self.mode in (Speculative.SUFFIX, Speculative.NGRAM_SUFFIX):
            same = suffix is not None and (suffix.n_min, suffix.n_max) == (self.n_min, self.n_max)
            self.suffix = suffix if same else SuffixIndex(self.n_min, self.n_max)

    @staticmethod
    def of(config: CoreConfig, before: Proposer | None = None) -> Proposer | None:
        """The proposer of `config` (None with speculation off); a suffix index of `before`
        with the same n-gram lengths carries over."""
        if config.speculative is Speculative.OFF:
            return None
        return Proposer(config, before.suffix if before is not None else None)

    def propose(self, seq: Sequence, k: int, skip: int = 0) -> list[int]:
        """Up to `k` tokens to follow `seq`'s tokens and `skip` unknown ones (a token in flight:
        the proposal's first `skip` tokens stand for it and are dropped)."""
        tokens, want = seq.tokens, k + skip
        draft = propose_ngram(tokens, want, self.n_min, self.n_max) if self.ngram else []
        if not draft and self.suffix is not None:
            draft = self.suffix.propose(seq.cache_salt, tokens, want)
        return draft[skip:]

    def learn(self, seq: Sequence) -> None:
        """A request finished: its tokens join the suffix index (not an error's or a cancel's)."""
        if self.suffix is not None and seq.finish in (Finish.STOP, Finish.LENGTH):
            self.suffix.add(seq.cache_salt, seq.tokens)
