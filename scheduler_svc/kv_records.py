"""What the KV layer keeps of each request, apart from the request itself: its prefix-cache
keys, how far its chunks cached it, and whether a failed step made its KV suspect. One record
per request, shared by every worker's KV manager (keys do not depend on the worker; a request
moves between workers), with a memo of the latest requests' keys that a new request whose first
blocks equal theirs may take instead of hashing its own. The core never reads a record."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

from scheduler_svc.blocks import block_keys, common_blocks
from scheduler_svc.sequence import Sequence

KEY_MEMO = 64  # recent requests, by first block key, whose prompt keys a new request may reuse


@dataclass(slots=True)
class KvRecord:
    keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks
    key_block_size: int = 0  # the block size `keys` are for
    cached_to: int = 0  # its chunks have cached its full blocks before this position
    suspect: bool = False  # a step computing its KV failed: cache none of it (until recomputed)


class KvRecords:
    """Every request's record, by request (identity: a resubmission is a new request), and the
    memo of the latest `size` requests' keys by (first block key, block size). A record lives
    as long as its request is referenced (a step in flight may still fail and distrust what the
    request wrote, after it left), and goes with it."""

    def __init__(self, size: int = KEY_MEMO) -> None:
        self.size = size
        self.records: weakref.WeakKeyDictionary[Sequence, KvRecord] = weakref.WeakKeyDictionary()
        self.latest: OrderedDict[tuple[bytes, int], tuple[list[int], KvRecord]] = OrderedDict()

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
        memo, at = self.latest, (keys[0], bs)
        other = memo.get(at)
        memo[at] = (seq.prompt_ids, record)
        memo.move_to_end(at)
        if len(memo) > self.size:
            memo.popitem(last=False)
        if other is None:
            return
        prompt, theirs = other
        if theirs is record or theirs.key_block_size != bs:
            return
        limit = min(upto, len(theirs.keys), len(seq.prompt_ids) // bs, len(prompt) // bs)
        same = common_blocks(seq.prompt_ids, prompt, bs, limit)
        keys += theirs.keys[1:same]
