"""Speculative decoding on the worker (worker_svc/verify.py): a draft is scored at every
position in one execution and the request keeps the tokens the target model itself samples
there, so its output is the one it has without speculation, token for token, whatever the
draft: greedy, seeded, penalized, with logprobs; and the sampled distribution is the target's."""

from __future__ import annotations

import math
import random

import pytest
import torch

from llmcommon.sampling import SamplingParams
from llmcommon.v1 import common_pb2, worker_pb2
from tests.model_support import model, one_torch_thread  # noqa: F401  (autouse fixture)
from worker_svc import verify
from worker_svc.runner import ModelRunner
from worker_svc.session import Session
from worker_svc.sim import SimRunner, sim_config
from worker_svc.work import WorkItem

BLOCKS, BS = 64, 4
VOCAB = 49152
PROMPT = [5, 17, 923, 4410, 88, 12, 301]


def tiny_session() -> Session:
    config, weights = model("tiny")
    runner = ModelRunner(config, weights, num_blocks=BLOCKS, block_size=BS, dtype=torch.float32)
    return Session(runner, BLOCKS)


def sim_session() -> Session:
    return Session(SimRunner(sim_config(512), BLOCKS, BS, 0.0), BLOCKS)


def first_step(sampling: common_pb2.SamplingParams, blocks: int = 12) -> worker_pb2.Step:
    step = worker_pb2.Step(step=1)
    step.added.add(handle=0, request_id="r0", sampling=sampling)
    step.grants.add(handle=0, blocks=list(range(blocks)))
    step.chunks.add(handle=0, token_ids=PROMPT, start_position=0, sample=True)
    return step


def generate(session: Session, sampling, n: int, propose=None) -> tuple[list[int], list, int]:
    """n tokens of one request; propose(tokens so far) -> a draft (or [] for a plain decode).
    Returns the tokens, their logprobs messages and the steps taken."""
    result, _, _ = session.run(first_step(sampling))
    assert not result.failed and not result.error
    tokens, lps, steps = list(result.tokens), list(result.logprobs), 1
    while len(tokens) < n:
        step = worker_pb2.Step(step=steps + 1)
        draft = (propose(tokens) if propose else [])[: n - len(tokens) - 1]
        if draft:
            step.drafts.add(handle=0, token_ids=draft)
        else:
            step.decodes.append(0)
        result, _, _ = session.run(step)
        assert not result.failed and not result.error, (result.failed, result.error)
        assert len(result.emitted) == (1 if draft else 0)
        if draft:
            assert 1 <= result.emitted[0] <= len(draft) + 1 == len(draft) + 1
            assert result.emitted[0] == len(result.tokens)
        tokens += result.tokens
        lps += result.logprobs
        steps += 1
        item = session.items[0]
        assert item.start_position == len(PROMPT) + len(tokens) - 1  # what it kept, no more
        assert session.own_written == item.start_position
    return tokens[:n], lps[:n], steps


def oracle(reference: list[int], wrong_at: int | None = None, k: int = 4):
    """Drafts of the reference's next k tokens (one made wrong at depth `wrong_at`)."""

    def propose(tokens: list[int]) -> list[int]:
        draft = list(reference[len(tokens) : len(tokens) + k])
        if wrong_at is not None and wrong_at < len(draft):
            draft[wrong_at] = (draft[wrong_at] + 1) % VOCAB
        return draft

    return propose


def noise(seed: int, k: int = 3):
    rng = random.Random(seed)
    return lambda tokens: [rng.randrange(VOCAB) for _ in range(rng.randrange(1, k + 1))]


def echo(tokens: list[int]) -> list[int]:
    """A lookup-like draft: the request's own last tokens again."""
    return tokens[-3:]


GREEDY = common_pb2.SamplingParams(temperature=0.0)
SEEDED = common_pb2.SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
SHAPED = common_pb2.SamplingParams(
    temperature=0.0,
    repetition_penalty=1.3,
    frequency_penalty=0.4,
    presence_penalty=0.2,
    min_tokens=6,
    stop_token_ids=[2],
    logit_bias={7: 2.5},
)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED, SHAPED], ids=["greedy", "seeded", "shaped"])
def test_speculation_leaves_the_output_as_it_is_whatever_the_draft(sampling) -> None:
    n = 16
    plain, _, plain_steps = generate(tiny_session(), sampling, n)
    for propose in (oracle(plain), oracle(plain, wrong_at=2), noise(3), echo):
        spec, _, _ = generate(tiny_session(), sampling, n, propose)
        assert spec == plain
    _, _, fast_steps = generate(tiny_session(), sampling, n, oracle(plain))
    assert fast_steps <= 1 + math.ceil((n - 1) / 5)  # 5 tokens a step from the right draft
    assert plain_steps == n


