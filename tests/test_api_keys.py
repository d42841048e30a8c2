"""The API keys file (gateway/api_keys.py), a request's tenancy from its key
(gateway/request_tenancy.py) and the queue limits per tenant (gateway/queue_limits.py), pure:
what each line gives, every bad line refused naming its file and line, keys found only by their
digest, and one tenant's burst refused while another's request still fits."""

from __future__ import annotations

import hashlib

import pytest

from gateway.api_keys import (
    ApiKeys,
    KeyEntry,
    KeysFileError,
    digest_of,
    load_api_keys,
    parse_api_keys,
)
from gateway.auth import cache_salt, tenant_of
from gateway.key_table import KeyTable
from gateway.queue_limits import QueueClaim, QueueLimits
from gateway.request_tenancy import tenancy_for
from gateway.settings import GatewaySettings
from gateway.validation import InvalidRequest
from llmcommon.tenancy import Tenancy, parse_slo_classes

CLASSES = parse_slo_classes("interactive=ttft:1,tpot:0.1 batch=ttft:60")


def parsed(text: str) -> ApiKeys:
    return parse_api_keys(text, "keys.txt", CLASSES)


def refusal(text: str) -> str:
    with pytest.raises(KeysFileError) as err:
        parsed(text)
    return str(err.value)


def test_each_line_gives_its_tenant_weight_priorities_class_and_limits() -> None:
    keys = parsed(
        "# teams\n"
        "\n"
        "key-a team-a weight=2.5 top_priority=-5 priority=-1 slo_class=interactive "
        "max_queued=4 max_queued_tokens=9000  # the chat team\n"
        "key-b team-b\n"
    )
    a, b = keys.entry("key-a"), keys.entry("key-b")
    assert a is not None and b is not None
    assert (a.tenant, a.weight, a.top_priority, a.priority, a.slo_class) == (
        "team-a",
        2.5,
        -5,
        -1,
        "interactive",
    )
    assert (a.max_queued, a.max_queued_tokens) == (4, 9000)
    assert (b.tenant, b.weight, b.top_priority, b.priority, b.slo_class) == ("team-b", 1, 0, 0, "")
    assert (b.max_queued, b.max_queued_tokens) == (0, 0)
    assert set(keys.tenants) == {"team-a", "team-b"}


def test_a_key_written_as_its_digest_is_found_by_the_key_and_only_digests_are_kept() -> None:
    digest = hashlib.sha256(b"s3cret-key").hexdigest()
    keys = parsed(f"sha256:{digest.upper()} team-a\nplain-key team-b\n")
    assert keys.entry("s3cret-key").tenant == "team-a"  # type: ignore[union-attr]
    assert keys.entry("plain-key").tenant == "team-b"  # type: ignore[union-attr]
    assert keys.entry(f"sha256:{digest}") is None  # the digest is not itself a key
    assert keys.entry("s3cret-kez") is None and keys.entry("") is None
    assert set(keys.entries) == {bytes.fromhex(digest), digest_of("plain-key")}


