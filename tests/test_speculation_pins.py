"""What the speculation group's mutation run left unpinned in the proposers and the replay of what
speculation would give: prompt lookup at the shortest texts that can repeat, on misaligned byte
matches and at token ids of 2**31 and over (the wire's ids are uint32); a request's packing kept
and extended between steps; the suffix index's context (the request's last n tokens, across
prompt and output), its carry-over to a proposer with the same n-gram lengths, its least recently
used eviction, what a document too short for an entry or a proposal of nothing does to it, and
its entries; the replay's bounded context, the positions its steps are priced at, its sums over
requests and its own time and skips."""

from __future__ import annotations

import dataclasses
from array import array

import pytest

from scheduler_svc.config import CoreConfig, Speculative
from scheduler_svc.sequence import Finish, Sequence
from scheduler_svc.speculation import potential
from scheduler_svc.speculation.ngram import Packed, propose_ngram, propose_packed
from scheduler_svc.speculation.potential import Potential, Replayed, lookup, oracle, replay
from scheduler_svc.speculation.proposer import Proposer, _tail
from scheduler_svc.speculation.suffix import SuffixIndex

BIG = 2**31  # ids from here on are negative as signed 32-bit ints


def _packed(tokens: list[int]) -> bytes:
    return array("I", tokens).tobytes()


def _seq(rid: str, prompt: list[int], output: list[int] | None = None) -> Sequence:
    return Sequence(rid, prompt, 16, output_ids=list(output or []))


def _finished(rid: str, tokens: list[int]) -> Sequence:
    s = _seq(rid, tokens)
    s.finish = Finish.STOP
    return s


# --- prompt lookup ---


def test_the_shortest_text_that_repeats_drafts_its_run() -> None:
    # n_min + 1 tokens are enough: the last n_min occur once before, followed by one token
    assert propose_ngram([4, 4], 3, 1, 3) == [4, 4, 4]
    assert propose_ngram([4, 4, 4], 3, 2, 2) == [4, 4, 4]  # the n-gram of every token but one
    assert propose_ngram([4, 5], 3, 1, 3) == []
    assert propose_ngram([4], 3, 1, 3) == []


def test_a_misaligned_byte_match_does_not_hide_an_aligned_one_just_before_it() -> None:
    x = 0x01010101  # its bytes match at every offset into a run of 0x01 bytes
    # packed: 01 01 01 01 | 01 00 00 00 | 01 01 01 01: the last token's bytes occur at byte 1
    # (misaligned, the latest) and at byte 0 (token 0): lookup takes token 0's continuation
    assert propose_ngram([x, 1, x], 2, 1, 1) == [1, x]
    assert propose_ngram([7, x, 1, x], 4, 1, 1) == [1, x, 1, x]


def test_prompt_lookup_takes_ids_of_2_to_the_31_and_over() -> None:
    a, b, c = BIG, 2**32 - 1, BIG + 5
    assert propose_ngram([a, b, c, a, b], 2, 2, 2) == [c, a]
    packed = Packed()
    data = packed.update([a, b, c], [])
    data = packed.update([a, b, c], [a, b])
    assert propose_packed(data, 3, 2, 2) == [c, a, b]
    proposer = Proposer(CoreConfig(speculative=Speculative.NGRAM, prompt_lookup_min=2))
    assert proposer.propose(_seq("big", [a, b, c], [a, b]), 2) == [c, a]


def test_a_requests_packing_is_kept_between_steps_and_extended_in_place() -> None:
    proposer = Proposer(CoreConfig(speculative=Speculative.NGRAM, prompt_lookup_min=2))
    s = _seq("a", [1, 2, 3, 1, 2])
    assert proposer.propose(s, 2) == [3, 1]
    packing = proposer.packed[s]
    data = packing.data
    s.output_ids += [3, 9]
    assert proposer.propose(s, 2) == []
    s.output_ids += [1, 2]
    assert proposer.propose(s, 2) == [3, 9]
    assert proposer.packed[s] is packing  # not packed again from the start each step
    assert packing.data is data and packing.count == 9
    assert bytes(data) == _packed([1, 2, 3, 1, 2, 3, 9, 1, 2])


