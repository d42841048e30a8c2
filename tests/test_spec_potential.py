"""The scheduler's replay of finished requests (scheduler_svc/speculation/potential.py), which
llmserve.bench.spec_ceiling runs too: the same steps as a plain-list reference
(tests/spec_reference.py), bounded in size and in time."""

import random
from array import array

from scheduler_svc.speculation import potential
from scheduler_svc.speculation.potential import Potential, lookup, oracle, replay
from tests import spec_reference


def _packed(tokens):
    return array("I", tokens).tobytes()


def _cases(seed, n=60):
    rng = random.Random(seed)
    for _ in range(n):
        vocab = rng.choice([3, 5, 12, 50])
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
        # an output that copies stretches of its prompt, with changes: what lookup is for
        out = []
        while len(out) < rng.randrange(1, 80):
            if prompt and rng.random() < 0.6:
                at = rng.randrange(len(prompt))
                out += prompt[at : at + rng.randrange(1, 12)]
            else:
                out.append(rng.randrange(vocab))
        yield prompt, out


def test_the_lookup_replay_takes_the_steps_the_list_replay_takes():
    for prompt, out in _cases(1):
        for k, lo, hi in ((5, 5, 5), (10, 2, 5), (3, 1, 1)):
            mine = replay(_packed(prompt + out), len(prompt) + 1, lookup(k, lo, hi))[:4]
            bench = spec_reference.replay(prompt, out, spec_reference.ngram(k, lo, hi))
            assert mine == (bench.tokens, bench.steps, bench.drafted, bench.accepted)


def test_the_oracle_replay_takes_the_steps_the_list_oracle_takes():
    for prompt, out in _cases(2):
        for k in (1, 5, 16):
            mine = replay(_packed(prompt + out), len(prompt) + 1, oracle(k))[:4]
            bench = spec_reference.replay(prompt, out, spec_reference.oracle(k))
            assert mine == (bench.tokens, bench.steps, bench.drafted, bench.accepted)


def _periodic_cases(seed, n=60):
    """Outputs that repeat a short period (a list, a table row): prompt lookup drafts a period
    on past the end of what it has seen."""
    rng = random.Random(seed)
    for _ in range(n):
        vocab = rng.choice([3, 7, 50])
        period = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 20))] + period
        out = []
        while len(out) < rng.randrange(20, 120):
            out += period if rng.random() < 0.85 else [rng.randrange(vocab)]
        yield prompt, out


def test_the_oracle_bounds_prompt_lookup_at_every_setting():
    """Docs: no proposer that copies earlier text drafts more than the oracle. Prompt lookup
    copies a period on into the stretch it drafts: at K=16 with lookup 1..8 it had taken fewer
    steps than the oracle, whose occurrences had to end before the stretch (the speculation
    sweep: 15.6 tokens a step against the oracle's 13.7)."""
    settings = ((16, 1, 8), (16, 5, 5), (5, 5, 5), (10, 2, 5), (5, 1, 8), (3, 1, 1))
    for prompt, out in [*_cases(3), *_periodic_cases(4)]:
        packed, start = _packed(prompt + out), len(prompt) + 1
        for k, lo, hi in settings:
            ngram_steps = replay(packed, start, lookup(k, lo, hi))[1]
            assert replay(packed, start, oracle(k))[1] <= ngram_steps, (prompt, out, k, lo, hi)


def test_a_period_copied_on_into_the_stretch_counts_for_the_oracle():
    prompt, out = [9, 1, 2], [1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1]  # one period in the prompt
    tokens, steps, drafted, accepted = replay(_packed(prompt + out), 4, oracle(16))[:4]
    assert (tokens, steps, drafted, accepted) == (10, 1, 9, 9)  # all of it in one step


def test_an_output_that_copies_its_prompt_takes_few_steps_and_a_fresh_one_takes_one_a_token():
    prompt = list(range(100, 140))
    copy = replay(_packed(prompt + prompt), len(prompt), oracle(5))[:4]
    assert copy == (40, 7, 33, 33)  # 6 tokens a step (5 drafted, 1 its own), the last step 4
    fresh = replay(_packed(prompt + list(range(200, 240))), len(prompt), oracle(5))[:4]
    assert fresh == (40, 40, 0, 0)
    lookup_fresh = replay(_packed(prompt + list(range(200, 240))), len(prompt), lookup(5, 2, 5))[:4]
    assert lookup_fresh == (40, 40, 0, 0)


def test_each_step_is_priced_at_its_position_and_draft_and_the_plain_decodes_at_theirs():
    seen = []

    def price(position, drafted):  # linear in the position, as the step-time model is
        seen.append((position, drafted))
        return 1.0 + 0.25 * drafted + 0.001 * position

    prompt = list(range(100, 140))
    out = [7, *prompt]  # the first token is the prompt step's; then a copy of the prompt
    tokens, steps, drafted, accepted, seconds, plain = replay(
        _packed(prompt + out), len(prompt) + 1, oracle(5), price, offset=1000
    )
    assert (tokens, steps, drafted, accepted) == (40, 7, 33, 33)
    # the first decode feeds token 7 at position 1000 + 40; each step then 6 positions on
    assert [p for p, _ in seen[:7]] == [1040 + 6 * i for i in range(7)]
    assert seconds == sum(price(p, d) for p, d in seen[:7])
    each = sum(1.0 + 0.001 * (1040 + i) for i in range(40))  # a decode for each token
    assert abs(plain - each) < 1e-9
    assert plain / seconds > 3  # 40 decodes against 7 steps of up to 6 rows


