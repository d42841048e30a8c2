"""A suffix index over recent requests' tokens (SuffixDecoding's idea, bounded): the latest
place each n-gram (n from `prompt_lookup_min` to `prompt_lookup_max`) occurred among the
requests that finished, and the tokens that followed it there. A request drafts the
continuation of the longest n-gram of its own end found in the index.

- **Bounded memory**: at most `max_tokens` tokens of finished requests are kept (their prompt
  and output, as one document each; of a longer one its last DOC_TOKENS, which bounds what a
  finish costs the step loop too); over the bound, the least recently used documents (added or
  drafted from) leave with their entries. Each kept token is the end of at most
  `n_max - n_min + 1` entries (65,536 tokens at one length: about 16 MB).
- **Isolation**: one index per prefix-cache salt (`Sequence.cache_salt`): requests that may not
  share cached blocks (other tenants, under per-tenant isolation) never draft from each other's
  text either, so no tenant can time another's acceptance."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

SUFFIX_TOKENS = 65536  # tokens kept over all salts (about 10-20 MB at one n-gram length)
DOC_TOKENS = 4096  # of a finished request, its last ones (its output, its prompt's end): a
# finish costs the step loop about 3 ms at 4096 (each token an n-gram key, one document evicted)


@dataclass(slots=True)
class Document:
    salt: bytes
    tokens: list[int]


class SuffixIndex:
    def __init__(self, n_min: int, n_max: int, max_tokens: int = SUFFIX_TOKENS) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram lengths {n_min}..{n_max}: need 1 <= min <= max")
        self.n_min, self.n_max, self.max_tokens = n_min, n_max, max_tokens
        self.docs: OrderedDict[int, Document] = OrderedDict()  # least recently used first
        self.tables: dict[bytes, dict[tuple[int, ...], tuple[int, int]]] = {}
        self.tokens = 0  # kept, over every document
        self._next = 0

    def add(self, salt: bytes, tokens: list[int]) -> None:
        """A finished request's tokens join the index (the newest occurrence of an n-gram wins)."""
        tokens = tokens[-min(self.max_tokens, DOC_TOKENS) :]
        if len(tokens) <= self.n_min:
            return
        doc_id, self._next = self._next, self._next + 1
        self.docs[doc_id] = Document(salt, tokens)
        self.tokens += len(tokens)
        table = self.tables.setdefault(salt, {})
        for n in range(self.n_min, self.n_max + 1):
            for end in range(n, len(tokens)):  # an n-gram with at least one token after it
                table[tuple(tokens[end - n : end])] = (doc_id, end)
        while self.tokens > self.max_tokens:
            self._evict()

    def propose(self, salt: bytes, context: list[int], k: int) -> list[int]:
        """Up to `k` tokens to follow `context`, from the index of its salt; none if no n-gram
        of its end is there."""
        table = self.tables.get(salt)
        if not table or k <= 0:
            return []
        for n in range(min(self.n_max, len(context)), self.n_min - 1, -1):
            hit = table.get(tuple(context[-n:]))
            if hit is not None:
                doc_id, end = hit
                self.docs.move_to_end(doc_id)
                return self.docs[doc_id].tokens[end : end + k]
        return []

    def _evict(self) -> None:
        doc_id, doc = self.docs.popitem(last=False)
        self.tokens -= len(doc.tokens)
        table = self.tables[doc.salt]
        tokens = doc.tokens
        for n in range(self.n_min, self.n_max + 1):
            for end in range(n, len(tokens)):
                key = tuple(tokens[end - n : end])
                if table.get(key, (None,))[0] == doc_id:
                    del table[key]
        if not table:
            del self.tables[doc.salt]

    def entries(self) -> int:
        """The n-grams indexed, over every salt (memory's measure)."""
        return sum(map(len, self.tables.values()))