# --- the suffix index, and the proposer's use of it ---


def test_the_suffix_context_is_the_requests_last_n_tokens_across_prompt_and_output() -> None:
    prompt = [1, 2, 3, 4, 5]
    for output in ([], [6], [6, 7], [6, 7, 8], [6, 7, 8, 9], [6, 7, 8, 9, 10, 11, 12]):
        assert _tail(_seq("a", prompt, output), 3) == (prompt + output)[-3:]
    assert _tail(_seq("b", [], [6, 7]), 3) == [6, 7]  # fewer known: all of them
    # drafting from the index: the n-gram (21, 22) ends the prompt and output together
    proposer = Proposer(CoreConfig(speculative=Speculative.SUFFIX, prompt_lookup_min=2))
    proposer.learn(_finished("old", [20, 21, 22, 23, 24, 25, 26, 27]))
    assert proposer.propose(_seq("b", [9, 9, 9, 9, 21], [22]), 2) == [23, 24]
    assert proposer.propose(_seq("c", [9, 9, 9, 9, 9], [8, 21, 22, 23]), 2) == [24, 25]


def test_the_suffix_index_carries_over_only_to_the_same_ngram_lengths() -> None:
    config = CoreConfig(speculative=Speculative.SUFFIX, prompt_lookup_min=2, prompt_lookup_max=3)
    before = Proposer.of(config)
    assert before is not None and before.suffix is not None
    before.learn(_finished("old", [20, 21, 22, 23, 24]))
    same = Proposer.of(
        CoreConfig(speculative=Speculative.NGRAM_SUFFIX, prompt_lookup_min=2, prompt_lookup_max=3),
        before,
    )
    assert same is not None and same.suffix is before.suffix
    assert same.propose(_seq("a", [9, 9, 9, 9, 21, 22]), 2) == [23, 24]
    other = Proposer.of(CoreConfig(speculative=Speculative.SUFFIX, prompt_lookup_min=2), before)
    assert other is not None and other.suffix is not None and other.suffix is not before.suffix
    assert (other.suffix.n_min, other.suffix.n_max) == (2, 5)
    assert other.suffix.docs == {} and other.propose(_seq("a", [9, 9, 9, 9, 21, 22]), 2) == []


@pytest.mark.parametrize("through", [Speculative.OFF, Speculative.NGRAM])
def test_the_core_keeps_the_suffix_index_through_off_and_lookup_only(through) -> None:
    """suffix -> off (or ngram) -> suffix: the index of the requests before is there again, as
    docs/control-plane.md says (it started empty)."""
    from scheduler_svc.config import WorkerSpec
    from scheduler_svc.core import Scheduler

    config = CoreConfig(speculative=Speculative.SUFFIX, prompt_lookup_min=2, prompt_lookup_max=3)
    core = Scheduler(config, [WorkerSpec("w", 64, 4, 4096)])
    index = core.proposer.suffix
    core.proposer.learn(_finished("old", [20, 21, 22, 23, 24]))
    core.reconfigure(dataclasses.replace(config, speculative=through))
    core.reconfigure(config)
    assert core.proposer.suffix is index
    assert core.proposer.propose(_seq("a", [9, 9, 9, 9, 21, 22]), 2) == [23, 24]


def test_the_suffix_index_rejects_ngram_lengths_out_of_order() -> None:
    with pytest.raises(ValueError, match=r"n-gram lengths 3\.\.2: need 1 <= min <= max"):
        SuffixIndex(3, 2)
    with pytest.raises(ValueError, match=r"n-gram lengths 0\.\.2"):
        SuffixIndex(0, 2)


