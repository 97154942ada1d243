"""Failover (PostgreSQL): the primary is killed, its streaming standby promoted, and the
workers go on through a multi-host URL (:mod:`tests.failover` runs it and judges it).

With synchronous replication nothing the workers were told is lost: no token is issued
twice, every acknowledged completion is on the new primary. With an asynchronous standby
that lags, the harness shows what was lost and labels it an unsafe configuration, named by
``fencing doctor`` (and by the store's own warning) before the crash: not a library failure.
"""

from __future__ import annotations

import pytest

from tests import failover
from tests.failover import AFTER, BEFORE, LAGGING

#: private servers, a kill and a promotion: seconds each (CI runs slow tests once per database)
pytestmark = [pytest.mark.backend("postgresql"), pytest.mark.slow]


@pytest.mark.parametrize(
    ("synchronous_commit", "lag"),
    [
        # the standby frozen first: commits wait for it, and the kill finds them waiting
        ("on", True),
        # the standby streaming: the kill finds commits in flight, applied there or not
        ("remote_apply", False),
    ],
)
def test_failover_with_a_synchronous_standby_loses_nothing_acknowledged(
    synchronous_commit: str, lag: bool
) -> None:
    report = failover.failover(
        settings={"synchronous_standby_names": "standby", "synchronous_commit": synchronous_commit}, lag=lag
    )
    print(report.render())
    j, v = report.journal, report.verdict
    assert j.errors == [], report.render()
    assert (v.reissued, v.forgotten, v.lost, v.vanished) == ([], [], [], []), report.render()
    assert report.label.startswith("safe"), report.render()
    # the settings were safe, and said so
    assert report.doctor[0] == 0 and report.doctor_risks == [] and report.store_warned == [], report.render()
    # the failover hit a running workload, which rode through it and went on
    before, after = j.by_phase(j.completed).get(BEFORE, 0), j.by_phase(j.completed).get(AFTER, 0)
    assert before > 0 and after > 0, report.render()
    assert j.by_phase(j.issued).get(AFTER, 0) > 0, report.render()
    assert j.outages["DatabaseUnavailable"] > 0, report.render()
    if lag:
        # nothing begun while the synchronous standby was frozen was acknowledged: the kill
        # found those commits waiting for it, and their outcome came back unknown
        assert not {LAGGING} & {*j.by_phase(j.issued), *j.by_phase(j.completed), *j.by_phase(j.enqueued)}
        assert sum(j.unknown.values()) > 0, report.render()


def test_failover_to_a_lagging_asynchronous_standby_is_reported_as_an_unsafe_configuration() -> None:
    report = failover.failover(settings={}, lag=True)
    print(report.render())
    j, v = report.journal, report.verdict
    assert j.errors == [], report.render()
    # the primary acknowledged work while its standby received nothing...
    assert j.by_phase(j.issued).get(LAGGING, 0) > 0, report.render()
    assert j.by_phase(j.completed).get(LAGGING, 0) > 0, report.render()
    # ...and the new primary lost it: tokens handed out again, completions gone
    assert v.reissued or v.forgotten, report.render()
    assert v.lost and v.vanished, report.render()
    # every completion acknowledged while the standby was frozen is gone, none after
    lost = {result for _, _, result, _ in v.lost}
    assert {result for _, _, result, _, phase in j.completed if phase == LAGGING} <= lost, report.render()
    assert not lost & {result for _, _, result, _, phase in j.completed if phase == AFTER}, report.render()
    assert {job for job, phase in j.enqueued if phase == LAGGING} <= set(v.vanished), report.render()
    # named before the crash, by the doctor and by the store: an unsafe configuration
    assert report.doctor[0] == 1, report.render()
    [risk] = report.doctor_risks
    assert risk.startswith("RISK  synchronous_standby_names = '' (1 standbys streaming)"), risk
    assert "asynchronous" in risk
    assert report.store_warned == ["synchronous_standby_names"], report.render()
    assert report.label.startswith("UNSAFE CONFIGURATION (not a library failure)"), report.render()
    # the workers went on against the new primary regardless
    assert j.by_phase(j.issued).get(AFTER, 0) > 0, report.render()
