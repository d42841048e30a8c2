"""The proposers of speculative decoding: prompt lookup finds the tokens that followed the most
recent earlier occurrence of the request's last n tokens (the longest n within min..max); the
suffix index drafts from finished requests' tokens, within a bound on the tokens it keeps, and
never across prefix-cache salts (tenants)."""

from __future__ import annotations

import random

from scheduler_svc.config import CoreConfig, Speculative
from scheduler_svc.sequence import Finish, Sequence
from scheduler_svc.speculation.ngram import Packed, propose_ngram, propose_packed
from scheduler_svc.speculation.proposer import Proposer
from scheduler_svc.speculation.suffix import SuffixIndex


def naive(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        tail = tokens[-n:]
        for at in range(len(tokens) - n - 1, -1, -1):
            if tokens[at : at + n] == tail:
                period = tokens[at + n :]
                return (period * k)[:k]
    return []


def test_prompt_lookup_proposes_what_followed_the_most_recent_earlier_occurrence() -> None:
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert propose_ngram(tokens, 3, 2, 3) == [7, 8, 1]
    assert propose_ngram(tokens, 1, 2, 3) == [7]
    assert propose_ngram([5, 6, 7, 5, 6], 5, 2, 2) == [7, 5, 6, 7, 5]  # to the end, repeated


def test_a_continuation_that_reaches_the_end_repeats_as_the_texts_period() -> None:
    assert propose_ngram([9, 4, 4, 4, 4, 4], 5, 2, 3) == [4] * 5  # a run: not one token a step
    assert propose_ngram([1, 7, 8, 7, 8, 7], 4, 2, 2) == [8, 7, 8, 7]


def test_prompt_lookup_honours_min_and_max() -> None:
    # the last 3 tokens (1 2 3) recur once, followed by 4; the last 2 (2 3) more recently, by 8
    tokens = [1, 2, 3, 4, 0, 2, 3, 8, 1, 2, 3]
    assert propose_ngram(tokens, 2, 2, 3) == [4, 0]  # the longest match first
    assert propose_ngram(tokens, 2, 2, 2) == [8, 1]  # max 2: the most recent 2-gram
    assert propose_ngram([4, 9, 5, 9], 2, 2, 3) == []  # only a 1-gram recurs: below min
    assert propose_ngram([4, 9, 5, 9], 2, 1, 3) == [5, 9]
    assert propose_ngram([1, 2, 3], 0, 1, 3) == []


def test_prompt_lookup_agrees_with_a_plain_search_at_any_id() -> None:
    """Packed ids whose bytes match across id boundaries are not matches."""
    rng = random.Random(7)
    for _ in range(400):
        alphabet = rng.choice([[0, 1, 256, 65536], [3, 4, 5], list(range(50000, 50004))])
        tokens = [rng.choice(alphabet) for _ in range(rng.randint(1, 40))]
        n_min = rng.randint(1, 3)
        n_max = rng.randint(n_min, 5)
        assert propose_ngram(tokens, 4, n_min, n_max) == naive(tokens, 4, n_min, n_max)


def test_a_requests_packing_grows_with_its_output_and_proposes_the_same() -> None:
    rng = random.Random(11)
    prompt = [rng.randrange(6) for _ in range(30)]
    output: list[int] = []
    packed = Packed()
    for _ in range(60):
        data = packed.update(prompt, output)
        assert propose_packed(data, 4, 2, 4) == propose_ngram(prompt + output, 4, 2, 4)
        output += [rng.randrange(6) for _ in range(rng.randint(0, 3))]


def test_the_suffix_index_drafts_the_continuation_of_a_finished_request() -> None:
    index = SuffixIndex(2, 3)
    index.add(b"", [10, 11, 12, 13, 14, 15])
    assert index.propose(b"", [99, 11, 12], 3) == [13, 14, 15]
    assert index.propose(b"", [99, 98, 12], 3) == []  # no 2-gram of its end is there
    index.add(b"", [50, 11, 12, 40])  # the newest occurrence wins
    assert index.propose(b"", [7, 11, 12], 2) == [40]
    assert index.propose(b"", [10, 11, 12], 2) == [13, 14]  # the longer match first


def test_the_suffix_index_keeps_at_most_its_bound_and_forgets_the_least_recently_used() -> None:
    index = SuffixIndex(2, 2, max_tokens=100)
    rng = random.Random(1)
    for doc in range(60):
        index.add(b"", [1000 + doc] + [rng.randrange(5000) for _ in range(19)])
        assert index.tokens <= 100
        assert index.entries() <= index.tokens  # one n-gram length: at most one entry a token
    assert len(index.docs) == 5
    assert index.propose(b"", [1000, 1], 1) == []  # the first document is gone, entries too
    kept = index.docs[next(iter(index.docs))].tokens
    assert index.propose(b"", kept[:2], 3) == kept[2:5]  # drafting from it makes it recent
    index.add(b"", [7] * 20)
    assert any(d.tokens == kept for d in index.docs.values())


def test_the_suffix_index_never_drafts_across_salts() -> None:
    index = SuffixIndex(2, 2)
    index.add(b"tenant-a", [1, 2, 3, 4, 5])
    assert index.propose(b"tenant-a", [1, 2], 3) == [3, 4, 5]
    assert index.propose(b"tenant-b", [1, 2], 3) == []
    assert index.propose(b"", [1, 2], 3) == []


def seq(rid: str, prompt: list[int], salt: bytes = b"", output: list[int] | None = None):
    s = Sequence(rid, prompt, 16, cache_salt=salt, output_ids=list(output or []))
    return s


def test_ngram_then_suffix_takes_the_suffix_index_where_prompt_lookup_finds_nothing() -> None:
    config = CoreConfig(speculative=Speculative.NGRAM_SUFFIX, prompt_lookup_min=2)
    proposer = Proposer(config)
    done = seq("old", [20, 21, 22, 23, 24, 25])
    done.finish = Finish.STOP
    proposer.learn(done)
    assert proposer.propose(seq("a", [1, 2, 3, 1, 2]), 2) == [3, 1]  # its own text first
    assert proposer.propose(seq("b", [9, 21, 22]), 2) == [23, 24]  # none there: the index
    assert proposer.propose(seq("c", [9, 21, 22]), 2, skip=1) == [24, 25]  # past one in flight
    only = Proposer(CoreConfig(speculative=Speculative.NGRAM, prompt_lookup_min=2))
    only.learn(done)
    assert only.propose(seq("b", [9, 21, 22]), 2) == []
    cancelled = seq("x", [30, 31, 32, 33])
    cancelled.finish = Finish.CANCELLED
    proposer.learn(cancelled)
    assert proposer.propose(seq("d", [30, 31]), 2) == []  # only finished requests' text