def test_a_right_draft_is_kept_whole_and_a_wrong_token_ends_it_with_the_models_own() -> None:
    plain, _, _ = generate(tiny_session(), GREEDY, 12)
    s = tiny_session()
    result, _, _ = s.run(first_step(GREEDY))
    assert list(result.tokens) == plain[:1]
    draft = plain[1:4]
    result, _, _ = s.run(
        worker_pb2.Step(step=2, drafts=[worker_pb2.Draft(handle=0, token_ids=draft)])
    )
    assert list(result.emitted) == [4] and list(result.tokens) == plain[1:5]
    wrong = [plain[5], (plain[6] + 1) % VOCAB, plain[7]]
    result, _, _ = s.run(
        worker_pb2.Step(step=3, drafts=[worker_pb2.Draft(handle=0, token_ids=wrong)])
    )
    assert list(result.emitted) == [2] and list(result.tokens) == plain[5:7]
    result, _, _ = s.run(worker_pb2.Step(step=4, decodes=[0]))  # over the rejected positions
    assert list(result.tokens) == plain[7:8]


def test_logprobs_of_each_kept_token_are_those_without_speculation() -> None:
    sampling = common_pb2.SamplingParams(temperature=0.0, logprobs=3)
    plain, plain_lps, _ = generate(tiny_session(), sampling, 10)
    spec, spec_lps, _ = generate(tiny_session(), sampling, 10, oracle(plain, wrong_at=3))
    assert spec == plain and len(spec_lps) == len(plain_lps) == 10
    for a, b in zip(spec_lps, plain_lps, strict=True):
        assert list(a.top_ids) == list(b.top_ids)
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_a_stop_token_ends_the_draft_where_it_is_sampled() -> None:
    plain, _, _ = generate(tiny_session(), GREEDY, 8)
    stop = plain[3]
    sampling = common_pb2.SamplingParams(temperature=0.0, stop_token_ids=[stop])
    s = tiny_session()
    s.run(first_step(sampling))
    draft = worker_pb2.Draft(handle=0, token_ids=plain[1:7])
    result, _, _ = s.run(worker_pb2.Step(step=2, drafts=[draft]))
    assert list(result.tokens) == plain[1 : plain.index(stop, 1) + 1]


def test_a_step_mixes_a_prompt_a_decode_and_drafts_each_in_its_place() -> None:
    ref, _, _ = generate(tiny_session(), GREEDY, 6)
    s = tiny_session()
    first = first_step(GREEDY)
    for handle, blocks in ((1, range(12, 24)), (2, range(24, 36))):
        first.added.add(handle=handle, request_id=f"r{handle}", sampling=GREEDY)
        first.grants.add(handle=handle, blocks=list(blocks))
        first.chunks.add(handle=handle, token_ids=PROMPT, start_position=0, sample=True)
    assert list(s.run(first)[0].tokens) == [ref[0]] * 3
    second = worker_pb2.Step(step=2, decodes=[1])
    second.drafts.add(handle=0, token_ids=ref[1:4])  # all right: 4 tokens
    second.drafts.add(handle=2, token_ids=[(ref[1] + 1) % VOCAB])  # wrong: 1 token
    second.added.add(handle=3, request_id="r3", sampling=GREEDY)
    second.grants.add(handle=3, blocks=list(range(36, 48)))
    second.chunks.add(handle=3, token_ids=PROMPT, start_position=0, sample=True)
    result, shape, _ = s.run(second)
    assert not result.failed and list(result.emitted) == [4, 1]
    # the chunk's token, the decode's, then each draft's, draft by draft
    assert list(result.tokens) == [ref[0], ref[1], *ref[1:5], ref[1]]
    assert shape.tokens == len(PROMPT) + 1 + 4 + 2


def test_a_bad_draft_fails_its_request_alone() -> None:
    s = tiny_session()
    first = first_step(GREEDY)
    for handle in (1, 2, 3):
        first.added.add(handle=handle, request_id=f"r{handle}", sampling=GREEDY)
        first.grants.add(handle=handle, blocks=[12 + 3 * handle + b for b in range(3)])  # 12
        first.chunks.add(handle=handle, token_ids=PROMPT, start_position=0, sample=True)
    s.run(first)
    step = worker_pb2.Step(step=2, decodes=[3])
    step.drafts.add(handle=0, token_ids=[VOCAB])  # outside the vocabulary
    step.drafts.add(handle=1, token_ids=[1, 2, 3, 4, 5])  # positions 7..12: beyond its 12
    step.drafts.add(handle=3, token_ids=[1])  # it decodes in this step already
    step.drafts.add(handle=2, token_ids=[1])
    result, _, _ = s.run(step)
    assert not result.error and set(result.failed) == {0, 1, 3}
    assert "vocabulary" in result.failed[0] and "position 12" in result.failed[1]
    assert list(result.emitted) == [1] and len(result.tokens) == 1  # only request 2 ran
    repeated = worker_pb2.Step(step=3, repeat=2, drafts=[worker_pb2.Draft(handle=2, token_ids=[1])])
    assert "drafts" in s.run(repeated)[0].error


