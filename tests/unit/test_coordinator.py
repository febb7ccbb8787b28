"""The replicated coordinator: link selection, batching, wire format."""
import pytest
import torch

from hipress_like.casync.coordinator import (
    COLLECTIVE,
    FLAG_CLOSED,
    Coordinator,
    Report,
    decode_report,
    encode_report,
)


def test_report_round_trip_and_capacity():
    r = Report(flags=FLAG_CLOSED, outstanding=7, error_arg=-1, digest=123,
               msgs=[(1, 2, 300), (5, 0, 8)])
    t = encode_report(r, capacity=4)
    assert t.dtype == torch.int64 and t.numel() == 5 + 12
    assert decode_report(t) == r
    with pytest.raises(ValueError, match="capacity"):
        encode_report(Report(msgs=[(0, 1, 1)] * 5), capacity=4)
    bad = t.clone()
    bad[4] = 99
    with pytest.raises(ValueError, match="corrupt"):
        decode_report(bad)


def test_matching_selects_non_conflicting_links():
    c = Coordinator(4, batch_bytes=100)
    # every rank sends to every other rank: 12 links
    c.add_reports([Report(msgs=[(10 * s + d, d, 10) for d in range(4) if d != s])
                   for s in range(4)])
    rounds = 0
    seen = set()
    while not c.empty():
        plan = c.plan_round()
        srcs = [s for s, _ in plan.links]
        dsts = [d for _, d in plan.links]
        assert len(srcs) == len(set(srcs)) and len(dsts) == len(set(dsts))
        seen.update(plan.links)
        rounds += 1
    assert len(seen) == 12 and rounds >= 3  # a perfect schedule needs N-1 = 3 rounds


def test_batching_respects_threshold_and_fifo():
    c = Coordinator(2, batch_bytes=25)
    c.add_reports([Report(msgs=[(i, 1, 10) for i in range(5)]), Report()])
    batches = []
    while not c.empty():
        batches.append([k for k, _ in c.plan_round().links[(0, 1)]])
    assert batches == [[0, 1], [2, 3], [4]]


def test_oversized_message_goes_alone_and_batching_off_sends_one():
    c = Coordinator(2, batch_bytes=5)
    c.add_reports([Report(msgs=[(0, 1, 50), (1, 1, 1)]), Report()])
    assert c.plan_round().links[(0, 1)] == [(0, 50)]
    c = Coordinator(2, batch_bytes=1 << 30, batching=False)
    c.add_reports([Report(msgs=[(0, 1, 1), (1, 1, 1)]), Report()])
    assert len(c.plan_round().links[(0, 1)]) == 1


def test_without_matching_all_links_go_in_one_round():
    c = Coordinator(3, matching=False)
    c.add_reports([Report(msgs=[(s * 3 + d, d, 4) for d in range(3) if d != s])
                   for s in range(3)])
    assert len(c.plan_round().links) == 6 and c.empty()


def test_invalid_destination_is_rejected():
    c = Coordinator(2)
    with pytest.raises(ValueError, match="invalid destination"):
        c.add_reports([Report(msgs=[(0, 0, 4)]), Report()])


def test_collective_waits_for_every_rank_then_fuses_in_ready_order():
    c = Coordinator(3, fusion_bytes=100)
    # key 7 is ready on ranks 0 and 1 only; key 3 and 5 everywhere
    c.add_reports([Report(msgs=[(7, COLLECTIVE, 40), (5, COLLECTIVE, 40)]),
                   Report(msgs=[(5, COLLECTIVE, 40), (7, COLLECTIVE, 40)]),
                   Report(msgs=[(5, COLLECTIVE, 40), (3, COLLECTIVE, 40)])])
    assert not c.empty()
    assert c.plan_round().buckets == [[(5, 40)]]
    c.add_reports([Report(), Report(msgs=[(3, COLLECTIVE, 40)]), Report()])
    assert not c.empty()  # 3 still misses rank 0; 7 misses rank 2
    assert c.plan_round().buckets == []
    c.add_reports([Report(msgs=[(3, COLLECTIVE, 40)]), Report(),
                   Report(msgs=[(7, COLLECTIVE, 40)])])
    # both became ready in the same round: key order; 80 <= 100 fits one bucket
    assert c.plan_round().buckets == [[(3, 40), (7, 40)]]
    assert c.empty()