def test_the_suffix_index_proposes_one_token_and_a_proposal_of_none_is_no_use() -> None:
    index = SuffixIndex(2, 2, max_tokens=10)
    index.add(b"", [1, 2, 3, 4, 5])
    index.add(b"", [11, 12, 13, 14, 15])
    assert index.propose(b"", [11, 12], 1) == [13]
    assert index.propose(b"", [1, 2], 0) == []  # drafts nothing from the oldest: not a use
    index.add(b"", [21, 22, 23, 24, 25])  # over the bound: the least recently used leaves
    assert index.propose(b"", [1, 2], 1) == []
    assert index.propose(b"", [11, 12], 1) == [13]
    assert index.propose(b"", [21, 22], 1) == [23]


def test_the_suffix_index_evicts_the_least_recently_used_not_the_newest() -> None:
    index = SuffixIndex(2, 2, max_tokens=10)
    for doc in ([1, 2, 3, 4, 5], [11, 12, 13, 14, 15], [21, 22, 23, 24, 25]):
        index.add(b"", doc)
        assert index.propose(b"", doc[:2], 2) == doc[2:4]  # the newest is always there
    assert index.propose(b"", [1, 2], 2) == []
    assert [d.tokens[0] for d in index.docs.values()] == [11, 21]
    assert index.tokens == 10


def test_a_request_too_short_for_an_entry_takes_no_room() -> None:
    index = SuffixIndex(2, 3, max_tokens=6)
    index.add(b"", [1, 2, 3, 4, 5])
    index.add(b"", [8, 9])  # 2 tokens: no 2-gram with a token after it
    assert index.tokens == 5 and len(index.docs) == 1
    assert index.propose(b"", [1, 2], 2) == [3, 4]


def test_the_entries_are_the_ngrams_followed_by_a_token_and_leave_with_their_document() -> None:
    index = SuffixIndex(2, 3, max_tokens=8)
    index.add(b"a", [1, 2, 1, 2, 3])  # (1, 2) twice: its newest place wins
    # 2-grams ending before the last token: (1,2) (2,1) (1,2); 3-grams: (1,2,1) (2,1,2)
    assert index.entries() == 4
    assert index.propose(b"a", [7, 1, 2], 3) == [3]
    index.add(b"b", [5, 6, 7])  # 8 tokens: within the bound
    assert index.entries() == 4 + 1  # (5, 6): no 3-gram of it has a token after it
    index.add(b"b", [8, 9, 10, 11])  # over: a's document leaves, entries and salt with it
    assert index.propose(b"a", [7, 1, 2], 3) == []
    assert b"a" not in index.tables
    assert index.entries() == 1 + 3  # (5, 6); (8, 9) (9, 10) (8, 9, 10)
    assert index.tokens == 7


# --- the replay of what speculation would give ---


def test_the_replay_of_ids_of_2_to_the_31_and_over_is_that_of_the_same_text_at_small_ids() -> None:
    small_prompt = [3, 5, 8, 4, 6, 1, 2, 9]
    small_output = [7, 3, 5, 8, 4, 6, 1, 2, 9, 3, 5, 8]
    big = Potential(lambda: 0.0)
    big.observe([BIG + t for t in small_prompt], [BIG + t for t in small_output], 4, 2, 3)
    small = Potential(lambda: 0.0)
    small.observe(small_prompt, small_output, 4, 2, 3)
    for name in ("ngram", "oracle"):
        assert big.replayed[name] == small.replayed[name]
    assert small.replayed["ngram"].accepted_tokens > 0
    mine = replay(_packed([BIG + t for t in small_prompt + small_output]), 9, lookup(4, 2, 3))
    assert mine[:4] == replay(_packed(small_prompt + small_output), 9, lookup(4, 2, 3))[:4]


def test_the_replay_searches_only_the_last_context_tokens() -> None:
    block = list(range(1000, 1100))  # the output copies it: found only if the context has it
    tail = len(block)
    room = potential.CONTEXT_TOKENS - tail  # the context before the replayed tokens

    def replayed(filler: int) -> Replayed:
        p = Potential(lambda: 0.0)
        p.observe(block + list(range(200_000, 200_000 + filler)), [0, *block], 5, 1, 1)
        return p.replayed["oracle"]

    far = replayed(room - 1)  # the prompt and first token exceed room by the whole block
    assert (far.tokens, far.steps, far.accepted_tokens) == (tail, tail, 0)
    near = replayed(room - 1 - tail)  # all of it within the context
    assert near.tokens == tail and near.accepted_tokens == tail - near.steps > 0