def test_replays_take_at_most_their_share_of_the_time():
    now = [0.0]

    def clock():
        return now[0]

    p = Potential(clock)
    prompt, out = list(range(50)), list(range(50))
    spend = potential.replay

    def slow(*args):  # each replay "takes" 10 ms of the fake clock
        now[0] += 0.005
        return spend(*args)

    potential.replay, saved = slow, potential.replay
    try:
        p.observe(prompt, out, 5, 2, 5)
        assert p.replayed["ngram"].requests == 1 and p.replayed["oracle"].requests == 1
        now[0] += 0.5  # within 10 ms / SHARE = 1 s of the replay's start
        p.observe(prompt, out, 5, 2, 5)
        assert p.skipped == 1 and p.replayed["ngram"].requests == 1
        now[0] += 0.6
        p.observe(prompt, out, 5, 2, 5)
        assert p.replayed["ngram"].requests == 2 and p.skipped == 1
    finally:
        potential.replay = saved


def test_a_long_output_replays_its_last_tokens_over_a_bounded_context():
    p = Potential(lambda: 0.0)
    n = potential.OUTPUT_TOKENS
    p.observe(list(range(20_000)), list(range(3 * n)), 5, 5, 5)
    assert p.replayed["oracle"].requests == 1
    assert p.replayed["oracle"].tokens == n
    # the replayed tail is tokens 2n..3n, which occur in the kept context: all but the steps'
    # own tokens come from drafts
    oracle_ = p.replayed["oracle"]
    assert oracle_.accepted_tokens == n - oracle_.steps
    assert p.replayed["ngram"].tokens == n


def test_an_output_of_one_token_has_no_decode_to_replay():
    p = Potential(lambda: 0.0)
    p.observe([1, 2, 3], [], 5, 5, 5)
    p.observe([1, 2, 3], [1], 5, 5, 5)
    assert p.replayed["ngram"].requests == 0 and p.skipped == 0
    p.observe([1, 2, 3], [1, 2], 5, 5, 5)  # its second token is a decode's
    assert p.replayed["ngram"].requests == 1 and p.replayed["ngram"].tokens == 1


# --- in the scheduler: every finished request replayed, speculating or not ---

from scheduler_svc.config import CoreConfig, DraftLength, Speculative, WorkerSpec  # noqa: E402
from scheduler_svc.core import Scheduler  # noqa: E402
from scheduler_svc.sequence import Sequence  # noqa: E402
from scheduler_svc.step_cost import CostModel  # noqa: E402
from tests import spec_sim  # noqa: E402

FLAT = CostModel(fixed=0.05, per_token=0.0005)


def _core(**cfg) -> Scheduler:
    cfg.setdefault("token_budget", 64)
    spec = WorkerSpec("w0", 128, 4, 4096)
    return Scheduler(CoreConfig(**cfg), [spec], predict=lambda worker, shape: FLAT.predict(shape))


def test_the_scheduler_replays_each_finished_request_with_speculation_off():
    core = _core(prompt_lookup_min=2, prompt_lookup_max=3)
    core.potential.clock = lambda: 0.0  # no quiet time: every finish replayed
    seqs = [Sequence("a", [3, 5, 8, 4], 40), Sequence("b", [1, 5, 8, 4], 30)]
    for s in seqs:
        core.add(s)
    spec_sim.drive(core, spec_sim.mixed)  # a repeats itself, b counts up (never repeats)
    oracle_, lookup_ = core.potential.replayed["oracle"], core.potential.replayed["ngram"]
    assert oracle_.requests == lookup_.requests == 2
    assert oracle_.tokens == lookup_.tokens == 39 + 29  # each output but its first token
    assert core.spec_drafts == 0  # nothing drafted: the replay only says what drafts would do
    counting = replay(_packed([1, 5, 8, 4, *seqs[1].output_ids]), 5, oracle(5))[:4]
    assert counting == (29, 29, 0, 0)  # b's share: one token a step
    assert oracle_.steps < oracle_.tokens and lookup_.accepted_tokens > 0
    # priced by the worker's model (FLAT: a step is mostly its fixed cost): faster with drafts
    assert oracle_.plain_seconds > oracle_.step_seconds > 0


def test_the_replay_takes_the_drafts_a_fixed_length_speculating_scheduler_takes():
    cfg = {"speculative": Speculative.NGRAM, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    core = _core(speculative_length=DraftLength.FIXED, num_speculative_tokens=4, **cfg)
    core.potential.clock = lambda: 0.0
    seq = Sequence("a", [3, 5, 8, 4], 40)
    core.add(seq)
    spec_sim.drive(core)
    lookup_ = core.potential.replayed["ngram"]
    assert lookup_.requests == 1 and lookup_.tokens == 39
    assert (lookup_.draft_tokens, lookup_.accepted_tokens) == (
        core.spec_draft_tokens,
        core.spec_accepted_tokens,
    )
    assert lookup_.accepted_tokens > 0


def test_a_cancelled_request_is_not_replayed_and_the_setting_turns_replays_off():
    core = _core()
    core.potential.clock = lambda: 0.0
    core.add(Sequence("a", [3, 5, 8, 4], 40))
    spec_sim.step(core)
    spec_sim.step(core)
    core.abort("a")
    assert core.potential.replayed["ngram"].requests == 0
    off = _core(speculation_potential=False)
    off.potential.clock = lambda: 0.0
    off.add(Sequence("a", [3, 5, 8, 4], 20))
    spec_sim.drive(off)
    assert off.potential.replayed["ngram"].requests == 0