def test_collective_buckets_respect_fusion_bytes_and_batching_off():
    c = Coordinator(2, fusion_bytes=100)
    msgs = [(k, COLLECTIVE, nb) for k, nb in enumerate([60, 30, 20, 500, 10])]
    c.add_reports([Report(msgs=msgs), Report(msgs=msgs)])
    # a bucket closes once it holds >= 100 bytes (DDP's rule): 60+30+20, then 500 alone
    assert [[k for k, _ in b] for b in c.plan_round().buckets] == [[0, 1, 2], [3], [4]]
    c = Coordinator(2, batching=False)
    c.add_reports([Report(msgs=msgs[:2]), Report(msgs=msgs[:2])])
    assert len(c.plan_round().buckets) == 2


def test_collective_size_disagreement_is_an_error():
    c = Coordinator(2)
    with pytest.raises(ValueError, match="bytes for collective"):
        c.add_reports([Report(msgs=[(1, COLLECTIVE, 8)]), Report(msgs=[(1, COLLECTIVE, 16)])])


def test_collectives_are_held_while_arriving_until_a_pause_size_or_close():
    c = Coordinator(2, fusion_bytes=100)
    both = lambda *m: [Report(msgs=list(m)), Report(msgs=list(m))]  # noqa: E731
    c.add_reports(both((1, COLLECTIVE, 30)))
    assert c.plan_round(final=False).buckets == []          # still arriving, 30 < 100
    c.add_reports(both((2, COLLECTIVE, 30)))
    assert c.plan_round(final=False).buckets == []          # 60 < 100
    c.add_reports([Report(), Report()])                      # a pause: flush
    assert c.plan_round(final=False).buckets == [[(1, 30), (2, 30)]]
    c.add_reports(both((3, COLLECTIVE, 60), (4, COLLECTIVE, 60), (5, COLLECTIVE, 30)))
    # 60 + 60 >= 100 closes a bucket; the open one (5) is held while arriving
    assert c.plan_round(final=False).buckets == [[(3, 60), (4, 60)]]
    c.add_reports(both((6, COLLECTIVE, 1)))
    assert c.plan_round(final=False).buckets == []          # 31 < 100, still arriving
    c.add_reports(both((7, COLLECTIVE, 1)))
    assert c.plan_round(final=True).buckets == [[(5, 30), (6, 1), (7, 1)]]  # every rank closed
    assert c.empty()


def test_solo_collectives_leave_at_once_and_alone():
    # the lane's static buckets are fused already: fusing them again with what
    # happened to be ready in the same round would make the summation order,
    # and so the result's last bits, depend on timing
    c = Coordinator(2, fusion_bytes=100, solo={1, 2})
    both = lambda *m: [Report(msgs=list(m)), Report(msgs=list(m))]  # noqa: E731
    c.add_reports(both((1, COLLECTIVE, 30), (3, COLLECTIVE, 30)))
    assert c.plan_round(final=False).buckets == [[(1, 30)]]  # 3 is held while arriving
    c.add_reports(both((2, COLLECTIVE, 40), (4, COLLECTIVE, 10)))
    assert c.plan_round(final=True).buckets == [[(2, 40)], [(3, 30), (4, 10)]]
    assert c.empty()


def test_an_exchange_tag_names_the_round_shape_the_same_on_every_rank():
    """rounds._shape_tag: Horovod matches calls by name; equal shapes, equal names."""
    from hipress_like.casync.coordinator import RoundPlan
    from hipress_like.casync.rounds import _shape_tag
    a = RoundPlan(links={(0, 1): [(5, 100)], (1, 0): [(6, 8), (7, 3)]})
    same = RoundPlan(links={(1, 0): [(9, 8), (2, 3)], (0, 1): [(5, 97)]})  # same padded bytes
    other = RoundPlan(links={(0, 1): [(5, 100)], (1, 0): [(6, 24)]})
    assert _shape_tag(a) == _shape_tag(same) != _shape_tag(other)