def test_each_decode_is_priced_at_its_position_in_the_whole_request() -> None:
    seen: list[tuple[float, int]] = []

    def price(position: float, drafted: int) -> float:
        seen.append((position, drafted))
        return 1.0 + 0.001 * position

    prompt = list(range(10_000))  # longer than the context: the replay sees its end only
    output = [7, *range(50_000, 50_020)]  # fresh: one token a step
    p = Potential(lambda: 0.0)
    p.observe(prompt, output, 5, 2, 3, price)
    # the first decode feeds the output's first token, at position len(prompt)
    steps = [(len(prompt) + i, 0) for i in range(20)]
    assert seen[:20] == steps and seen[21:41] == steps
    assert seen[20] == seen[41] == (len(prompt) + 9.5, 0)  # the plain decodes' middle one
    for name in ("ngram", "oracle"):
        r = p.replayed[name]
        assert (r.tokens, r.steps) == (20, 20)
        assert r.step_seconds == pytest.approx(sum(price(q, 0) for q, _ in steps))
        assert r.plain_seconds == pytest.approx(r.step_seconds)


def test_a_replay_without_offset_or_price_puts_token_i_at_i_and_costs_nothing() -> None:
    packed = _packed([1, 2, 3, 4, 1, 2, 3, 4])
    seen: list[float] = []
    priced = replay(packed, 4, oracle(5), lambda q, d: seen.append(q) or 1.0)
    assert seen[0] == 3  # the first decode feeds token 3
    assert priced[:4] == (4, 1, 3, 3)
    unpriced = replay(packed, 4, oracle(5))
    assert unpriced == (4, 1, 3, 3, 0.0, 0.0)
    r = Replayed()
    r.add(*unpriced[:4])
    assert (r.step_seconds, r.plain_seconds) == (0.0, 0.0)


def test_the_replays_sum_over_requests() -> None:
    def price(position: float, drafted: int) -> float:
        return 1.0 + 0.25 * drafted + 0.001 * position

    requests = [
        ([1, 2, 3, 4, 5, 6], [9, 1, 2, 3, 4, 5, 6, 7]),
        ([10, 11, 12, 13], [8, 10, 11, 12, 13, 10, 11, 12, 13, 14]),
    ]
    p = Potential(lambda: 0.0)
    want = [0.0] * 6
    for prompt, output in requests:
        p.observe(prompt, output, 3, 1, 2, price)
        one = replay(_packed(prompt + output), len(prompt) + 1, oracle(3), price)
        assert one[2] > 0 and one[3] > 0
        want = [w + x for w, x in zip(want, one, strict=True)]
    r = p.replayed["oracle"]
    assert r.requests == 2
    assert (r.tokens, r.steps, r.draft_tokens, r.accepted_tokens) == tuple(want[:4])
    assert (r.step_seconds, r.plain_seconds) == pytest.approx(tuple(want[4:]))


def test_the_time_spent_replaying_is_summed_and_each_skip_counted() -> None:
    times = iter([100.0, 100.002, 100.1, 100.15, 100.3, 100.301])
    p = Potential(lambda: next(times))
    assert p.seconds == 0.0
    prompt, output = [1, 2, 3], [4, 5, 6]
    p.observe(prompt, output, 3, 1, 1)  # 2 ms from 100.0: quiet until 100.2
    assert p.seconds == pytest.approx(0.002)
    p.observe(prompt, output, 3, 1, 1)
    p.observe(prompt, output, 3, 1, 1)
    assert p.skipped == 2
    p.observe(prompt, output, 3, 1, 1)  # at 100.3: replayed, 1 ms
    assert p.seconds == pytest.approx(0.003)
    assert p.replayed["ngram"].requests == 2 and p.skipped == 2
