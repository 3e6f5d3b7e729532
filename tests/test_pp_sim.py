"""Pipeline-schedule IR, generators, simulator and timeline (autopar.cost.pp_sim / timeline)."""
from __future__ import annotations

import time
import xml.etree.ElementTree as ET

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.cost.pp_sim import (KINDS, SCHEDULES, Action, Schedule, StageCosts, gpipe,
                                 interleaved_1f1b, make, one_f_one_b, simulate, zero_bubble)
from autopar.cost.timeline import timeline_svg, write_timeline
from autopar.core.errors import ConfigError

SVG = "{http://www.w3.org/2000/svg}"
FAST = settings(max_examples=60, deadline=None)


def uniform(schedule: Schedule, f: float = 1.0, b: float = 2.0, **kw) -> StageCosts:
    """Uniform costs for a device's whole share of the model: each of its v stages gets 1/v."""
    v = schedule.virtual
    w = kw.pop("w", None)
    return StageCosts.uniform(schedule.stages(), f / v, b / v, w=None if w is None else w / v, **kw)


def bubble(schedule: Schedule, **kw) -> float:
    return simulate(schedule, uniform(schedule, **kw)).bubble_fraction


# ------------------------------------------------------------------------------ closed forms

@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_bubble_closed_form_grid(name):
    for p in range(1, 7):
        for m in range(1, 11):
            assert bubble(make(name, p, m)) == pytest.approx((p - 1) / m, abs=1e-12), (p, m)


def test_interleaved_bubble_closed_form_grid():
    for p in range(1, 6):
        for v in range(1, 5):
            for m in range(p, 4 * p + 1, p):
                expected = (p - 1) / (v * m)
                assert bubble(interleaved_1f1b(p, v, m)) == pytest.approx(expected, abs=1e-12), (p, v, m)


@FAST
@given(p=st.integers(1, 8), k=st.integers(1, 4), v=st.integers(1, 4),
       f=st.floats(0.05, 5.0), b=st.floats(0.05, 5.0))
def test_bubble_closed_forms_property(p, k, v, f, b):
    m = k * p
    assert bubble(gpipe(p, m), f=f, b=b) == pytest.approx((p - 1) / m, rel=1e-9, abs=1e-12)
    assert bubble(one_f_one_b(p, m), f=f, b=b) == pytest.approx((p - 1) / m, rel=1e-9, abs=1e-12)
    assert bubble(interleaved_1f1b(p, v, m), f=f, b=b) == pytest.approx((p - 1) / (v * m), rel=1e-9, abs=1e-12)


def test_step_time_and_busy_uniform():
    r = simulate(one_f_one_b(4, 8), StageCosts.uniform(4, 1.0, 2.0))
    assert r.step_time_s == pytest.approx((8 + 3) * 3.0)
    assert r.busy_s == pytest.approx((24.0,) * 4)
    assert r.idle_fraction == pytest.approx(tuple(1 - 24 / 33 for _ in range(4)))


# ------------------------------------------------------------------------------ zero bubble

@FAST
@given(p=st.integers(2, 8), m=st.integers(1, 16), f=st.floats(0.1, 3.0), b=st.floats(0.1, 3.0),
       share=st.floats(0.01, 1.0))
def test_zero_bubble_below_1f1b(p, m, f, b, share):
    zb, ofob = zero_bubble(p, m), one_f_one_b(p, m)
    costs = StageCosts.uniform(p, f, b, w=share * b)
    rz, r1 = simulate(zb, costs), simulate(ofob, costs)
    assert rz.bubble_fraction < r1.bubble_fraction
    assert rz.busy_s == pytest.approx(r1.busy_s)
    assert max(rz.peak_inflight) == max(r1.peak_inflight) == min(p, m)


@pytest.mark.parametrize("p,m", [(2, 2), (4, 8), (4, 4), (8, 16), (3, 7)])
def test_zero_bubble_matches_zb_h1_formula(p, m):
    """Qi et al.: with T_F = T_B = T_W the bubble is (p-1)(T_F+T_B-T_W), a third of 1F1B's."""
    r = simulate(zero_bubble(p, m), StageCosts.uniform(p, 1.0, 2.0, w=1.0))
    assert r.step_time_s - max(r.busy_s) == pytest.approx(p - 1)
    assert bubble(zero_bubble(p, m), w=1.0) == pytest.approx(bubble(one_f_one_b(p, m)) / 3)


def test_zero_bubble_without_weight_grad_equals_1f1b():
    assert bubble(zero_bubble(4, 8), w=0.0) == pytest.approx(bubble(one_f_one_b(4, 8)))


# ------------------------------------------------------------------------------ memory

