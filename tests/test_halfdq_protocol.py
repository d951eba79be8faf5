"""The half-dQ kernel's named-barrier hand-offs (tests/halfdq_protocol_model.py) finish without a
race or a misused barrier under random interleavings, and the model sees the errors it is for."""
import pytest

from halfdq_protocol_model import IDS, ProtocolError, run


@pytest.mark.parametrize("T", [0, 1, 2, 3, 7])
def test_lockstep_hand_offs_finish_under_random_interleavings(T):
    for seed in range(40):
        run(T, seed)


@pytest.mark.parametrize("fault, T, match", [
    ("no_final_meet", 3, "overwrote K"),
    ("writer_arrives_after_last", 2, "left over"),
    ("wait_before_first_part", 2, "deadlock"),
])
def test_the_model_reports_a_broken_protocol(fault, T, match):
    with pytest.raises(ProtocolError, match=match):
        for seed in range(40):
            run(T, seed, fault=fault)


def test_one_barrier_for_both_hand_offs_is_caught():
    # the dQ part's full and empty hand-offs on one id: uses complete with the wrong members
    with pytest.raises(ProtocolError):
        for seed in range(40):
            run(4, seed, ids={**IDS, "empty": IDS["full"]})


def test_one_ready_barrier_for_both_slots_is_caught():
    # a consumer could arrive for tile t + 1 before the other synced on tile t's arrival
    with pytest.raises(ProtocolError, match="completed by"):
        for seed in range(200):
            run(5, seed, ids={**IDS, "ready": ((8, 8), (10, 10))})


def test_the_kernel_uses_the_barriers_the_model_does():
    """The model's ids, counts and order are the kernel's: its source names them (a change to the
    kernel's hand-offs must come here too)."""
    from flashforge.ops.gluon import attention_bwd_dkdv_halfdq_sm90 as k
    consumer = k._half_consumer.src
    order = ["named_arrive(DS_READY + 2 * ME + s, 256)", "named_sync(DS_READY + 2 * (1 - ME) + s, 256)",
             "named_sync(DQ_EMPTY + ME, 160)", "named_arrive(DQ_FULL + ME, 160)",
             "named_arrive(DS_READY + 2 * ME + T % DS_STAGES, 256)",
             "named_sync(DS_READY + 2 * (1 - ME) + T % DS_STAGES, 256)"]
    at = [consumer.index(x) for x in order]
    assert at == sorted(at)
    part = k._reduce_part.src
    assert part.index("named_sync(DQ_FULL + ME, 160)") < part.index("if use < T - 1:") < part.index(
        "named_arrive(DQ_EMPTY + ME, 160)")
    assert IDS == {"ready": ((k.DS_READY.value, k.DS_READY.value + 1), (k.DS_READY.value + 2, k.DS_READY.value + 3)),
                   "full": (k.DQ_FULL.value, k.DQ_FULL.value + 1), "empty": (k.DQ_EMPTY.value, k.DQ_EMPTY.value + 1)}
