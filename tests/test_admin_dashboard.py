"""The dashboard marks live setting changes on the panels of why requests wait."""

from __future__ import annotations

from tests import dashboard
from tests.test_metrics import all_families

WAIT_PANELS = {"Admission stalls by reason", "Head of the queue waits for", "Oldest wait"}


def test_setting_changes_are_annotations_on_the_stall_and_head_wait_panels() -> None:
    [note] = [a for a in dashboard.load()["annotations"]["list"] if a["name"] == "Setting changes"]
    assert "changes(llmserve_scheduler_setting_changes_total[" in note["expr"]
    exported = {s.name for family in all_families() for s in family.samples}
    assert "llmserve_scheduler_setting_changes_total" in exported
    assert note["datasource"]["uid"] == "${datasource}" and note["enable"]
    titles = {p["id"]: p["title"] for p in dashboard.panels()}
    assert not note["filter"]["exclude"]
    assert {titles[i] for i in note["filter"]["ids"]} == WAIT_PANELS