@pytest.mark.parametrize("p,m", [(1, 3), (4, 2), (4, 8), (6, 6)])
def test_peak_inflight(p, m):
    assert simulate(gpipe(p, m), StageCosts.uniform(p, 1, 2)).peak_inflight == (m,) * p
    one = simulate(one_f_one_b(p, m), StageCosts.uniform(p, 1, 2))
    assert one.peak_inflight == tuple(min(p - d, m) for d in range(p))
    assert one.peak_inflight[0] == min(p, m)


def test_peak_activation_bytes_sum_over_a_devices_stages():
    p, v, m = 2, 2, 4
    acts = (1.0, 10.0, 100.0, 1000.0)            # stage s on device s % 2
    costs = StageCosts((0.5,) * 4, (1.0,) * 4, activation_bytes=acts)
    r = simulate(interleaved_1f1b(p, v, m), costs)
    for d in range(p):
        stages = range(d, p * v, p)
        assert r.peak_activation_bytes[d] <= sum(r.peak_inflight[s] * acts[s] for s in stages)
        assert r.peak_activation_bytes[d] >= max(r.peak_inflight[s] * acts[s] for s in stages)
    g = simulate(gpipe(2, 3), StageCosts.uniform(2, 1, 2, act=8.0))
    assert g.peak_activation_bytes == (24.0, 24.0)


# ------------------------------------------------------------------------------ text form

@pytest.mark.parametrize("text,action", [
    ("F2.3", Action("F", 2, 3)), ("B0.1", Action("B", 0, 1)), ("W1.0", Action("W", 1, 0)),
    ("SEND_F2.3>3", Action("SEND_F", 2, 3, 3)), ("RECV_F3.3<2", Action("RECV_F", 3, 3, 2)),
    ("SEND_B3.1>2", Action("SEND_B", 3, 1, 2)), ("RECV_B2.1<3", Action("RECV_B", 2, 1, 3)),
])
def test_action_text(text, action):
    assert str(action) == text
    assert Action.parse(text) == action


@given(kind=st.sampled_from(KINDS), stage=st.integers(0, 500), mb=st.integers(0, 5000),
       peer=st.integers(0, 500))
def test_action_round_trip_property(kind, stage, mb, peer):
    action = Action(kind, stage, mb, None if kind in ("F", "B", "W") else peer)
    assert Action.parse(str(action)) == action


@pytest.mark.parametrize("text", ["X1.2", "F1", "F1.2>3", "SEND_F1.2<3", "RECV_B1.2>0", "SEND_F1.2", "F-1.2"])
def test_action_parse_rejects(text):
    with pytest.raises(ConfigError):
        Action.parse(text)


def test_action_rejects_bad_fields():
    with pytest.raises(ConfigError):
        Action("F", 0, 0, peer=1)
    with pytest.raises(ConfigError):
        Action("SEND_F", 0, 0)
    with pytest.raises(ConfigError):
        Action("Q", 0, 0)


def test_one_f_one_b_golden_text():
    assert one_f_one_b(3, 4).to_text() == (
        "d0: F0.0 F0.1 F0.2 B0.0 F0.3 B0.1 B0.2 B0.3\n"
        "d1: F1.0 F1.1 B1.0 F1.2 B1.1 F1.3 B1.2 B1.3\n"
        "d2: F2.0 B2.0 F2.1 B2.1 F2.2 B2.2 F2.3 B2.3")


def test_zero_bubble_golden_text():
    assert zero_bubble(2, 3).to_text() == (
        "d0: F0.0 F0.1 B0.0 W0.0 F0.2 B0.1 W0.1 B0.2 W0.2\n"
        "d1: F1.0 B1.0 F1.1 B1.1 W1.0 F1.2 B1.2 W1.1 W1.2")


def test_interleaved_golden_text():
    # torch's order (tests/test_cost_fidelity.py compares it): d1 warms up with (v-1)p = 2
    assert interleaved_1f1b(2, 2, 2).to_text() == (
        "d0: F0.0 F0.1 F2.0 F2.1 B2.0 B2.1 B0.0 B0.1\n"
        "d1: F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 B1.0 B1.1")


def test_with_comm_golden_text():
    assert gpipe(2, 2).with_comm().to_text() == (
        "d0: F0.0 SEND_F0.0>1 F0.1 SEND_F0.1>1 RECV_B0.0<1 B0.0 RECV_B0.1<1 B0.1\n"
        "d1: RECV_F1.0<0 F1.0 RECV_F1.1<0 F1.1 B1.0 SEND_B1.0>0 B1.1 SEND_B1.1>0")


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 3, 5, 1), ("1f1b", 4, 6, 1), ("interleaved", 2, 4, 3),
                                        ("zb", 3, 4, 1), ("interleaved", 1, 2, 2)])