def test_keys_of_one_tenant_share_its_weight_and_limits_and_its_cache_share() -> None:
    keys = parsed("key-a team-a weight=3 max_queued=2\nkey-a2 team-a slo_class=batch\n")
    a, a2 = keys.entry("key-a"), keys.entry("key-a2")
    assert a is not None and a2 is not None
    assert (a2.weight, a2.max_queued, a2.slo_class) == (3.0, 2, "batch")
    assert a.cache_tenant == a2.cache_tenant != parsed("k team-b\n").entry("k").cache_tenant  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("key-a\n", 1, "expected `KEY TENANT"),
        ("key-a team-a\nkey-a team-b\n", 2, "given on an earlier line"),
        (f"key-a t\nsha256:{hashlib.sha256(b'key-a').hexdigest()} u\n", 2, "earlier line"),
        ("key-a team-a weight=2\nkey-b team-a weight=1\n", 2, "weight=2.0 on line 1"),
        ("key-a team-a max_queued=2\nkey-b team-a max_queued=3\n", 2, "max_queued=2 on line 1"),
        ("key-a team-a weight=0\n", 1, "weight=0: a number > 0"),
        ("key-a team-a weight=nan\n", 1, "a number > 0"),
        ("key-a team-a priority=high\n", 1, "priority=high: an integer"),
        ("key-a team-a priority=-1\n", 1, "below top_priority=0"),
        ("key-a team-a top_priority=-9 priority=-10\n", 1, "below top_priority=-9"),
        ("key-a team-a priority=9999999999\n", 1, "from -2147483648 to 2147483647"),
        ("key-a team-a max_queued=-1\n", 1, "0 (no limit of its own) or more"),
        ("key-a team-a slo_class=gold\n", 1, "slo_class=gold is not an --slo-classes class"),
        ("key-a team-a colour=red\n", 1, "'colour=red' is not one of"),
        ("key-a team-a weight=2 weight=3\n", 1, "weight= is given twice"),
        ("key-a team/a\n", 1, "tenant 'team/a'"),
        ("sha256:abc team-a\n", 1, "64 hex digits"),
        ("k\u00e9y team-a\n", 1, "printable ASCII"),
        ("# only comments\n\n", 0, "holds no key"),
    ],
)
def test_a_bad_line_is_refused_naming_the_file_and_line(text, line, words) -> None:
    message = refusal(text)
    where = f"keys.txt line {line}: " if line else "keys.txt holds no key"
    assert message.startswith(where) and words in message, message


def test_without_classes_a_key_may_name_none() -> None:
    with pytest.raises(KeysFileError) as err:
        parse_api_keys("key-a team-a slo_class=batch\n", "k", {})
    assert str(err.value) == (
        "k line 1: slo_class=batch is not an --slo-classes class (none: --slo-classes is empty)"
    )


# ---- the one key, and none ------------------------------------------------------------------


def test_the_one_key_file_is_the_default_tenant_with_the_cache_share_it_always_had(
    tmp_path,
) -> None:
    (tmp_path / "key").write_text("only-key\n")
    table = KeyTable(GatewaySettings(api_key_file=str(tmp_path / "key")))
    entry = table().entry("only-key")
    assert entry == KeyEntry(cache_tenant=tenant_of("only-key"))
    assert cache_salt(entry.cache_tenant, "") == cache_salt(tenant_of("only-key"), "")
    assert table().entry("other") is None


def test_without_a_key_every_request_is_the_default_tenants(monkeypatch) -> None:
    monkeypatch.delenv("LLMSERVE_API_KEY", raising=False)
    keys = KeyTable(GatewaySettings())()
    assert not keys.required
    assert keys.entry("anything") == keys.entry("") == KeyEntry()


def test_a_bad_file_at_start_stops_the_gateway_and_on_reload_keeps_the_keys_in_force(
    tmp_path,
) -> None:
    path = tmp_path / "keys.txt"
    path.write_text("key-a team-a\nkey-b\n")
    settings = GatewaySettings(api_keys_file=str(path))
    with pytest.raises(SystemExit, match=f"{path} line 2"):
        KeyTable(settings)
    path.write_text("key-a team-a\n")
    table = KeyTable(settings)
    path.write_text("key-a team-a weight=0\n")
    with pytest.raises(KeysFileError, match="line 1"):
        table.reload()
    assert table().entry("key-a").weight == 1.0  # type: ignore[union-attr]
    path.write_text("key-a team-a weight=4\nkey-b team-b\n")
    table.reload()
    assert table().entry("key-a").weight == 4.0  # type: ignore[union-attr]
    assert table().entry("key-b").tenant == "team-b"  # type: ignore[union-attr]


def test_both_key_flags_together_are_refused() -> None:
    with pytest.raises(ValueError, match="do not go together"):
        GatewaySettings(api_key_file="a", api_keys_file="b")


def test_a_bad_class_list_is_refused_by_the_settings() -> None:
    with pytest.raises(ValueError, match="tpot must be a number > 0"):
        GatewaySettings(slo_classes="fast=tpot:0")


# ---- a request's tenancy --------------------------------------------------------------------

KEY = KeyEntry("team-a", 2.0, top_priority=-5, priority=1, slo_class="interactive")


