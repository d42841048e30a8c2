"""What the KV layer keeps of each request, apart from the request itself: its prefix-cache
keys, how far its chunks cached it, and whether a failed step made its KV suspect. One record
per request, shared by every worker's KV manager (keys do not depend on the worker; a request
moves between workers), with a memo of the latest requests' keys that a new request whose first
blocks equal theirs may take instead of hashing its own. The core never reads a record."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

from scheduler_svc.blocks import block_keys, common_blocks
from scheduler_svc.sequence import Sequence

KEY_MEMO = 64  # recent requests, by first block key, whose prompt keys a new request may reuse
NO_IDS: list[int] = []  # a memo entry's head when it has none; never changed


@dataclass(slots=True)
class KvRecord:
    keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks
    key_block_size: int = 0  # the block size `keys` are for
    cached_to: int = 0  # its chunks have cached its full blocks before this position
    suspect: bool = False  # a step computing its KV failed: cache none of it (until recomputed)


class Latest(NamedTuple):
    """A memo entry: a request's prompt, its record, and the ids of its first blocks as far as
    they equal those of the entry it replaced (a shared document's), which the next request
    compares first, in one comparison."""

    prompt: list[int]
    record: KvRecord
    head: list[int]


class KvRecords:
    """Every request's record, by request (identity: a resubmission is a new request), and the
    memo of the latest `size` requests' keys by (first block key, block size). A record lives
    as long as its request is referenced (a step in flight may still fail and distrust what the
    request wrote, after it left), and goes with it. The memo keeps a first key seen again (a
    shared document) before one seen once (a prompt of its own): a stream of prompts of their
    own pushes out only each other while a first key seen again is in it. With `live`, a first
    key the memo lost is looked up among the live requests too (the latest of each first key,
    weakly: it costs no memory once they are gone)."""

    def __init__(self, size: int = KEY_MEMO, live: bool = False) -> None:
        self.size = size
        self.records: weakref.WeakKeyDictionary[Sequence, KvRecord] = weakref.WeakKeyDictionary()
        self.once: dict[tuple[bytes, int], Latest] = {}  # oldest first
        self.again: dict[tuple[bytes, int], Latest] = {}  # oldest first
        self.live: weakref.WeakValueDictionary[tuple[bytes, int], Sequence] | None = (
            weakref.WeakValueDictionary() if live else None
        )

    def of(self, seq: Sequence) -> KvRecord:
        record = self.records.get(seq)
        if record is None:
            record = self.records[seq] = KvRecord()
        return record

    def keys_of(self, seq: Sequence, upto: int, bs: int) -> list[bytes]:
        """The keys of `seq`'s first `upto` full blocks (kept in its record, extended as needed;
        only the tokens of the blocks still to hash are read)."""
        record = self.of(seq)
        if record.key_block_size != bs:
            record.keys, record.key_block_size = [], bs
        keys = record.keys
        if len(keys) < upto:
            prompt, salt = seq.prompt_ids, seq.cache_salt
            if upto * bs <= len(prompt):
                block_keys(prompt, bs, keys, upto, salt)
            else:
                at = len(keys) * bs
                tail = prompt[at:] + seq.output_ids[max(0, at - len(prompt)) :]
                block_keys(tail, bs, keys, upto, salt, offset=at)
        return keys

    def reuse(self, seq: Sequence, bs: int, upto: int) -> None:
        """A request about to look up its hit: where its prompt's first blocks equal, token for
        token, those of the latest request whose first key is its own (same first block, same
        salt), take that one's keys instead of hashing them (keys are a function of the salt
        and the tokens: equal tokens, equal keys). Comparing ids costs far less than hashing
        them, and a long cached prefix (a document, a conversation's history) is what most
        admissions of a Mooncake-shaped load look up."""
        keys = self.keys_of(seq, 1, bs)
        record = self.records[seq]
        at = (keys[0], bs)
        other = self._take(at, seq)
        head = NO_IDS
        if other is not None and other.record is not record and other.record.key_block_size == bs:
            head = self._take_keys(seq, keys, other, bs, upto)
        self._put(at, Latest(seq.prompt_ids, record, head), again=other is not None)

    def _take_keys(
        self, seq: Sequence, keys: list[bytes], other: Latest, bs: int, upto: int
    ) -> list[int]:
        """`seq`'s `keys` extended with `other`'s as far as their prompts' first blocks (at
        most `upto`) are equal; the ids of those blocks, `seq`'s head in the memo."""
        ids, (prompt, theirs, head) = seq.prompt_ids, other
        limit = min(upto, len(theirs.keys), len(ids) // bs, len(prompt) // bs)
        known = len(head) // bs  # `head` begins `prompt`: where it begins `ids` too, so far equal
        if known > limit or ids[: len(head)] != head:
            known = 0
        same = common_blocks(ids, prompt, bs, limit, known)
        keys += theirs.keys[1:same]
        return head if same == known else ids[: same * bs]

    def _take(self, at: tuple[bytes, int], seq: Sequence) -> Latest | None:
        """The memo's entry for `at`, out of the memo (`seq`'s replaces it); else the latest
        live request's of `at`, if kept."""
        latest = self.again.pop(at, None) or self.once.pop(at, None)
        live = self.live
        if live is None:
            return latest
        if latest is None and (other := live.get(at)) is not None:
            # kept here by its own reuse, which made its record: the record lives as it does
            latest = Latest(other.prompt_ids, self.records[other], NO_IDS)
        live[at] = seq
        return latest

    def _put(self, at: tuple[bytes, int], latest: Latest, again: bool) -> None:
        """`latest` is the memo's newest entry for `at` (seen `again`, or once). Over `size`,
        the oldest first key seen once leaves, or, if that is the new one, the oldest seen
        again."""
        once, seen = self.once, self.again
        (seen if again else once)[at] = latest
        if len(once) + len(seen) > self.size:
            oldest = once if len(once) > 1 or not seen else seen
            del oldest[next(iter(oldest))]
