"""`bench sim --cells`: several simulated schedulers behind the gateway's router."""

from __future__ import annotations

from gateway.routing import RoutePolicy, RouterSettings
from llmserve.bench.cells_sim import CellsSimulation
from llmserve.bench.cost_model import CostModel
from llmserve.bench.multiturn import MultiTurn, multiturn
from llmserve.bench.policy import Policy
from llmserve.bench.simulate import SimSettings
from llmserve.bench.tokens import SIM_VOCAB, TokenSource

COST = CostModel(fixed=0.005, per_token=1e-4, per_sampled=1e-5, per_kv_read=1e-8)
SHAPE = MultiTurn(
    conversations=24, turns=5, system_prompts=2, system_tokens=64, user_tokens=32,
    answer_tokens=16, think_s=0.5, rate=8.0, seed=3,
)  # fmt: skip
SETTINGS = SimSettings(workers=1, kv_capacity=4096, block_size=16, max_context=4096)


def run(policy: RoutePolicy, cells: int = 4):
    workload = multiturn(SHAPE, TokenSource(SIM_VOCAB, seed=1))
    sim = CellsSimulation(
        SETTINGS, Policy("continuous", "paged"), COST, cells, RouterSettings(policy=policy)
    )
    return sim.run(workload), sim.figures()


def test_every_turn_of_every_conversation_completes_through_the_router():
    result, figures = run(RoutePolicy.CACHE_AWARE)
    assert len(result.records) == SHAPE.conversations * SHAPE.turns
    assert all(r.ok and r.completion_tokens == SHAPE.answer_tokens for r in result.records)
    assert sum(figures.reasons.values()) == len(result.records)
    assert len(figures.busy_s) == 4 and figures.imbalance >= 1.0


def test_cache_aware_keeps_more_of_the_histories_cached_than_round_robin():
    _, aware = run(RoutePolicy.CACHE_AWARE)
    _, rotation = run(RoutePolicy.ROUND_ROBIN)
    assert aware.hit_rate > 1.2 * rotation.hit_rate
    assert aware.reasons["match"] > 0 and rotation.reasons["round-robin"] > 0


def test_a_session_keeps_its_conversation_on_one_cell():
    workload = multiturn(SHAPE, TokenSource(SIM_VOCAB, seed=1))
    sim = CellsSimulation(
        SETTINGS, Policy("continuous", "paged"), COST, 4, RouterSettings(RoutePolicy.SESSION)
    )
    placed: dict[int, set[str]] = {}
    route = sim.router.route

    def spy(keys, prompt_tokens=0, output_tokens=0, session="", exclude=frozenset()):
        chosen = route(keys, prompt_tokens, output_tokens, session, exclude)
        placed.setdefault(int(session), set()).add(chosen.cell)
        return chosen

    sim.router.route = spy  # type: ignore[method-assign]
    sim.run(workload)
    assert len(placed) == SHAPE.conversations
    assert all(len(cells) == 1 for cells in placed.values())
    assert len(set().union(*placed.values())) > 1