def test_unset_priority_and_class_are_the_keys_defaults() -> None:
    assert tenancy_for(KEY, None, "", CLASSES) == Tenancy("team-a", 2.0, 1, "interactive", 1, 0.1)
    assert tenancy_for(KeyEntry(), None, "", CLASSES) == Tenancy()


def test_a_priority_and_class_the_key_allows_are_taken_with_the_class_targets() -> None:
    assert tenancy_for(KEY, -5, "batch", CLASSES) == Tenancy("team-a", 2.0, -5, "batch", 60, 0)
    assert tenancy_for(KEY, 2**31 - 1, "", CLASSES).priority == 2**31 - 1


@pytest.mark.parametrize(
    ("priority", "slo_class", "param", "words"),
    [
        (-6, "", "priority", "its highest is -5"),
        ("1", "", "priority", "must be an integer"),
        (1.0, "", "priority", "must be an integer"),
        (True, "", "priority", "must be an integer"),
        (2**31, "", "priority", "must be from"),
        (None, "gold", "slo_class", "not a class of this gateway: interactive, batch"),
    ],
)
def test_what_the_key_may_not_ask_for_is_refused_naming_the_field(
    priority, slo_class, param, words
) -> None:
    with pytest.raises(InvalidRequest) as err:
        tenancy_for(KEY, priority, slo_class, CLASSES)
    assert err.value.param == param and words in str(err.value)


# ---- queue limits per tenant ----------------------------------------------------------------


def test_one_tenants_burst_is_refused_by_its_own_limit_while_another_tenant_fits() -> None:
    queue = QueueLimits(max_requests=10, max_tokens=1000)
    for _ in range(2):
        assert queue.refusal(10, "a", max_requests=2) is None
        queue.enter(10, "a")
    refused = queue.refusal(10, "a", max_requests=2)
    assert refused is not None and (refused.tenant, refused.limit) == ("a", "max_queued")
    assert "tenant a" in refused.message and "max_queued=2" in refused.message
    assert queue.refusal(10, "b", max_requests=2) is None
    queue.leave(10, "a")
    assert queue.refusal(10, "a", max_requests=2) is None


def test_a_tenants_token_limit_counts_its_own_waiting_prompt_tokens() -> None:
    queue = QueueLimits(max_requests=10, max_tokens=1000)
    queue.enter(60, "a")
    assert queue.refusal(40, "a", max_tokens=100) is None
    refused = queue.refusal(41, "a", max_tokens=100)
    assert refused is not None and refused.limit == "max_queued_tokens"
    assert "max_queued_tokens=100" in refused.message
    assert queue.refusal(41, "b", max_tokens=100) is None


def test_the_total_limit_refuses_every_tenant_and_names_no_tenant_limit() -> None:
    queue = QueueLimits(max_requests=1, max_tokens=1000)
    queue.enter(1, "a")
    refused = queue.refusal(1, "b")
    assert refused is not None and refused.limit == "" and "limit 1" in refused.message


def test_a_request_over_its_tenants_limit_alone_is_told_so_when_the_gateway_is_full() -> None:
    # no wait can let it in: 400 (never), not "queue full" (429, which clients retry)
    queue = QueueLimits(max_requests=2, max_tokens=1000)
    queue.enter(1, "b")
    queue.enter(1, "b")  # the gateway's total is full
    refused = queue.refusal(50, "a", max_tokens=40)
    assert refused is not None and refused.never and refused.limit == "max_queued_tokens"
    refused = queue.refusal(1, "a", max_requests=2, n=3)
    assert refused is not None and refused.never and refused.param == "n"


def test_a_key_file_that_cannot_be_read_is_refused_naming_it(tmp_path) -> None:
    missing = tmp_path / "absent.txt"
    with pytest.raises(KeysFileError, match=f"cannot read the API keys file {missing}"):
        load_api_keys(str(missing), CLASSES)
    (tmp_path / "k").write_text("key-a team-a slo_class=batch # a comment # and more\n")
    assert load_api_keys(str(tmp_path / "k"), CLASSES).entry("key-a").slo_class == "batch"  # type: ignore[union-attr]


