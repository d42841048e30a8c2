"""llmserve.bench.spec_ceiling's replay (the scheduler's, over a prompt and an answer): what a
verifying worker would emit per step, by hand. The answer's first token is the prompt's step's:
the replay steps through the tokens after it."""

from array import array

from llmserve.bench.spec_ceiling import Replay, replay, total
from scheduler_svc.speculation.potential import lookup as ngram
from scheduler_svc.speculation.potential import oracle


def drafts(*lists):
    """A proposer that drafts the given lists in turn (cut to the room a step has)."""
    it = iter(lists)

    def propose(packed: bytes, done: int, room: int) -> tuple[int, int]:
        draft = next(it)[:room]
        want = array("I", packed)[done : done + len(draft)].tolist()
        ok = 0
        while ok < len(draft) and draft[ok] == want[ok]:
            ok += 1
        return len(draft), ok

    return propose


def test_a_draft_is_kept_up_to_its_first_wrong_token_plus_one():
    r = replay([1, 2], [7, 8, 5, 6, 0, 4], drafts([8, 5, 9], [], [4]))
    # after 7 (the prompt's step): step 1 keeps 8 5, 9 is wrong -> emits 8 5 6; step 2: no
    # draft -> 0; step 3: the draft is cut before the last token (the step's own) -> 4
    assert (r.tokens, r.steps, r.drafted, r.accepted) == (5, 3, 3, 2)


def test_the_oracle_drafts_what_occurs_earlier_and_nothing_else():
    prompt = [1, 2, 3, 4, 5]
    answer = [0, 1, 2, 3, 9, 4, 5]
    r = replay(prompt, answer, oracle(16))
    # after 0: 1 2 3 occur in the prompt, 9 does not -> 1 2 3 kept, 9 emitted (4 tokens);
    # then 4 5 occur, but a draft stops before the answer's last token (the step's own) -> 4
    # kept, 5 emitted
    assert r.steps == 2 and r.accepted == 4 and r.tokens == 6


def test_the_oracle_is_capped_at_k():
    prompt = list(range(20))
    r = replay(prompt, [99, *range(20)], oracle(4))
    assert r.steps == 4  # 5 tokens a step: 4 drafted + 1


def test_prompt_lookup_copies_the_continuation_of_its_match():
    prompt = [10, 11, 12, 13, 14, 15, 16]
    answer = [20, 10, 11, 12, 13, 14, 15, 16]
    r = replay(prompt, answer, ngram(k=3, n_min=1, n_max=2))
    assert r.accepted > 0 and r.steps < r.tokens
    assert r.per_step == r.tokens / r.steps


def test_an_answer_of_one_token_has_no_decode_step():
    r = replay([1, 2], [3], oracle(5))
    assert (r.tokens, r.steps) == (0, 0) and r.per_step == 0.0


def test_speedup_prices_each_drafted_row():
    r = Replay(tokens=10, steps=4, drafted=6, accepted=6)
    assert r.speedup(0.0) == 2.5
    assert abs(r.speedup(0.5) - 10 / 7) < 1e-12
    both = total([r, Replay(2, 2, 0, 0)])
    assert (both.tokens, both.steps, both.drafted, both.accepted) == (12, 6, 6, 6)