def test_the_simulated_worker_verifies_as_a_real_one() -> None:
    plain, _, _ = generate(sim_session(), GREEDY, 14)
    spec, _, steps = generate(sim_session(), GREEDY, 14, oracle(plain))
    assert spec == plain and steps == 1 + math.ceil(13 / 5)
    assert generate(sim_session(), GREEDY, 14, noise(5))[0] == plain


# ---- the sampled distribution is the target's -------------------------------------------------


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True))


def item_with_draft(draft: list[int], **kw) -> WorkItem:
    item = WorkItem("r", [0, *draft], 10, list(range(8)), sampling=SamplingParams(**kw))
    item.drafted = len(draft)
    return item


@pytest.mark.parametrize("seeded", [False, True], ids=["worker-rng", "seeded"])
def test_kept_and_corrected_tokens_follow_the_targets_distribution(seeded: bool) -> None:
    """Four tokens with probabilities .4 .3 .2 .1 at depth 0 and .1 .2 .3 .4 at depth 1. The
    draft proposes token 0 then token 3. Over 4000 draws: token 0 is kept at the rate p(0) and
    depth 0's token has the target's distribution; at depth 1 (reached only after token 0) its
    own. A fixed generator and fixed seeds: the test cannot flake (the 99.9% bound, 3 dof)."""
    p0, p1 = [0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]
    vocab = 8
    logits = torch.full((3, vocab), -math.inf)
    logits[0, :4] = torch.tensor(p0).log()
    logits[1, :4] = torch.tensor(p1).log()
    logits[2, :4] = 0.0  # after both draft tokens: uniform
    rng = torch.Generator().manual_seed(11)
    first, second = [0] * 4, [0] * 4
    draws = 4000
    for n in range(draws):
        item = item_with_draft([0, 3], temperature=1.0, seed=n if seeded else None)
        tokens = [t for t, _ in verify.emit(logits, [item], [0], rng)[0]]
        first[tokens[0]] += 1
        if tokens[0] == 0:
            assert len(tokens) == (3 if tokens[1] == 3 else 2)
            second[tokens[1]] += 1
        else:
            assert len(tokens) == 1
    assert chi_square(first, p0) < 16.27
    assert chi_square(second, p1) < 16.27
    assert first[0] / draws == pytest.approx(0.4, abs=0.03)


def test_greedy_rows_keep_the_longest_prefix_of_the_argmax_plus_one() -> None:
    logits = torch.zeros(4, 6)
    for row, best in enumerate([3, 1, 4, 5]):
        logits[row, best] = 1.0
    right, wrong = item_with_draft([3, 1, 4], temperature=0.0), item_with_draft([3, 2, 4])
    wrong.sampling = SamplingParams(temperature=0.0)
    for emitted in (verify.emit(logits, [right], [0], torch.Generator()),
                    verify.greedy_emit(logits.argmax(-1).tolist(), [right], [0])):  # fmt: skip
        assert [t for t, _ in emitted[0]] == [3, 1, 4, 5]
    assert [t for t, _ in verify.greedy_emit(logits.argmax(-1).tolist(), [wrong], [0])[0]] == [3, 1]


# ---- structured output: a draft token the grammar forbids is rejected -------------------------


@pytest.fixture(scope="module")
def grammars():
    from worker_svc.grammar import GrammarCache, TokenTable, model_tokenizer

    cache = GrammarCache(TokenTable(lambda: model_tokenizer("tiny", VOCAB, (2,))))
    cache.table.get()
    return cache


def test_under_a_grammar_speculation_keeps_the_constrained_output(grammars) -> None:
    from worker_svc.grammar import spec_of

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for seed in (None, 9):
        sampling = common_pb2.SamplingParams(
            temperature=0.0 if seed is None else 1.0,
            seed=seed,
            grammar=spec_of("json_schema", schema),
            stop_token_ids=[2],
        )

        def session() -> Session:
            s = tiny_session()
            s.grammars = grammars
            return s

        plain, _, _ = generate(session(), sampling, 10)
        for propose in (oracle(plain), oracle(plain, wrong_at=1), noise(7)):
            assert generate(session(), sampling, 10, propose)[0] == plain
        s = session()
        s.run(first_step(sampling))
        forbidden = worker_pb2.Draft(handle=0, token_ids=[2, *plain[2:4]])  # EOS inside `{`
        result, _, _ = s.run(worker_pb2.Step(step=2, drafts=[forbidden]))
        assert list(result.emitted) == [1] and list(result.tokens) == plain[1:2]