def test_every_printable_ascii_byte_but_space_and_hash_may_be_in_a_key() -> None:
    key = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "#")
    assert parsed(f"{key} team-a\n").entry(key) is not None
    for outside in ("\x7f", "\x80", "\x01"):  # DEL, beyond ASCII, a control character
        assert "printable ASCII" in refusal(f"k{outside} team-a\n")


def test_the_edges_of_each_number_are_taken() -> None:
    low, high = -(2**31), 2**31 - 1
    keys = parsed(
        f"key-a team-a top_priority={low} priority={high} max_queued=0 max_queued_tokens=0\n"
    )
    entry = keys.entry("key-a")
    assert entry is not None
    assert (entry.top_priority, entry.priority, entry.max_queued) == (low, high, 0)
    assert "from -2147483648" in refusal(f"k t top_priority={low - 1}\n")
    assert "from -2147483648" in refusal(f"k t priority={high + 1}\n")
    assert "weight=1=2: a number > 0" in refusal("k t weight=1=2\n")
    assert "weight=abc: a number > 0" in refusal("k t weight=abc\n")


def test_the_messages_say_what_to_write() -> None:
    assert refusal("key-a\n") == "keys.txt line 1: expected `KEY TENANT [name=value ...]`"
    assert refusal("k t x=1\n") == (
        "keys.txt line 1: 'x=1' is not one of weight=, top_priority=, priority=, slo_class=, "
        "max_queued=, max_queued_tokens="
    )
    assert refusal("k t\nk u\n") == "keys.txt line 2: this key is given on an earlier line too"
    assert refusal("k t priority=-1\n") == (
        "keys.txt line 1: priority=-1 is below top_priority=0: a key's default must be a "
        "priority it may ask for"
    )
    assert refusal("k t slo_class=x\n") == (
        "keys.txt line 1: slo_class=x is not an --slo-classes class (interactive, batch)"
    )
    assert refusal("k team-a max_queued=1\nj team-a max_queued=2\n") == (
        "keys.txt line 2: tenant 'team-a' has max_queued=1 on line 1: a tenant's weight and "
        "queue limits hold for all its keys"
    )
    assert refusal("sha256:00 t\n") == (
        "keys.txt line 1: sha256: must be followed by 64 hex digits (sha256sum's)"
    )
    assert refusal("k\x7f t\n") == (
        "keys.txt line 1: a key is printable ASCII without spaces (it travels as a header)"
    )


def test_without_classes_a_request_naming_one_is_told_there_are_none() -> None:
    with pytest.raises(InvalidRequest) as err:
        tenancy_for(KeyEntry(), None, "batch", {})
    assert str(err.value) == (
        "slo_class 'batch' is not a class of this gateway: none (the gateway has no --slo-classes)"
    )


def test_the_cache_share_of_a_key_and_a_salt() -> None:
    """Equal (tenant, salt) pairs, and only those, share cached blocks; no key and no salt is
    the share of every such request."""
    a, b = tenant_of("key-a"), tenant_of("key-b")
    assert tenant_of("") == b"" and a and b and a != b
    assert cache_salt(b"", "") == b""
    salts = [cache_salt(t, s) for t in (b"", a, b) for s in ("", "s1", "s2")]
    assert all(salts[1:]) and len(set(salts)) == len(salts)
    assert cache_salt(a, "s1") == cache_salt(tenant_of("key-a"), "s1")


# ---- the queue's counts -----------------------------------------------------------------------


def test_the_queue_counts_what_enters_and_leaves_in_total_and_per_tenant() -> None:
    queue = QueueLimits(max_requests=10, max_tokens=1000)
    queue.enter(30, "a")
    queue.enter(20, "a")
    queue.enter(5, "b")
    assert (queue.requests, queue.tokens) == (3, 55)
    assert (queue.tenant_requests["a"], queue.tenant_tokens["a"]) == (2, 50)
    queue.leave(30, "a")
    assert (queue.requests, queue.tokens) == (2, 25)
    assert (queue.tenant_requests["a"], queue.tenant_tokens["a"]) == (1, 20)
    assert (queue.tenant_requests["b"], queue.tenant_tokens["b"]) == (1, 5)
    queue.leave(20, "a")
    assert (queue.tenant_requests["a"], queue.tenant_tokens["a"], queue.requests) == (0, 0, 1)


