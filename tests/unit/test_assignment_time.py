"""When a device was assigned: the annotation the webhook writes with the assignment
(admission/rules.py) and how the operator reads it back (api/views.py)."""

from __future__ import annotations

from passthrough.admission.rules import date_assignment
from passthrough.api.views import ASSIGNED_AT, NodeDevice

NOW, THEN = "2026-11-29T12:00:00Z", "2026-11-29T11:00:00Z"


def test_a_write_that_sets_or_changes_the_assignment_is_dated_now_and_one_that_clears_it_drops_the_time():
    verdict, value = date_assignment("team-a", "", "", "", NOW)
    assert verdict.allowed and not verdict.warnings and value == NOW
    verdict, value = date_assignment("team-b", "team-a", THEN, THEN, NOW)
    assert verdict.allowed and not verdict.warnings and value == NOW
    verdict, value = date_assignment("", "team-a", THEN, THEN, NOW)
    assert verdict.allowed and value == ""


def test_the_time_written_by_hand_is_refused_unless_the_assignment_changes_with_it():
    verdict, value = date_assignment("team-a", "team-a", "2020-01-01T00:00:00Z", THEN, NOW)
    assert not verdict.allowed and value == THEN
    assert f"leave it as it was ({THEN})" in verdict.refusal and "clear spec.assignedNamespace and set it again" in verdict.refusal
    assert not date_assignment("team-a", "team-a", "", THEN, NOW)[0].allowed  # removed
    assert not date_assignment("", "", THEN, "", NOW)[0].allowed  # nothing assigned, a time given
    # With the assignment, the webhook's time wins, and the writer is told.
    verdict, value = date_assignment("team-b", "team-a", "2020-01-01T00:00:00Z", THEN, NOW)
    assert verdict.allowed and value == NOW and "2020-01-01T00:00:00Z was replaced by 2026-11-29T12:00:00Z" in verdict.warnings[0]
    # A write that leaves both as they were passes untouched.
    verdict, value = date_assignment("team-a", "team-a", THEN, THEN, NOW)
    assert verdict.allowed and not verdict.warnings and value == THEN


def _body(annotation: str | None, entry_time: str, fields: dict) -> dict:
    annotations = {ASSIGNED_AT: annotation} if annotation is not None else {}
    return {"metadata": {"name": "pci-x", "creationTimestamp": "2026-11-29T10:00:00Z", "annotations": annotations,
                         "managedFields": [{"manager": "kubectl-patch", "time": entry_time, "fieldsV1": fields}]},
            "spec": {"assignedNamespace": "team-a"}}  # fmt: skip


LABELLED = {"f:metadata": {"f:labels": {"f:team": {}}}, "f:spec": {"f:assignedNamespace": {}}}


def test_the_annotation_dates_the_assignment_whatever_its_writer_changed_since():
    assert NodeDevice.of(_body("2026-11-29T10:30:00Z", "2026-11-29T12:00:00Z", LABELLED)).assigned_at == "2026-11-29T10:30:00Z"
    # Without it, the same record is dated no later than the object's creation.
    assert NodeDevice.of(_body(None, "2026-11-29T12:00:00Z", LABELLED)).assigned_at == "2026-11-29T10:00:00Z"


def test_an_annotation_the_record_contradicts_is_held_within_it():
    # Later than the write that owns the assignment (a clock ahead, or a hand while the webhook was off): that write's time.
    assert NodeDevice.of(_body("2026-11-29T13:00:00Z", "2026-11-29T12:00:00Z", LABELLED)).assigned_at == "2026-11-29T12:00:00Z"
    # Before the object existed: its creation.
    assert NodeDevice.of(_body("2020-01-01T00:00:00Z", "2026-11-29T12:00:00Z", LABELLED)).assigned_at == "2026-11-29T10:00:00Z"
    # Not a time: as if absent.
    assert NodeDevice.of(_body("yesterday", "2026-11-29T12:00:00Z", LABELLED)).assigned_at == "2026-11-29T10:00:00Z"
