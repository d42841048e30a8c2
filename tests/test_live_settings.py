"""Live settings: key=value texts read into a new core config, all or nothing."""

from __future__ import annotations

import pytest

from scheduler_svc.config import BatchMode, CoreConfig, KvPolicy
from scheduler_svc.live_settings import (
    NAMES,
    SettingError,
    apply,
    changed,
    changes_of,
    current,
    parse_pairs,
)


def test_every_core_setting_is_live() -> None:
    for name in ("policy", "mode", "token_budget", "max_running", "chunked_prefill"):
        assert name in NAMES
    assert "prefix_caching" in NAMES and "step_time_budget_ms" in NAMES
    assert apply(CoreConfig(), {"step-time-budget-ms": "12.5"}).step_time_budget_ms == 12.5


def test_a_change_gives_a_new_config_with_typed_values() -> None:
    old = CoreConfig(policy=KvPolicy.RESERVE)
    new = apply(
        old,
        parse_pairs(["policy=paged", "token-budget=64", "chunked_prefill=off", "mode=static"]),
    )
    assert new.policy is KvPolicy.PAGED and new.mode is BatchMode.STATIC
    assert (new.token_budget, new.chunked_prefill) == (64, False)
    assert old.policy is KvPolicy.RESERVE  # the old one stands
    assert changed(old, new) == {
        "token_budget": ("256", "64"),
        "policy": ("reserve", "paged"),
        "mode": ("continuous", "static"),
        "chunked_prefill": ("true", "false"),
    }


@pytest.mark.parametrize(
    ("pairs", "field"),
    [
        (["token_budget=0"], "token_budget"),
        (["token_budget=lots"], "token_budget"),
        (["max_running=-1"], "max_running"),
        (["step_time_budget_ms=-3"], "step_time_budget_ms"),
        (["step_time_budget_ms=nan"], "step_time_budget_ms"),  # it crashed the step loop
        (["step_time_budget_ms=inf"], "step_time_budget_ms"),
        (["token_budget=4294967296"], "token_budget"),  # uint32 in status: it broke status
        (["max_running=99999999999999999999999"], "max_running"),
        (["policy=greedy"], "policy"),
        (["prefix_caching=maybe"], "prefix_caching"),
        (["colour=blue"], "colour"),
        (["policy=paged", "mode=sometimes"], "mode"),
        (["prompt_lookup_max=9"], "prompt_lookup_max"),  # 400 stalled the step loop 3 s
    ],
)
def test_a_bad_value_names_its_field(pairs: list[str], field: str) -> None:
    with pytest.raises(SettingError) as err:
        apply(CoreConfig(), parse_pairs(pairs))
    assert err.value.name == field and field in str(err.value)


@pytest.mark.parametrize(("low", "high"), [("1", "3"), ("7", "8")])
def test_fields_a_rule_binds_together_are_checked_together(low, high) -> None:
    """Both n-gram lengths moved past the other's old value (defaults 5 and 5): valid together,
    as at start, in either order. (Each was checked against the other's old value and
    refused.) The rule across them still holds."""
    for pairs in (
        {"prompt_lookup_min": low, "prompt_lookup_max": high},
        {"prompt_lookup_max": high, "prompt_lookup_min": low},
    ):
        new = apply(CoreConfig(), pairs)
        assert (new.prompt_lookup_min, new.prompt_lookup_max) == (int(low), int(high))
    with pytest.raises(SettingError, match="need 1 <= min <= max"):
        apply(CoreConfig(), {"prompt_lookup_min": high, "prompt_lookup_max": low})


def test_fields_refused_together_are_named_with_the_values_asked() -> None:
    """min 3 and max 2 from 5 and 5: the pair is refused with the values asked, naming both
    (it had named max alone, with the old min: "prompt_lookup_min 5 and prompt_lookup_max 2")."""
    with pytest.raises(SettingError) as err:
        apply(CoreConfig(), {"prompt_lookup_min": "3", "prompt_lookup_max": "2"})
    assert err.value.name == "prompt_lookup_min, prompt_lookup_max"
    assert "prompt_lookup_min 3 and prompt_lookup_max 2: need 1 <= min <= max" in str(err.value)
    with pytest.raises(SettingError) as alone:  # a field at fault on its own is named alone
        apply(CoreConfig(), {"prompt_lookup_min": "3", "token_budget": "-1"})
    assert alone.value.name == "token_budget"


def test_a_pair_without_equals_is_refused() -> None:
    with pytest.raises(SettingError, match="key=value"):
        parse_pairs(["policy"])


@pytest.mark.parametrize(
    "pairs",
    [["token_budget=8", "token_budget=16"], ["token_budget=8", "token-budget=8"]],
    ids=["two values", "one name spelt two ways"],
)
def test_a_setting_given_twice_is_refused_naming_it(pairs) -> None:
    """All or nothing: which of two values was meant is not the server's to guess (the last
    had won)."""
    with pytest.raises(SettingError, match="token.budget: given twice"):
        parse_pairs(pairs)
    with pytest.raises(SettingError, match="given twice"):
        changes_of(pair.split("=") for pair in pairs)
    mapping = dict(pair.split("=") for pair in pairs)
    if len(mapping) == 2:  # both spellings: a library caller's mapping can hold them
        with pytest.raises(SettingError, match="given twice"):
            apply(CoreConfig(), mapping)


def test_current_lists_every_setting_as_set_takes_it_back() -> None:
    config = CoreConfig(token_budget=8, policy=KvPolicy.RESERVE, chunked_prefill=False)
    values = current(config)
    assert list(values) == list(NAMES)
    assert apply(CoreConfig(), values) == config