def test_the_total_token_limit_takes_a_request_that_fills_it_exactly() -> None:
    queue = QueueLimits(max_requests=10, max_tokens=100)
    queue.enter(60)
    assert queue.refusal(40) is None
    refused = queue.refusal(41)
    assert refused is not None and refused.message == (
        "queue full: 60 prompt tokens are waiting and this request adds 41 (limit 100)"
    )
    assert QueueLimits(1, 100).refusal(0) is None


def test_a_tenant_token_refusal_names_the_tenant() -> None:
    queue = QueueLimits(max_requests=10, max_tokens=1000)
    queue.enter(50, "a")
    refused = queue.refusal(51, "a", max_tokens=100)
    assert refused is not None and (refused.tenant, refused.limit) == ("a", "max_queued_tokens")
    assert not refused.never
    assert refused.message == (
        "queue full for tenant a: 50 of its prompt tokens are waiting and this request adds 51 "
        "(its limit max_queued_tokens=100)"
    )


def test_a_request_over_a_limit_on_its_own_is_told_it_can_never_wait() -> None:
    """A prompt over a token limit, or more choices than a request limit, would be refused on
    an empty queue too: a retry (429) cannot help, the client must change the request."""
    queue = QueueLimits(max_requests=10, max_tokens=1000)
    tenant = queue.refusal(101, "a", max_tokens=100)
    assert tenant is not None and tenant.never and tenant.limit == "max_queued_tokens"
    assert tenant.param is None and "tenant a's queue limit of 100" in tenant.message
    assert queue.refusal(100, "a", max_tokens=100) is None  # exactly the limit fits
    total = queue.refusal(1001)
    assert total is not None and total.never and total.limit == ""
    assert "the gateway's queue limit of 1000 prompt tokens" in total.message
    choices = queue.refusal(10, "a", max_requests=4, n=5)
    assert choices is not None and choices.never and choices.param == "n"
    assert choices.limit == "max_queued" and "ask for fewer choices" in choices.message
    assert queue.refusal(10, "a", max_requests=4, n=4) is None
    assert queue.refusal(10, n=11).never  # the gateway's 10
    tokens = queue.refusal(300, n=4)
    assert tokens.never and "4 choices of 300" in tokens.message
    queue.enter(1)  # one waiting: now the same request waits its turn (429), not never
    later = queue.refusal(10, n=10)
    assert later is not None and not later.never
    assert later.message.endswith("and this request's 10 choices would wait as 10")


def test_a_requests_choices_are_checked_and_queued_together() -> None:
    queue = QueueLimits(max_requests=10, max_tokens=1000)
    queue.enter(10, "a")
    claim = QueueClaim(queue, 4)
    refused = claim.take(10, "a", max_requests=4)
    assert refused is not None and not refused.never  # 1 + 4 > 4: nothing entered
    assert claim.take(10, "a", max_requests=4) is refused  # every choice: the same refusal
    assert claim.first_refusal() and not claim.first_refusal()  # counted once
    claim.close()
    assert (queue.requests, queue.tenant_requests["a"]) == (1, 1)
    claim = QueueClaim(queue, 3)
    assert claim.take(10, "a", max_requests=4) is None  # all three places entered at once
    assert (queue.requests, queue.tokens) == (4, 40)
    assert claim.take(10, "a", max_requests=4) is None  # the second takes its own place
    queue.leave(10, "a")  # the two that took their places leave as they are admitted
    queue.leave(10, "a")
    claim.close()  # the third never came (its client left): its place goes back
    assert (queue.requests, queue.tokens, queue.tenant_requests["a"]) == (1, 10, 1)
    claim.close()
    assert queue.requests == 1


def test_a_key_may_hold_a_hash_a_comment_starts_at_a_line_start_or_after_a_space() -> None:
    keys = parse_api_keys("# all keys\nab#cd team-x weight=2 # its comment\n  #indented\n", "F", {})
    assert keys.entry("ab#cd") is not None and keys.entry("ab") is None
    assert keys.entry("ab#cd").weight == 2.0