def test_schedule_text_round_trip(name, p, m, v):
    sched = make(name, p, m, v)
    assert name in SCHEDULES
    back = Schedule.from_text(sched.to_text(), name=name, virtual=v)
    assert back == sched
    comm = sched.with_comm()
    assert Schedule.from_text(comm.to_text(), name=name, virtual=v, split_backward=sched.split_backward) == comm
    assert comm.with_comm() == comm
    comm.validate()
    assert simulate(comm, uniform(sched, p2p=0.1)).step_time_s == simulate(sched, uniform(sched, p2p=0.1)).step_time_s


def test_with_comm_mismatch_is_caught():
    text = gpipe(2, 2).with_comm().to_text().replace("SEND_F0.1>1 ", "")
    with pytest.raises(ConfigError, match="SEND/RECV"):
        Schedule.from_text(text).validate()


def test_from_text_rejects_bad_lines():
    with pytest.raises(ConfigError):
        Schedule.from_text("d0: F0.0 B0.0\nd0: F0.1 B0.1")
    with pytest.raises(ConfigError):
        Schedule.from_text("d1: F1.0 B1.0")
    with pytest.raises(ConfigError):
        Schedule.from_text("device zero: F0.0")


# ------------------------------------------------------------------------------ validation

def test_validate_accepts_generated_schedules():
    for name in SCHEDULES:
        make(name, 4, 8, 2 if name in ("interleaved", "dualpipev") else 1).validate()


def test_validate_catches_missing_action():
    text = one_f_one_b(2, 2).to_text().replace(" B1.1", "")
    with pytest.raises(ConfigError, match="missing") as err:
        Schedule.from_text(text).validate()
    assert "B1.1" in str(err.value)


@pytest.mark.parametrize("text,match", [
    ("d0: F0.0 F0.0 B0.0 B0.1 F0.1\nd1: F1.0 B1.0 F1.1 B1.1", "duplicate"),
    ("d0: F0.0 B0.0 F0.1 B0.1 F1.0\nd1: B1.0 F1.1 B1.1", "belongs on device 1"),
    ("d0: F0.0 B0.0 W0.0\nd1: F1.0 B1.0 W1.0", None),
])
def test_validate_catches_misplaced_actions(text, match):
    sched = Schedule.from_text(text)
    if match is None:
        sched.validate()
        with pytest.raises(ConfigError, match="W in a schedule"):
            Schedule.from_text(text, split_backward=False).validate()
    else:
        with pytest.raises(ConfigError, match=match):
            sched.validate()


def test_validate_catches_deadlock():
    # d0 wants B0.0 (needs B1.0) before F0.1; d1 wants F1.1 (needs F0.1) before B1.0.
    sched = Schedule.from_text("d0: F0.0 B0.0 F0.1 B0.1\nd1: F1.1 B1.1 F1.0 B1.0")
    with pytest.raises(ConfigError, match="deadlock") as err:
        sched.validate()
    assert "device 0 at B0.0" in str(err.value) and "device 1 at F1.1" in str(err.value)


def test_deadlock_on_own_later_action():
    with pytest.raises(ConfigError, match="device 0 at B0.0 waits for F0.0"):
        simulate(Schedule.from_text("d0: B0.0 F0.0"), StageCosts.uniform(1, 1, 1))


def test_generator_arguments():
    with pytest.raises(ConfigError, match="multiple") as err:
        interleaved_1f1b(4, 2, 6)
    assert "m=8" in str(err.value)
    with pytest.raises(ConfigError, match="gpipe, 1f1b, interleaved, zb"):
        make("pipedream", 2, 4)
    with pytest.raises(ConfigError):
        make("1f1b", 2, 4, v=2)
    with pytest.raises(ConfigError):
        gpipe(0, 4)


def test_stage_costs_are_checked():
    with pytest.raises(ConfigError):
        StageCosts((1.0, 1.0), (1.0,))
    with pytest.raises(ConfigError):
        StageCosts((1.0,), (1.0,), weight_grad_s=(2.0,))
    with pytest.raises(ConfigError):
        StageCosts((1.0,), (-1.0,))
    with pytest.raises(ConfigError):
        simulate(gpipe(2, 2), StageCosts.uniform(3, 1, 1))
    with pytest.raises(ConfigError):
        simulate(gpipe(3, 2), StageCosts((1.0,) * 3, (1.0,) * 3, p2p_s=(0.1,)))


# ------------------------------------------------------------------------------ hand-computed cases

