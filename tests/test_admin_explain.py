"""The head's explanation and a live switch on a real stack: the seed's Figure 4 under reserve
(simulated steps), explained while C waits, then policy=paged set live admits C at once."""

from __future__ import annotations

from llmserve.demo_live import figure4_switch
from tests.stacks import tiny_settings


def test_figure4_explained_then_switched_to_paged_admits_c_at_the_next_step(tmp_path) -> None:
    run = figure4_switch(tiny_settings(), tmp_path)
    why = run.explanation
    assert (why["reason"], why["tokens"], why["positions"]) == ("kv_reserved", 6, 12)
    [room] = why["workers"]
    [(_, unwritten)] = room["holders"]  # B, by its gateway id
    assert room["free"] == 4 and unwritten == room["reserved_unwritten"]
    assert room["written"] + unwritten == 20  # B's reservation: 6 + 14
    assert why["admitted_under_other_policy"] and not why["token_budget"]
    assert run.changed == {"policy": ("reserve", "paged")}
    # C admitted at the next step planned after the change: the head never stalled again (the
    # counts at the change are the scheduler's own, read as it applied it; how many steps the
    # status polls saw pass depends on the host)
    assert run.stalls_after == run.stalls_before
    assert run.steps_to_admit >= 1
    assert run.stalls_before.get("kv_reserved", 0) >= 1
    assert run.outputs == [14, 6]