def test_slow_last_stage_gpipe_by_hand():
    # f = (1, 3), b = (2, 5).  d0: F0.0 [0,1] F0.1 [1,2].  d1: F1.0 [1,4] F1.1 [4,7]
    # B1.0 [7,12] B1.1 [12,17].  d0: B0.0 [12,14] B0.1 [17,19].
    r = simulate(gpipe(2, 2), StageCosts((1.0, 3.0), (2.0, 5.0)))
    assert r.step_time_s == pytest.approx(19.0)
    assert r.busy_s == pytest.approx((6.0, 16.0))
    assert r.bubble_fraction == pytest.approx(3 / 16)
    spans = {str(e.action): (e.start, e.end) for e in r.events}
    assert spans["B0.0"] == pytest.approx((12.0, 14.0))
    assert spans["F1.1"] == pytest.approx((4.0, 7.0))


def test_slow_last_stage_1f1b_by_hand():
    # d1: F1.0 [1,4] B1.0 [4,9] F1.1 [9,12] B1.1 [12,17]; d0: F0.0 F0.1 B0.0 [9,11] B0.1 [17,19].
    r = simulate(one_f_one_b(2, 2), StageCosts((1.0, 3.0), (2.0, 5.0)))
    assert r.step_time_s == pytest.approx(19.0)
    spans = {str(e.action): (e.start, e.end) for e in r.events}
    assert spans["F1.1"] == pytest.approx((9.0, 12.0))
    assert spans["B0.0"] == pytest.approx((9.0, 11.0))


@pytest.mark.parametrize("c", [0.0, 0.25, 1.0])
def test_p2p_adds_one_hop_each_way_gpipe(c):
    """gpipe p=2 m=2, f=1 b=2: the step is 9 plus one forward and one backward hop while the
    link keeps up (c <= f)."""
    r = simulate(gpipe(2, 2), StageCosts.uniform(2, 1.0, 2.0, p2p=c))
    assert r.step_time_s == pytest.approx(9.0 + 2 * c)
    sends = [e for e in r.events if not e.action.is_compute]
    assert sorted(str(e.action) for e in sends) == ["SEND_B1.0>0", "SEND_B1.1>0", "SEND_F0.0>1", "SEND_F0.1>1"]
    assert all(e.end - e.start == pytest.approx(c) for e in sends)


def test_p2p_link_serialises_transfers():
    # c = 3 > f: F0.1 waits for the link until 4, arrives 7; d1: F1.0 [4,5] F1.1 [7,8]
    # B1.0 [8,10] B1.1 [10,12]; grads arrive 13 and 16 (queued); d0: B0.0 [13,15] B0.1 [16,18].
    r = simulate(gpipe(2, 2), StageCosts.uniform(2, 1.0, 2.0, p2p=3.0))
    assert r.step_time_s == pytest.approx(18.0)
    sends = {str(e.action): (e.start, e.end) for e in r.events if not e.action.is_compute}
    assert sends["SEND_F0.1>1"] == pytest.approx((4.0, 7.0))
    assert sends["SEND_B1.1>0"] == pytest.approx((13.0, 16.0))


def test_same_device_boundaries_are_free():
    sched = interleaved_1f1b(1, 3, 2)                  # every stage on device 0
    r = simulate(sched, StageCosts.uniform(3, 1.0, 2.0, p2p=5.0))
    assert r.step_time_s == pytest.approx(2 * 3 * 3.0)
    assert all(e.action.is_compute for e in r.events)


def test_large_schedule_is_fast():
    sched = interleaved_1f1b(64, 2, 512)
    start = time.perf_counter()
    r = simulate(sched, StageCosts.uniform(128, 0.5, 1.0, p2p=0.01))
    assert time.perf_counter() - start < 3.0
    assert len(r.events) == 2 * 128 * 512 + 2 * 127 * 512


# ------------------------------------------------------------------------------ timeline

@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2), ("zb", 3, 6, 1)])
def test_timeline_svg_is_well_formed(name, p, m, v, tmp_path):
    sched = make(name, p, m, v)
    r = simulate(sched, uniform(sched, f=1.2e-3, b=2.4e-3, p2p=1e-4))
    svg = timeline_svg(r, title=f"{name} <p={p}> & m={m}")
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    labels = [t for t in root.iter(f"{SVG}text") if t.get("class") == "row-label"]
    assert [t.text for t in labels] == [f"d{d}" for d in range(p)]
    tips = [t.text for t in root.iter(f"{SVG}title")]
    computes = [e for e in r.events if e.action.is_compute]
    assert sum(tip.startswith(("F stage", "B stage", "W stage")) for tip in tips) == len(computes)
    e = computes[0]
    assert f"{e.action.kind} stage {e.action.stage} mb {e.action.mb}: " in svg
    assert "time (ms)" in svg and "forward" in svg and "backward" in svg
    assert ("weight grad" in svg) == sched.split_backward
    out = tmp_path / "timeline.svg"
    write_timeline(r, out)
    ET.parse(out)


def test_timeline_of_zero_length_step():
    r = simulate(gpipe(2, 1), StageCosts.uniform(2, 0.0, 0.0))
    ET.fromstring(timeline_svg(r))
