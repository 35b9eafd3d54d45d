"""The broker's routing core (``mia_stream.broker._routing.Router``) rule by rule, with injected time and no
sockets: messages are fed as encoded frames, what it would send is taken from its outbox and consumer queues
and decoded. Rings are real files (a private directory, not /dev/shm)."""

from __future__ import annotations

import collections

import msgpack
import numpy as np
import pytest

from mia_stream.bus.transport import BrokerEndpoints
from mia_stream.broker._routing import PRODUCERS, BrokerConfig, Router
from mia_stream.schemas import (AnalysisBatch, Credit, ErrorNotice, GapBatch, GapNotice, Heartbeat, RowGroup,
                                SteeringAck, SteeringCommand, StepBatch, StreamEnd, StreamStart, Subscribe, Tensor,
                                TensorFrame, TokenBatch, TokenFrame, Unsubscribe, decode, decode_header, encode,
                                encode_batch)
from mia_stream.bus.shm_ring import ShmRingReader, ShmRingWriter
from mia_stream.bus.shm_ring import SHM_RING_CLOSED_KEY, SHM_RING_PROOF_KEY, SHM_RING_TAKEN_KEY

EPS = BrokerEndpoints("ipc:///nonexistent/producers.sock", "ipc:///nonexistent/consumers.sock",
                      "ipc:///nonexistent/stats.sock")
HIDDEN = 8
P, Q = b"prod/1", b"prod/2"  # producer identities (producer_id "prod", epochs 1 and 2)


class Bus:
    """A Router driven the way the broker's socket loop drives it: every input carries the (fake) time, the
    outbox is taken after each call, consumer queues are drained on request."""

    def __init__(self, shm: ShmRingReader | None = None, flush: bool = False, **config):
        self.now = 1000.0
        self.router = Router(BrokerConfig(EPS, **config), instance=7, accept_shm=shm is not None, shm=shm,
                             wall_ns=lambda: 1, now=self.now, flush=self._flush if flush else None)
        self.shm = shm
        self.to_producers: dict[bytes, list] = collections.defaultdict(list)  # decoded, heartbeats included
        self.direct: dict[bytes, list] = collections.defaultdict(list)  # sent to consumers outside their queue
        self.unreachable: set[bytes] = set()  # producers whose socket is gone
        self.flushed: dict[bytes, list] = collections.defaultdict(list)  # what _flush sent

    # ---------------------------------------------------------------- inputs
    def produce(self, msg, identity: bytes = P, ring: ShmRingWriter | None = None) -> list:
        frames = msg if isinstance(msg, list) else encode(msg, shm=ring)
        self.router.producer_message(identity, frames, self.now)
        self._outbox()
        return frames

    def consume(self, identity: bytes, msg) -> None:
        frames = msg if isinstance(msg, list) else encode(msg)
        self.router.consumer_message(identity, frames, self.now)
        self._outbox()

    def subscribe(self, identity: bytes, *patterns: str, **options) -> None:
        self.consume(identity, Subscribe(list(patterns), consumer_id=identity.decode(), **options))

    def tick(self, dt: float = 0.05) -> None:
        self.now += dt
        self.router.tick(self.now)
        self._outbox()

    def prove(self, ring: ShmRingWriter, identity: bytes = P) -> None:
        self.produce(Heartbeat("prod", "producer", 1, 0, {SHM_RING_PROOF_KEY: ring.ownership_proof()}), identity)

    def _outbox(self) -> None:
        for dest, ident, frames, command_id in self.router.take_outbox():
            if dest == PRODUCERS:
                if ident in self.unreachable:
                    if command_id is not None:
                        self.router.producer_unreachable(ident, command_id)
                    continue
                self.to_producers[ident].append(decode(frames))
            else:
                self.direct[ident].append(decode(frames))

    def _flush(self, identity: bytes) -> bool:
        self.flushed[identity].extend(self.receive_frames(identity))
        return True

    # ---------------------------------------------------------------- outputs
    def receive_frames(self, identity: bytes, credit: bool = False) -> list[list]:
        """What the shell would send ``identity`` now (its credit window permitting), message by message."""
        out = []
        while True:
            got = self.router.pending_send(identity)
            if got is None:
                break
            messages, nbytes = got
            out.extend(messages)
            self.router.sent(identity, len(messages), nbytes)
            if credit:
                self.consume(identity, Credit(nbytes))
        return out

    def receive(self, identity: bytes, credit: bool = False) -> list:
        return [decode(m, shm=self.shm) for m in self.receive_frames(identity, credit)]

    def producer_messages(self, identity: bytes = P, kind: type | None = None) -> list:
        got = self.to_producers.pop(identity, [])
        return [m for m in got if kind is None or isinstance(m, kind)]

    @property
    def totals(self) -> dict:
        return self.router.stats(self.now)["totals"]


def start(rid: str, epoch: int = 1, **kw) -> StreamStart:
    return StreamStart(rid, "prod", epoch, 0, **kw)


def rows_of(rid: str, step: int, n: int) -> np.ndarray:
    """The rows a request holds at a step: every value names (request, step, row), so any mix-up shows."""
    base = (hash(rid) % 1000) * 1000 + step * 10
    return np.stack([np.full(HIDDEN, base + r, np.float32) for r in range(n)])


def step_batch(step: int, seqs: dict[str, int], rows: dict[str, int] | None = None, epoch: int = 1,
               nbytes_per_row: int = HIDDEN * 4) -> StepBatch:
    ids = list(seqs)
    rows = rows or {rid: 1 for rid in ids}
    n = [rows[r] for r in ids]
    width = nbytes_per_row // 4
    hs = np.concatenate([np.tile(rows_of(r, step, rows[r]), (1, width // HIDDEN)) for r in ids])[None]
    group = RowGroup(np.arange(len(ids)), n, np.arange(sum(n)), [Tensor.from_array("hs", hs, layers=(3,))])
    return StepBatch("prod", epoch, step, ids, [seqs[r] for r in ids], groups=[group])


def token_batch(step: int, seqs: dict[str, int], epoch: int = 1) -> TokenBatch:
    ids = list(seqs)
    return TokenBatch("prod", epoch, step, ids, [seqs[r] for r in ids],
                      token_ids=[step * 100 + i for i in range(len(ids))])


def per_request(messages: list) -> dict[str, list[tuple]]:
    """Per request, what a consumer got in order: (kind, seq) and, for a gap, (gap, reason, seqs)."""
    out: dict[str, list[tuple]] = collections.defaultdict(list)
    for m in messages:
        if isinstance(m, (StepBatch, TokenBatch, AnalysisBatch)):
            for rid, seq in zip(m.request_ids, m.seqs.tolist()):
                out[rid].append((m.KIND, seq))
        elif isinstance(m, (GapNotice, GapBatch)):
            for g in (m.notices() if isinstance(m, GapBatch) else [m]):
                out[g.request_id].append(("gap", g.reason, [s for a, b in g.missing for s in range(a, b + 1)]))
        elif hasattr(m, "seq"):
            out[m.request_id].append((m.KIND, m.seq))
    return out


def check_rows(batch: StepBatch) -> None:
    """Each request's rows in a (possibly selected, possibly compacted) step batch are its own, bit-exact."""
    for rid in batch.request_ids:
        (frame,) = batch.segment(rid)
        want = rows_of(rid, batch.step, len(frame.positions))
        got = frame.tensor("hs").numpy()[0]
        np.testing.assert_array_equal(got[:, :HIDDEN], want)


@pytest.fixture
def ring_dir(tmp_path):
    return str(tmp_path)


# ---------------------------------------------------------------------------------------------- demux


def test_requests_are_demuxed_by_id_and_glob():
    bus = Bus()
    bus.subscribe(b"all", "*")
    bus.subscribe(b"alpha", "alpha-*")
    bus.subscribe(b"one", "beta-1")
    for ident, epoch, rids in ((P, 1, ("alpha-0", "beta-0")), (Q, 2, ("alpha-1", "beta-1"))):
        for rid in rids:
            bus.produce(start(rid, epoch), ident)
            bus.produce(TokenFrame(rid, "prod", epoch, 1, 0, [5]), ident)
            bus.produce(StreamEnd(rid, "prod", epoch, 2), ident)
    got = {c: per_request(bus.receive(c)) for c in (b"all", b"alpha", b"one")}
    assert sorted(got[b"all"]) == ["alpha-0", "alpha-1", "beta-0", "beta-1"]
    assert sorted(got[b"alpha"]) == ["alpha-0", "alpha-1"]
    assert sorted(got[b"one"]) == ["beta-1"]
    for seen in got.values():
        for events in seen.values():
            assert events == [("start", 0), ("tokens", 1), ("end", 2)]


def test_a_columnar_message_goes_whole_to_a_consumer_matching_all_and_as_a_selection_to_one_matching_some():
    bus = Bus()
    rids = [f"r-{i}" for i in range(10)]
    bus.subscribe(b"all", "*")
    bus.subscribe(b"few", "r-3", "r-7")
    bus.subscribe(b"few-too", "r-[37]")  # matches the same requests: gets the same selection
    bus.subscribe(b"none", "other-*")
    for rid in rids:
        bus.produce(start(rid))
    frames = bus.produce(step_batch(5, {rid: 1 for rid in rids}, rows={rid: 1 + i % 3 for i, rid in enumerate(rids)}))
    whole = bus.receive_frames(b"all")[-1]
    assert whole is frames or all(a is b for a, b in zip(whole, frames))  # the received frames, not a copy
    few = bus.receive_frames(b"few")[-1]
    few_too = bus.receive_frames(b"few-too")[-1]
    assert all(a is b for a, b in zip(few, few_too))  # one selection for both
    assert bus.totals["selections"] == 1
    sel = decode(few)
    assert sel.request_ids == ["r-3", "r-7"] and sel.seqs.tolist() == [1, 1] and sel.step == 5
    header = decode_header(few)
    assert "row0" not in header["groups"][0]  # inline selection: compacted to just its rows
    check_rows(sel)
    check_rows(decode(whole))
    assert sum(len(f) for f in few) < sum(len(f) for f in frames) // 3  # only its rows' bytes travel
    assert [m.KIND for m in bus.receive(b"none")] == []
    toks = bus.produce(token_batch(5, {rid: 2 for rid in rids}))
    assert bus.receive_frames(b"all")[-1][1] is toks[1]
    tsel = decode(bus.receive_frames(b"few")[-1])
    assert tsel.request_ids == ["r-3", "r-7"] and tsel.token_ids.tolist() == [503, 507]


def test_each_request_keeps_its_seq_order_whatever_mix_of_messages_carries_it():
    bus = Bus()
    bus.subscribe(b"c", "*")
    bus.subscribe(b"odd", "r-1", "r-3")
    rids = ["r-0", "r-1", "r-2", "r-3"]
    seq = {rid: 0 for rid in rids}

    def nxt(rid):
        seq[rid] += 1
        return seq[rid]

    for rid in rids:
        bus.produce(start(rid))
    for step in range(6):
        if step % 2:  # per-request messages for some, a batch for the others
            for rid in rids[:2]:
                bus.produce(TensorFrame(rid, "prod", 1, nxt(rid), step))
            bus.produce(step_batch(step, {rid: nxt(rid) for rid in rids[2:]}))
        else:
            bus.produce(step_batch(step, {rid: nxt(rid) for rid in rids}))
        bus.produce(token_batch(step, {rid: nxt(rid) for rid in rids}))
    for rid in rids:
        bus.produce(StreamEnd(rid, "prod", 1, nxt(rid)))
    for ident, want in ((b"c", rids), (b"odd", ["r-1", "r-3"])):
        got = per_request(bus.receive(ident))
        assert sorted(got) == want
        for rid in want:
            assert [s for _, s in got[rid]] == list(range(seq[rid] + 1)), rid


def test_a_producer_batch_is_routed_message_by_message():
    bus = Bus()
    bus.subscribe(b"c", "*")
    bus.produce(encode_batch([encode(start("a")), encode(step_batch(0, {"a": 1})), [b"a\0", b"\xc1"],
                              encode(StreamEnd("a", "prod", 1, 2))]))
    assert per_request(bus.receive(b"c"))["a"] == [("start", 0), ("step_batch", 1), ("end", 2)]
    assert bus.totals["malformed"] == 1 and bus.totals["batches_in"] == 1
    assert [m.code for m in bus.producer_messages(kind=ErrorNotice)] == ["malformed"]


# ---------------------------------------------------------------------------------------------- loss


def test_a_full_queue_drops_tensors_first_and_names_every_lost_seq_of_every_request():
    budget = 4096
    bus = Bus(consumer_queue_bytes=budget)
    bus.subscribe(b"slow", "*", window_bytes=0)
    bus.subscribe(b"fast", "*")
    rids = ["a", "b", "c"]
    for rid in rids:
        bus.produce(start(rid))
    bus.receive(b"fast")
    # nothing is drained for "slow": its queue fills with step batches; tokens use the reserve
    for step in range(1, 21):
        bus.produce(step_batch(step, {rid: 2 * step - 1 for rid in rids}, nbytes_per_row=1024))
        bus.produce(token_batch(step, {rid: 2 * step for rid in rids}))
        bus.receive(b"fast")  # the fast consumer keeps up: it loses nothing
    for rid in rids:
        bus.produce(StreamEnd(rid, "prod", 1, 41))
    slow = per_request(bus.receive(b"slow"))
    dropped = bus.router.stats(bus.now)["consumers"]["slow"]["dropped"]
    assert dropped > 0
    for rid in rids:
        events = slow[rid]
        delivered = [s for e in events if e[0] != "gap" for s in [e[1]]]
        lost = [s for e in events if e[0] == "gap" for s in e[2]]
        assert {e[1] for e in events if e[0] == "gap"} == {"consumer_queue_full"}
        assert sorted(delivered + lost) == list(range(42)) and not set(delivered) & set(lost)
        assert all(s % 2 == 1 for s in lost)  # only step batches (odd seqs) were dropped, never tokens
        assert delivered == sorted(delivered)
        gap_at = next(i for i, e in enumerate(events) if e[0] == "gap")
        assert events[gap_at - 1][1] < min(lost)  # the gap comes before the stream's next message after the loss
    assert dropped == 3 * len([s for e in slow["a"] if e[0] == "gap" for s in e[2]])
    assert bus.totals["dropped_for_consumers"] == dropped
    fast = per_request(bus.receive(b"fast"))
    assert all(not [e for e in bus_events if e[0] == "gap"] for bus_events in fast.values())


def _lossy_run(bus: Bus, rids: list[str], steps: int = 20) -> None:
    """Starts, ``steps`` step batches (1 KiB a row) and token batches of ``rids`` and their ends, nothing
    drained for the consumers: what they cannot queue is dropped for them."""
    for rid in rids:
        bus.produce(start(rid))
    for step in range(1, steps + 1):
        bus.produce(step_batch(step, {rid: 2 * step - 1 for rid in rids}, nbytes_per_row=1024))
        bus.produce(token_batch(step, {rid: 2 * step for rid in rids}))
    for rid in rids:
        bus.produce(StreamEnd(rid, "prod", 1, 2 * steps + 1))


def _gap_messages(messages: list) -> list:
    return [m for m in messages if isinstance(m, (GapNotice, GapBatch))]


def test_drops_pending_for_a_subset_subscriber_go_as_one_gap_batch_naming_only_its_requests():
    bus = Bus(consumer_queue_bytes=4096)
    bus.subscribe(b"subset", "a*")
    rids = ["a1", "b1", "a2", "b2", "a3"]
    _lossy_run(bus, rids)
    got = bus.receive(b"subset")
    events = per_request(got)
    assert set(events) == {"a1", "a2", "a3"}
    gaps = _gap_messages(got)
    assert gaps and all(isinstance(g, GapBatch) for g in gaps)
    assert all(g.request_ids == ["a1", "a2", "a3"] and g.reason == "consumer_queue_full" and g.origin == "broker"
               for g in gaps)
    lost_total = 0
    for rid in ("a1", "a2", "a3"):
        delivered = [e[1] for e in events[rid] if e[0] != "gap"]
        lost = [s for e in events[rid] if e[0] == "gap" for s in e[2]]
        assert lost and sorted(delivered + lost) == list(range(42)) and not set(delivered) & set(lost), rid
        assert delivered == sorted(delivered)
        for i, e in enumerate(events[rid]):  # each gap comes before the request's next message after the loss
            if e[0] == "gap":
                assert all(later[1] > max(e[2]) for later in events[rid][i + 1:] if later[0] != "gap")
        lost_total += len(lost)
    consumer = bus.router.stats(bus.now)["consumers"]["subset"]
    assert consumer["dropped"] == consumer["gaps_notified"] == lost_total
    assert consumer["pending_gaps"] == 0
    assert bus.totals["gap_batches"] == len(gaps)


def test_a_consumer_of_schema_2_0_gets_a_gap_notice_per_request_instead():
    bus = Bus(consumer_queue_bytes=4096)
    frames = encode(Subscribe(["*"], consumer_id="old"))
    header = msgpack.unpackb(frames[1], raw=False)
    header["v"] = [2, 0]  # an older consumer: it does not know gap_batch
    bus.consume(b"old", [frames[0], msgpack.packb(header, use_bin_type=True)])
    bus.subscribe(b"new", "*")
    _lossy_run(bus, ["a", "b", "c"])
    old, new = bus.receive(b"old"), bus.receive(b"new")
    assert _gap_messages(old) and all(isinstance(g, GapNotice) for g in _gap_messages(old))
    assert _gap_messages(new) and all(isinstance(g, GapBatch) for g in _gap_messages(new))
    assert per_request(old) == per_request(new)  # the same gaps, at the same places of each request's stream


def test_an_unsubscribe_forgets_the_pending_drops_of_the_requests_it_removes():
    bus = Bus(consumer_queue_bytes=4096)
    bus.subscribe(b"c", "a", "b")
    for rid in ("a", "b"):
        bus.produce(start(rid))
    for step in range(1, 8):
        bus.produce(step_batch(step, {"a": step, "b": step}, nbytes_per_row=1024))
    assert bus.router.stats(bus.now)["consumers"]["c"]["pending_gaps"] > 0
    bus.consume(b"c", Unsubscribe(["b"]))
    bus.produce(StreamEnd("a", "prod", 1, 8))
    bus.produce(StreamEnd("b", "prod", 1, 8))
    got = per_request(bus.receive(b"c"))
    assert [e for e in got["b"] if e[0] == "gap"] == []  # b's drops are not announced after it unsubscribed
    lost = [s for e in got["a"] if e[0] == "gap" for s in e[2]]
    assert lost and sorted(lost + [e[1] for e in got["a"] if e[0] != "gap"]) == list(range(9))


def test_stale_ring_messages_of_several_requests_become_one_gap_batch(ring_dir):
    ring = ShmRingWriter(size=1 << 20, min_bytes=1024, directory=ring_dir)
    bus = Bus(shm=ShmRingReader(directory=ring_dir, writable=True))
    try:
        bus.prove(ring)
        bus.subscribe(b"reader", "*", shm=True)
        for rid in ("a", "b", "c"):
            bus.produce(start(rid))
        for step in range(1, 11):  # the first steps end more than half a ring behind the writer
            bus.produce(step_batch(step, {"a": step, "b": step, "c": step}, nbytes_per_row=32 << 10), ring=ring)
        got = bus.receive(b"reader")
    finally:
        ring.close()
    (gap,) = _gap_messages(got)
    assert isinstance(gap, GapBatch) and gap.request_ids == ["a", "b", "c"] and gap.reason == "shm_overrun"
    events = per_request(got)
    lost = [s for e in events["a"] if e[0] == "gap" for s in e[2]]
    assert lost and all(e == [("gap", "shm_overrun", lost)] + [("step_batch", s) for s in range(lost[-1] + 1, 11)]
                        for e in (events[r][1:] for r in ("a", "b", "c")))
    consumer = bus.router.stats(bus.now)["consumers"]["reader"]
    assert consumer["dropped"] == consumer["gaps_notified"] == bus.totals["shm_stale_dropped"] == 3 * len(lost)


def test_a_ring_message_larger_than_half_the_ring_is_delivered_not_dropped_as_stale(ring_dir):
    """An all-layer prompt step can fill most of the producer's ring. Measured from its start, the writer was
    more than half a ring past it the moment it was written, and the broker dropped it as stale for every
    consumer (the CPU benchmark of 2026-12-06: each request's 283 MB prompt step lost in a 512 MiB ring). Its room
    is measured from its end now: it arrives, and so do the small steps after it (small messages far behind are
    still dropped as before: the test above)."""
    ring = ShmRingWriter(size=1 << 20, min_bytes=1024, directory=ring_dir)
    ring.max_bytes = ring.size  # as the engine's host ring, whose chunks are a step's rows whatever their size
    bus = Bus(shm=ShmRingReader(directory=ring_dir, writable=True))
    try:
        bus.prove(ring)
        bus.subscribe(b"reader", "*", shm=True)
        bus.produce(start("a"))
        bus.produce(step_batch(1, {"a": 1}, nbytes_per_row=600 << 10), ring=ring)  # 0.59 of the ring
        for step in range(2, 5):  # small steps after it: 3 x 16 KiB, within the room it leaves
            bus.produce(step_batch(step, {"a": step}, nbytes_per_row=16 << 10), ring=ring)
        got = per_request(bus.receive(b"reader"))["a"]
    finally:
        ring.close()
    assert got[1:] == [("step_batch", s) for s in range(1, 5)]
    assert bus.totals.get("shm_stale_dropped", 0) == 0


def _seq_view(messages: list) -> dict:
    """``per_request`` with each gap split into its seqs (how gaps are grouped into messages left out)."""
    return {rid: [g for e in events for g in ([("gap", e[1], x) for x in e[2]] if e[0] == "gap" else [e])]
            for rid, events in per_request(messages).items()}


def _old_subscribe(bus: Bus, identity: bytes, *patterns: str, **options) -> None:
    """Subscribe as a schema 2.0 consumer (it does not know gap_batch)."""
    frames = encode(Subscribe(list(patterns), consumer_id=identity.decode(), **options))
    header = msgpack.unpackb(frames[1], raw=False)
    header["v"] = [2, 0]
    bus.consume(identity, [frames[0], msgpack.packb(header, use_bin_type=True)])


def test_a_producers_gap_notices_in_a_row_reach_a_consumer_as_one_gap_batch_each_group():
    bus = Bus()
    bus.subscribe(b"all", "*")
    bus.subscribe(b"subset", "a", "c")
    _old_subscribe(bus, b"old", "*")
    rids = ["a", "b", "c"]
    for rid in rids:
        bus.produce(start(rid))
    bus.produce(step_batch(1, {rid: 1 for rid in rids}))
    notices = [GapNotice("a", "prod", 1, [[2, 3]], "queue_full", "producer", 30),
               GapNotice("b", "prod", 1, [[2, 2]], "queue_full", "producer", 20),
               GapNotice("c", "prod", 1, [[2, 3]], "queue_full", "producer", 40),
               GapNotice("b", "prod", 1, [[3, 3]], "queue_full", "producer", 50),  # "b" again: merged
               GapNotice("a", "prod", 1, [[4, 4]], "aperture_full", "producer", 60)]  # another reason
    gap_frames = [encode(n) for n in notices]
    bus.produce(encode_batch([*gap_frames, encode(step_batch(5, {rid: 5 for rid in rids}))]))
    got = {ident: bus.receive(ident) for ident in (b"all", b"subset", b"old")}
    *_, batch, lone, step = got[b"all"]
    assert isinstance(batch, GapBatch) and isinstance(lone, GapNotice) and isinstance(step, StepBatch)
    assert (batch.request_ids, batch.reason, batch.origin, batch.time_ns) == (rids, "queue_full", "producer", 20)
    assert batch.ranges() == [[[2, 3]], [[2, 2], [3, 3]], [[2, 3]]]
    assert (lone.request_id, lone.missing, lone.reason) == ("a", [[4, 4]], "aperture_full")
    *_, batch, lone, step = got[b"subset"]
    assert batch.request_ids == ["a", "c"] and batch.ranges() == [[[2, 3]], [[2, 3]]]
    # an older consumer gets the notices as the producer sent them; the same seqs, at the same places
    assert [encode(m) for m in got[b"old"][-6:-1]] == gap_frames
    assert _seq_view(got[b"old"]) == _seq_view(got[b"all"])
    assert bus.totals["producer_gaps_batched"] == 4 + 2  # "all" (a, b twice, c) and "subset" (a, c)

    # a late join replays the buffered notices: they come as a gap batch too, before what follows them
    bus.subscribe(b"late", "*", from_start=True)
    late = bus.receive(b"late")
    assert _seq_view(late) == _seq_view(got[b"all"])
    assert [type(m) for m in late[-3:]] == [GapBatch, GapNotice, StepBatch]


def _dropped_step(bus: Bus, rids: list, seq: int, reason: str = "queue_full", identity: bytes = P,
                  epoch: int = 1, time_ns: int = 77) -> GapBatch:
    """What a publisher sends for a step batch it dropped: one GapBatch naming the seq of each request."""
    gap = GapBatch.of("prod", epoch, [(rid, [[seq, seq]]) for rid in rids], reason, "producer", time_ns)
    bus.produce(gap, identity)
    return gap


def test_the_broker_heartbeat_says_producers_may_send_gap_batches():
    bus = Bus()
    bus.produce(Heartbeat("prod", "producer", 1, 0, {}))
    assert all(h.stats["gap_batch"] is True for h in bus.producer_messages(kind=Heartbeat))


def test_a_producers_gap_batch_is_each_of_its_requests_gap_notice_in_order_and_per_subscriber():
    bus = Bus()
    bus.subscribe(b"all", "*")
    bus.subscribe(b"subset", "a", "c")
    _old_subscribe(bus, b"old", "*")
    rids = ["a", "b", "c"]
    for rid in rids:
        bus.produce(start(rid))
    bus.produce(step_batch(1, {rid: 1 for rid in rids}))
    sent = _dropped_step(bus, rids, 2)
    bus.produce(step_batch(3, {rid: 3 for rid in rids}))
    got = {ident: bus.receive(ident) for ident in (b"all", b"subset", b"old")}
    # a 2.1 consumer of every request gets the producer's message as it was sent (no copy, no re-encoding)
    gaps = _gap_messages(got[b"all"])
    assert len(gaps) == 1 and encode(gaps[0]) == encode(sent)
    # a subset subscriber gets a selection naming only its requests
    (subset,) = _gap_messages(got[b"subset"])
    assert isinstance(subset, GapBatch) and subset.request_ids == ["a", "c"] and subset.ranges() == [[[2, 2]]] * 2
    assert (subset.reason, subset.origin, subset.time_ns) == ("queue_full", "producer", 77)
    # a 2.0 consumer gets a GapNotice per request
    old = _gap_messages(got[b"old"])
    assert all(type(g) is GapNotice for g in old) and [g.request_id for g in old] == rids
    # each in place: after seq 1, before seq 3, for every consumer
    want = {rid: [("start", 0), ("step_batch", 1), ("gap", "queue_full", [2]), ("step_batch", 3)] for rid in rids}
    assert per_request(got[b"all"]) == per_request(got[b"old"]) == want
    assert per_request(got[b"subset"]) == {rid: want[rid] for rid in ("a", "c")}
    st = bus.router.stats(bus.now)
    assert st["producers"]["prod/1"]["gaps_reported"] == sent.count
    assert st["totals"]["producer_gap_batches"] == 1 and "gap_for_unknown_stream" not in st["totals"]


def test_a_producers_gap_batch_for_streams_it_does_not_know_is_counted_per_request():
    bus = Bus()
    bus.subscribe(b"c", "*")
    bus.produce(start("a"))
    bus.produce(StreamEnd("a", "prod", 1, 1))
    bus.produce(start("b"))
    _dropped_step(bus, ["a", "b", "x"], 1)  # a has ended, x never started
    (gap,) = _gap_messages(bus.receive(b"c"))
    assert isinstance(gap, GapBatch) and gap.request_ids == ["b"]
    assert bus.totals["gap_for_unknown_stream"] == 2


def test_a_late_joiner_learns_a_producers_gap_batch_from_the_buffer():
    bus = Bus(late_join_bytes=4096)  # small: the step batches are evicted, the gaps stay
    rids = ["a", "b", "c"]
    for rid in rids:
        bus.produce(start(rid))
    for step in range(1, 9):
        if step % 3 == 0:
            _dropped_step(bus, rids, step)
        else:
            bus.produce(step_batch(step, {rid: step for rid in rids}, nbytes_per_row=1024))
    assert bus.totals["evicted"]
    bus.subscribe(b"late", "a", "b", from_start=True)
    _old_subscribe(bus, b"old", "*", from_start=True)
    late, old = bus.receive(b"late"), bus.receive(b"old")
    for got, names in ((late, ["a", "b"]), (old, rids)):
        events = _seq_view(got)
        assert sorted(events) == names
        for rid in names:
            lost = sorted(e[2] for e in events[rid] if e[0] == "gap" and e[1] == "queue_full")
            assert lost == [3, 6]  # each dropped seq named exactly once
            seqs = [e[1] if e[0] != "gap" else e[2] for e in events[rid]]
            assert sorted(seqs) == list(range(9))  # with what was evicted, every seq is accounted for
    # the buffer kept each gap batch once: the late joiner gets them as selections, not per request
    assert [m.request_ids for m in late if isinstance(m, GapBatch) and m.reason == "queue_full"] == [["a", "b"]] * 2
    assert not any(isinstance(m, GapBatch) for m in old)


def test_a_producers_gap_batch_for_a_stream_not_started_yet_is_held_with_its_parts():
    # After a broker restart the gaps of a re-announced stream can arrive before its start.
    bus = Bus()
    bus.subscribe(b"c", "*")
    bus.produce(start("a"))
    bus.produce(step_batch(1, {"a": 1, "b": 1}))  # b's start has not come: b is held
    _dropped_step(bus, ["a", "b"], 2)
    got = bus.receive(b"c")
    assert [(m.KIND, m.request_ids if hasattr(m, "request_ids") else m.request_id) for m in got] == [
        ("start", "a"), ("step_batch", ["a"]), ("gap_batch", ["a"])]
    bus.produce(StreamStart("b", "prod", 1, 0, resent=True))
    assert per_request(bus.receive(b"c"))["b"] == [("start", 0), ("step_batch", 1), ("gap", "queue_full", [2])]


def test_a_consumer_is_flushed_before_anything_is_dropped_for_it():
    bus = Bus(consumer_queue_bytes=4096, flush=True)
    bus.subscribe(b"c", "*")
    bus.produce(start("a"))
    for step in range(1, 30):
        bus.produce(step_batch(step, {"a": step}, nbytes_per_row=1024))
    got = per_request([decode(m) for m in bus.flushed[b"c"] + bus.receive_frames(b"c")])["a"]
    assert got == [("start", 0)] + [("step_batch", s) for s in range(1, 30)]
    assert bus.totals.get("dropped_for_consumers", 0) == 0


def test_a_slow_consumer_loses_only_its_own_messages():
    bus = Bus(consumer_queue_bytes=8192)
    bus.subscribe(b"slow", "*", window_bytes=2048)  # credits nothing until the end: its window stays full
    bus.subscribe(b"fast", "*", window_bytes=2048)
    bus.produce(start("a"))
    fast = []
    for step in range(1, 40):
        bus.produce(step_batch(step, {"a": step}, nbytes_per_row=512))
        fast += bus.receive(b"fast", credit=True)
    bus.produce(StreamEnd("a", "prod", 1, 40))
    fast += bus.receive(b"fast", credit=True)
    slow_frames = bus.receive_frames(b"slow")
    assert len(slow_frames) <= 4  # its window holds a few messages; the rest waited or was dropped
    bus.consume(b"slow", Credit(sum(len(f) for m in slow_frames for f in m)))
    slow = per_request([decode(m) for m in slow_frames] + bus.receive(b"slow", credit=True))["a"]
    assert [e[1] for e in per_request(fast)["a"]] == list(range(41))
    lost = [s for e in slow if e[0] == "gap" for s in e[2]]
    delivered = [e[1] for e in slow if e[0] != "gap"]
    assert lost and sorted(delivered + lost) == list(range(41)) and delivered == sorted(delivered)
    assert bus.router.stats(bus.now)["consumers"]["fast"]["dropped"] == 0


def test_credit_bounds_what_is_in_flight():
    bus = Bus()
    bus.subscribe(b"c", "*", window_bytes=3000)
    bus.produce(start("a"))
    for step in range(1, 11):
        bus.produce(step_batch(step, {"a": step}, nbytes_per_row=1024))
    first = bus.receive_frames(b"c")
    in_flight = sum(len(f) for m in first for f in m)
    assert len(first) < 11 and in_flight - sum(len(f) for f in first[-1]) < 3000  # each went below the window
    assert bus.router.pending_send(b"c") is None  # the window is full: nothing more until credit
    bus.consume(b"c", Credit(in_flight))
    rest = bus.receive_frames(b"c", credit=True)
    assert [m.seqs.tolist()[0] for m in map(decode, first[1:] + rest)] == list(range(1, 11))


def test_ring_messages_left_too_far_behind_their_writer_become_a_gap_per_request(ring_dir):
    ring = ShmRingWriter(size=1 << 20, min_bytes=1024, directory=ring_dir)
    bus = Bus(shm=ShmRingReader(directory=ring_dir, writable=True))
    try:
        bus.prove(ring)
        bus.subscribe(b"reader", "*", shm=True)
        bus.produce(start("a"))
        bus.produce(start("b"))
        for step in range(1, 11):  # 10 x 128 KiB: the first ones end more than half a ring behind the writer
            bus.produce(step_batch(step, {"a": step, "b": step}, nbytes_per_row=64 << 10), ring=ring)
        got = bus.receive(b"reader")
    finally:
        ring.close()
    events = per_request(got)
    for rid in ("a", "b"):
        lost = [s for e in events[rid] if e[0] == "gap" for s in e[2]]
        assert {e[1] for e in events[rid] if e[0] == "gap"} == {"shm_overrun"}
        assert lost == [1, 2, 3, 4, 5, 6]  # > half a ring (512 KiB) behind the end (1280 KiB)
        assert [e[1] for e in events[rid] if e[0] == "step_batch"] == [7, 8, 9, 10]
    assert bus.totals["shm_stale_dropped"] == 12
    for m in got:
        if isinstance(m, StepBatch):
            check_rows(m)


# ---------------------------------------------------------------------------------------------- rings


def test_ring_bytes_overwritten_before_the_broker_inlines_them_are_a_gap_per_request(ring_dir):
    ring = ShmRingWriter(size=1 << 20, min_bytes=1024, directory=ring_dir)
    bus = Bus(shm=ShmRingReader(directory=ring_dir, writable=True))
    try:
        bus.prove(ring)
        for rid in ("a", "b"):
            bus.produce(start(rid))
        for step in range(1, 13):  # 12 x 128 KiB through a 1 MiB ring: steps 1-4 are overwritten by the end
            bus.produce(step_batch(step, {"a": step, "b": step}, nbytes_per_row=64 << 10), ring=ring)
        bus.subscribe(b"inline", "*", from_start=True)  # the broker must copy the bytes out for it
        got = bus.receive(b"inline")
    finally:
        ring.close()
    events = per_request(got)
    for rid in ("a", "b"):
        lost = [s for e in events[rid] if e[0] == "gap" for s in e[2]]
        assert {e[1] for e in events[rid] if e[0] == "gap"} == {"shm_overrun"}
        assert lost == [1, 2, 3, 4]
        assert [e[1] for e in events[rid] if e[0] == "step_batch"] == list(range(5, 13))
    assert all(g.origin == "broker" for g in got if isinstance(g, GapNotice))
    for m in got:
        if isinstance(m, StepBatch):
            assert "shm_ring" not in decode_header(encode(m))
            check_rows(m)




def test_ring_messages_go_whole_or_selected_to_ring_readers_and_compacted_inline_to_the_others(ring_dir):
    ring = ShmRingWriter(size=4 << 20, min_bytes=1024, directory=ring_dir)
    bus = Bus(shm=ShmRingReader(directory=ring_dir, writable=True))
    rids = [f"r-{i}" for i in range(10)]
    try:
        bus.prove(ring)
        for ident, pattern, shm in ((b"ring-all", "*", True), (b"ring-one", "r-4", True),
                                    (b"inline-all", "*", False), (b"inline-one", "r-4", False)):
            bus.subscribe(ident, pattern, shm=shm)
        for rid in rids:
            bus.produce(start(rid))
        consumers = (b"ring-all", b"ring-one", b"inline-all", b"inline-one")
        for c in consumers:
            bus.receive(c)
        before = {n: c["delivered_bytes"] for n, c in bus.router.stats(bus.now)["consumers"].items()}
        frames = bus.produce(step_batch(1, {rid: 1 for rid in rids}, rows={rid: 2 for rid in rids},
                                        nbytes_per_row=4096), ring=ring)
        payload = 20 * 4096
        assert ring.received == ring.written == payload  # noted in the ring's header
        got = {c: bus.receive_frames(c)[-1] for c in consumers}
        weights = {n: c["delivered_bytes"] - before[n] for n, c in bus.router.stats(bus.now)["consumers"].items()}
        assert got[b"ring-all"][1] is frames[1]
        one = decode_header(got[b"ring-one"])
        assert one["request_ids"] == ["r-4"] and one["shm_ring"] == ring.name
        assert one["groups"][0]["row0"] and one["groups"][0]["stored_rows"] == 20  # ring refs untouched
        for c in (b"inline-all", b"inline-one"):
            assert "shm_ring" not in decode_header(got[c])
        # a selection weighs its rows' share of the ring payload; inline consumers their frames
        assert weights["ring-all"] - sum(len(f) for f in frames) == payload
        assert weights["ring-one"] - sum(len(f) for f in got[b"ring-one"]) == payload * 2 // 20
        assert weights["inline-one"] == sum(len(f) for f in got[b"inline-one"]) < payload // 5
        for c, m in got.items():
            batch = decode(m, shm=bus.shm)
            assert batch.request_ids == (rids if c.endswith(b"all") else ["r-4"])
            check_rows(batch)
    finally:
        ring.close()


def test_ring_references_are_accepted_only_from_the_producer_that_proved_it_owns_the_ring(ring_dir):
    victim = ShmRingWriter(size=1 << 20, min_bytes=1024, directory=ring_dir)
    bus = Bus(shm=ShmRingReader(directory=ring_dir, writable=True), ring_grace_s=0.1)
    forger = b"forger/9"
    try:
        bus.subscribe(b"c", "*", shm=True)
        bus.prove(victim)
        bus.produce(start("v"))
        ones = Tensor.from_array("hs", np.ones((1, 1, 1024), np.float32))
        bus.produce(TensorFrame("v", "prod", 1, 1, 0, tensors=[ones]), ring=victim)
        assert victim.received == 4096
        victim.put(np.zeros(8192, np.uint8))  # written, not yet sent: received must not move past 4096
        forged = encode(TensorFrame("f", "forge", 9, 1, 0, tensors=[
            Tensor.from_array("hs", np.ones((1, 1, 1024), np.float32))]), shm=victim)  # names the victim's ring
        bus.produce(encode(start("f", epoch=9)), forger)
        bus.produce(forged, forger)  # unproven: waits for the forger's next heartbeat
        assert bus.totals["held_for_ring_proof"] == 1
        bad_proof = {"ring": victim.name, "secret": "00" * 16}
        stats = {SHM_RING_PROOF_KEY: bad_proof, SHM_RING_CLOSED_KEY: victim.name}
        bus.produce(Heartbeat("forge", "producer", 9, 0, stats), forger)
        totals = bus.totals
        assert totals["shm_ring_proof_refused"] == 1 and totals["shm_ring_not_owned"] == 1
        assert totals["shm_ring_handover_refused"] == 1 and "shm_rings_handed_over" not in totals
        assert victim.received == 4096
        # later references from the forger are refused at once, a handover of the ring too
        bus.produce(forged, forger)
        bus.produce(Heartbeat("forge", "producer", 9, 0, {SHM_RING_CLOSED_KEY: victim.name}), forger)
        assert bus.totals["shm_ring_not_owned"] == 2 and bus.totals["shm_ring_handover_refused"] == 2
        errors = [m.code for m in bus.producer_messages(forger, ErrorNotice)]
        assert errors.count("shm_ring_not_owned") == 3  # the bad proof and both references
        replies = bus.producer_messages(forger, Heartbeat)
        assert not any(SHM_RING_TAKEN_KEY in h.stats for h in replies)
        for _ in range(10):
            bus.tick(0.1)
        assert "shm_rings_removed" not in bus.totals
        import os

        assert os.path.exists(victim.path)
        got = per_request(bus.receive(b"c"))
        assert [e[0] for e in got["f"]] == ["start"]  # the forged frame reached no one
        assert got["v"] == [("start", 0), ("tensors", 1)]
        # the owner's own handover is taken
        bus.produce(Heartbeat("prod", "producer", 1, 0, {SHM_RING_CLOSED_KEY: victim.name}))
        assert any(h.stats.get(SHM_RING_TAKEN_KEY) == victim.name for h in bus.producer_messages(P, Heartbeat))
    finally:
        victim.close()


def test_a_ring_reference_before_the_owners_proof_waits_for_it_in_order(ring_dir):
    ring = ShmRingWriter(size=1 << 20, min_bytes=1024, directory=ring_dir)
    bus = Bus(shm=ShmRingReader(directory=ring_dir, writable=True))
    try:
        bus.subscribe(b"c", "*", shm=True)
        bus.produce(start("a"))
        bus.produce(step_batch(1, {"a": 1}, nbytes_per_row=4096), ring=ring)  # e.g. after a broker restart
        bus.produce(TokenFrame("a", "prod", 1, 2, 1, [7]))  # inline, but behind the held one
        assert [m.KIND for m in bus.receive(b"c")] == ["start"]
        bus.prove(ring)  # its next heartbeat
        got = bus.receive(b"c")
        assert [(m.KIND, m.seqs.tolist()[0] if m.KIND == "step_batch" else m.seq) for m in got] == [
            ("step_batch", 1), ("tokens", 2)]
        check_rows(got[0])
        # a producer that never proves it: its references are refused after the wait, the rest flows
        other = ShmRingWriter(size=1 << 20, min_bytes=1024, directory=ring_dir)
        try:
            bus.produce(step_batch(2, {"a": 3}, nbytes_per_row=4096), ring=other)
            bus.produce(TokenFrame("a", "prod", 1, 4, 2, [8]))
            bus.tick(1.0)
            assert [m.KIND for m in bus.receive(b"c")] == []
            bus.tick(1.1)
            assert [m.KIND for m in bus.receive(b"c")] == ["tokens"]
            assert bus.totals["shm_ring_not_owned"] == 1
        finally:
            other.close()
    finally:
        ring.close()


# ---------------------------------------------------------------------------------------------- late join


def test_late_join_from_start_replays_columnar_parts_as_selections_and_names_evictions():
    bus = Bus(late_join_bytes=6 * 1024)
    rids = ["a", "b", "c"]
    for rid in rids:
        bus.produce(start(rid))
    for step in range(1, 11):
        bus.produce(step_batch(step, {rid: 2 * step - 1 for rid in rids}, nbytes_per_row=1024))
        bus.produce(token_batch(step, {rid: 2 * step for rid in rids}))
    bus.subscribe(b"ab", "a", "b", from_start=True)
    bus.subscribe(b"c", "c", from_start=True)
    ab = bus.receive(b"ab")
    c = bus.receive(b"c")
    for got, want in ((ab, ["a", "b"]), (c, ["c"])):
        for m in got:
            if isinstance(m, (StepBatch, TokenBatch)):
                assert m.request_ids == want  # one selection per message, naming the joined requests
            if isinstance(m, StepBatch):
                check_rows(m)
    for rid, got in (("a", ab), ("b", ab), ("c", c)):
        events = per_request(got)[rid]
        assert events[0] == ("start", 0)
        assert events[1][:2] == ("gap", "evicted_from_late_join_buffer")
        evicted = events[1][2]
        assert evicted == [1, 3, 5, 7, 9, 11, 13][:len(evicted)] and len(evicted) >= 4  # the oldest tensor parts
        delivered = [e[1] for e in events[2:]]
        assert sorted(delivered + evicted) == list(range(1, 21)) and delivered == sorted(delivered)
    bus.produce(step_batch(11, {rid: 21 for rid in rids}))  # then live, as one selection
    assert decode(bus.receive_frames(b"ab")[-1]).request_ids == ["a", "b"]


def test_the_late_join_total_evicts_the_oldest_tensor_parts_of_all_streams_at_a_constant_cost():
    """Past ``late_join_total_bytes`` the globally oldest tensor parts go first, whichever stream holds them;
    streams whose buffers were emptied long ago cost nothing per message (they used to be scanned every
    time, which made a broker at its cap fall behind its consumers)."""
    bus = Bus(late_join_bytes=1 << 30, late_join_total_bytes=64 * 1024)
    old = [f"old{i}" for i in range(200)]  # early streams, all their tensor parts evicted later
    for rid in old:
        bus.produce(start(rid))
    bus.produce(step_batch(1, {rid: 1 for rid in old}, nbytes_per_row=1024))
    live = ["x", "y"]
    for rid in live:
        bus.produce(start(rid))
    router = bus.router
    calls = []
    orig = router.streams.evict_one
    router.streams.evict_one = lambda st: calls.append(st.key[0]) or orig(st)
    for step in range(1, 40):
        calls.clear()
        bus.produce(step_batch(step, {rid: step for rid in live}, nbytes_per_row=1024))
        assert router.buffered_bytes <= 64 * 1024 + 2 * 1024
        assert len(calls) <= 4, f"step {step}: {len(calls)} evictions tried for 2 new parts"
    assert all(not router.streams.by_key[(rid, "prod", 1)].data for rid in old)  # the oldest went first
    bus.subscribe(b"late", "x", from_start=True)
    events = per_request(bus.receive(b"late"))["x"]
    evicted = events[1][2] if events[1][:2] == ("gap", "evicted_from_late_join_buffer") else []
    delivered = [e[1] for e in events if e[0] == "step_batch"]
    assert evicted and delivered and max(evicted) < min(delivered)  # x lost its oldest parts, kept its newest


def test_a_live_join_gets_the_start_and_a_joined_late_gap():
    bus = Bus()
    bus.produce(start("a"))
    for step in range(1, 6):
        bus.produce(step_batch(step, {"a": step}))
    bus.subscribe(b"c", "a")
    bus.produce(step_batch(6, {"a": 6}))
    assert per_request(bus.receive(b"c"))["a"] == [("start", 0), ("gap", "joined_late", [1, 2, 3, 4, 5]),
                                                   ("step_batch", 6)]


def test_parts_of_a_stream_not_started_yet_are_held_until_its_start_comes():
    # After a broker restart a producer's batches can arrive before the re-announced starts.
    bus = Bus()
    bus.subscribe(b"c", "*")
    bus.produce(start("a"))
    bus.producer_messages()
    bus.produce(step_batch(1, {"a": 1, "b": 4}))  # b's start has not come
    assert [h.stats["known"] for h in bus.producer_messages(kind=Heartbeat)] == [False]  # asked to re-announce
    bus.produce(token_batch(1, {"a": 2, "b": 5}))
    assert bus.producer_messages(kind=Heartbeat) == []  # asked once per new stream, not per message
    got = bus.receive(b"c")
    assert [(m.KIND, m.request_ids if hasattr(m, "request_ids") else m.request_id) for m in got] == [
        ("start", "a"), ("step_batch", ["a"]), ("token_batch", ["a"])]
    bus.produce(StreamStart("b", "prod", 1, 0, resent=True))
    got = bus.receive(b"c")
    assert [(m.KIND, getattr(m, "request_ids", None)) for m in got] == [
        ("start", None), ("step_batch", ["b"]), ("token_batch", ["b"])]
    check_rows(got[1])
    bus.produce(StreamStart("b", "prod", 1, 0, resent=True))
    assert bus.totals["duplicate_starts"] == 1


def test_parts_whose_start_never_comes_are_dropped_and_counted():
    bus = Bus(producer_timeout_s=5)
    bus.subscribe(b"c", "*")
    bus.produce(step_batch(1, {"x": 3, "y": 3}))
    for _ in range(12):
        bus.tick(0.5)
        bus.produce(Heartbeat("prod", "producer", 1))
    assert bus.totals["orphan_messages"] == 2
    assert bus.receive(b"c") == [] and bus.router.stats(bus.now)["streams"] == {}


def test_after_its_end_a_stream_takes_nothing_more():
    bus = Bus(late_join_linger_s=1)
    bus.subscribe(b"c", "*")
    bus.produce(start("a"))
    bus.produce(StreamEnd("a", "prod", 1, 1))
    bus.produce(step_batch(2, {"a": 2}))
    bus.tick(2)
    bus.produce(TokenFrame("a", "prod", 1, 3, 2))
    assert bus.totals["after_end"] == 2
    assert [m.KIND for m in bus.receive(b"c")] == ["start", "end"]


# ---------------------------------------------------------------------------------------------- producers


def test_two_tp_ranks_are_two_streams_of_one_request():
    bus = Bus()
    bus.subscribe(b"c", "r")
    for ident, epoch in ((P, 1), (Q, 2)):
        bus.produce(StreamStart("r", "prod", epoch, 0, tp_rank=epoch - 1, tp_size=2), ident)
    for step in range(1, 4):
        for ident, epoch in ((Q, 2), (P, 1)):
            bus.produce(step_batch(step, {"r": step}, epoch=epoch), ident)
    got = bus.receive(b"c")
    by_rank = collections.defaultdict(list)
    for m in got:
        by_rank[m.epoch].append(m.seqs.tolist()[0] if isinstance(m, StepBatch) else m.seq)
    assert by_rank == {1: [0, 1, 2, 3], 2: [0, 1, 2, 3]}
    streams = bus.router.stats(bus.now)["streams"]
    assert sorted(streams) == ["r|prod|1", "r|prod|2"]


def test_a_silent_producer_ends_its_open_streams_as_producer_lost():
    bus = Bus(producer_timeout_s=3)
    bus.subscribe(b"c", "*")
    bus.produce(start("a"))
    bus.produce(step_batch(1, {"a": 1}))
    bus.produce(start("b"))
    bus.produce(StreamEnd("b", "prod", 1, 1))
    bus.tick(2)
    assert bus.totals.get("producers_lost", 0) == 0
    bus.tick(1.5)
    got = bus.receive(b"c")
    end = [m for m in got if isinstance(m, StreamEnd) and m.request_id == "a"][0]
    assert end.finish_reason == "producer_lost" and end.seq == 2 and "prod/1" in end.error
    assert bus.totals["producers_lost"] == 1
    assert [m.request_id for m in got if isinstance(m, StreamEnd)] == ["b", "a"]  # b had ended on its own


# ---------------------------------------------------------------------------------------------- steering


def test_steering_commands_reach_the_owner_and_acks_come_back():
    bus = Bus()
    bus.produce(start("mine"))
    bus.produce(StreamStart("other", "prod", 2, 0), Q)
    bus.producer_messages(P)
    bus.producer_messages(Q)
    bus.consume(b"steerer", SteeringCommand("c1", "mine", "add", ops=[{"layer": 1}]))
    (cmd,) = bus.producer_messages(P, SteeringCommand)
    assert cmd.command_id == "c1" and cmd.sender == "steerer" and bus.producer_messages(Q, SteeringCommand) == []
    bus.produce(SteeringAck("c1", "mine", True, applied_step=9, steering_version=1, producer_id="prod"))
    (ack,) = bus.receive(b"steerer")
    assert ack.ok and ack.applied_step == 9
    bus.produce(SteeringAck("c1", "mine", True))
    assert bus.totals["unmatched_acks"] == 1


def test_steering_goes_to_every_rank_or_the_control_peer_and_their_acks_merge():
    bus = Bus()
    for ident, epoch in ((P, 1), (Q, 2)):
        bus.produce(StreamStart("r", "prod", epoch, 0, tp_rank=epoch - 1, tp_size=2), ident)
    bus.consume(b"s", SteeringCommand("c1", "r", "clear"))
    assert len(bus.producer_messages(P, SteeringCommand)) == len(bus.producer_messages(Q, SteeringCommand)) == 1
    bus.produce(SteeringAck("c1", "r", True, applied_step=4, steering_version=2, tp_rank=0), P)
    assert bus.receive(b"s") == []  # waits for rank 1
    bus.produce(SteeringAck("c1", "r", False, error="bad layer", tp_rank=1), Q)
    (ack,) = bus.receive(b"s")
    assert not ack.ok and "rank 1: bad layer" in ack.error
    control = b"sched/5"
    bus.produce(Heartbeat("sched", "producer", 5), control)
    bus.produce(StreamStart("w", "worker", 3, 0, control_id="sched"), b"worker/3")
    bus.consume(b"s", SteeringCommand("c2", "w", "clear"))
    assert [c.command_id for c in bus.producer_messages(control, SteeringCommand)] == ["c2"]
    assert bus.producer_messages(b"worker/3", SteeringCommand) == []


def test_steering_refusals_unknown_unreachable_duplicate_and_timeout():
    bus = Bus(steer_timeout_s=5)
    bus.produce(start("r"))
    bus.consume(b"s", SteeringCommand("c0", "nobody", "clear"))
    bus.unreachable.add(P)
    bus.consume(b"s", SteeringCommand("c1", "r", "clear"))
    bus.unreachable.clear()
    bus.consume(b"s", SteeringCommand("c2", "r", "clear"))
    bus.consume(b"s", SteeringCommand("c2", "r", "clear"))
    bus.tick(6)
    errors = [a.error.split(":")[0] for a in bus.receive(b"s")]
    assert errors == ["unknown_request", "producer_unreachable", "duplicate_command", "timeout"]
    off = Bus(steering=False)
    off.produce(start("r"))
    off.consume(b"s", SteeringCommand("c", "r", "clear"))
    assert off.receive(b"s")[0].error.startswith("steering_disabled")
    assert off.producer_messages(kind=SteeringCommand) == []


# ---------------------------------------------------------------------------------------------- analysis


def analysis(seqs: dict[str, int], step: int = 0) -> AnalysisBatch:
    ids = list(seqs)
    return AnalysisBatch("probe", 3, "probe", ids, [seqs[r] for r in ids], rows=[2] * len(ids),
                         values={"score": np.arange(2 * len(ids), dtype=np.float32)}, step=step)


def test_analysis_streams_are_delivered_from_their_first_message_buffered_and_forgotten_with_their_request():
    bus = Bus(late_join_linger_s=2)
    bus.subscribe(b"all", "*")
    bus.subscribe(b"b", "b")
    bus.produce(start("a"))
    bus.produce(start("b"))
    analyzer = b"probe/3"
    bus.produce(analysis({"a": 0, "b": 0}), analyzer)  # no start: delivered at once
    got = bus.receive(b"all")
    assert got[-1].KIND == "analysis" and got[-1].request_ids == ["a", "b"]
    sel = bus.receive(b"b")[-1]
    assert sel.request_ids == ["b"] and sel.values["score"].tolist() == [2.0, 3.0]
    bus.produce(analysis({"a": 1, "b": 1}), analyzer)
    bus.subscribe(b"late", "a", from_start=True)  # buffered with the request
    assert per_request(bus.receive(b"late"))["a"] == [("start", 0), ("analysis", 0), ("analysis", 1)]
    bus.produce(StreamEnd("a", "prod", 1, 1))
    bus.produce(analysis({"a": 2}), analyzer)  # after the request's end: still delivered
    assert bus.receive(b"all")[-1].request_ids == ["a"]
    bus.tick(1)
    assert "a|probe|3" in bus.router.stats(bus.now)["streams"]
    bus.tick(1.5)  # a's stream is forgotten; its analysis stream goes once quiet as long
    bus.tick(0.6)
    streams = bus.router.stats(bus.now)["streams"]
    assert "a|prod|1" not in streams and "a|probe|3" not in streams
    assert "b|probe|3" in streams  # its request is still live


# ---------------------------------------------------------------------------------------------- bad input


_TENSOR_VARIANTS = {
    "float nbytes": lambda h: h["tensors"][0].__setitem__("nbytes", 32.0),
    "float raw_nbytes": lambda h: h["tensors"][0].__setitem__("raw_nbytes", 32.0),
    "float shape element": lambda h: h["tensors"][0].__setitem__("shape", [1, 1, 8.0]),
    "str in shape": lambda h: h["tensors"][0].__setitem__("shape", [1, "1", 8]),
    "bool in shape": lambda h: h["tensors"][0].__setitem__("shape", [True, 1, 8]),
    "int name": lambda h: h["tensors"][0].__setitem__("name", 3),
    "str in layers": lambda h: h["tensors"][0].__setitem__("layers", ["0"]),
    "str step": lambda h: h.__setitem__("step", "0"),
}


def mutated_tensor_frame(mutate, seq: int = 1) -> list:
    ones = Tensor.from_array("hs", np.ones((1, 1, 8), np.float32))
    frames = encode(TensorFrame("a", "prod", 1, seq, 0, tensors=[ones]))
    header = msgpack.unpackb(frames[1])
    mutate(header)
    return [frames[0], msgpack.packb(header), *frames[2:]]


@pytest.mark.parametrize("variant", sorted(_TENSOR_VARIANTS))
def test_headers_consumers_would_refuse_are_refused_never_forwarded(variant):
    bus = Bus()
    bus.subscribe(b"c", "*")
    bus.produce(start("a"))
    bus.produce(mutated_tensor_frame(_TENSOR_VARIANTS[variant]))
    assert bus.totals["malformed"] == 1 and bus.totals["malformed_from_producers"] == 1
    assert [m.code for m in bus.producer_messages(kind=ErrorNotice)] == ["malformed"]
    assert [m.KIND for m in bus.receive(b"c")] == ["start"]


def test_major_version_1_peers_are_refused():
    bus = Bus()
    frames = encode(start("a"))
    header = msgpack.unpackb(frames[1])
    header["v"] = [1, 3]
    bus.produce([frames[0], msgpack.packb(header)])
    bus.consume(b"old", [b"", msgpack.packb({"v": [1, 2], "kind": "subscribe", "patterns": ["*"]})])
    assert bus.totals["schema_version"] == 2
    assert [m.code for m in bus.direct[b"old"]] == ["schema_version"]


def test_error_notices_are_rate_limited_for_every_peer_known_or_not():
    bus = Bus()
    bus.subscribe(b"known", "*")
    for _ in range(100):
        bus.consume(b"stranger", [b"", b"\xc1garbage"])
        bus.consume(b"known", [b"", b"\xc1garbage"])
        bus.produce([b"", b"\xc1garbage"], b"junk/1")
    assert len(bus.direct[b"stranger"]) == 20
    assert len([m for m in bus.receive(b"known") if isinstance(m, ErrorNotice)]) == 20
    assert len(bus.producer_messages(b"junk/1", ErrorNotice)) == 20
    assert bus.totals["malformed"] == 300 and bus.totals["error_notices_suppressed"] == 240
    bus.tick(1.0)  # a new second: 20 more
    for _ in range(30):
        bus.consume(b"stranger", [b"", b"\xc1garbage"])
    assert len(bus.direct[b"stranger"]) == 40


def test_consumers_may_not_send_stream_messages_and_unsubscribe_stops_delivery():
    bus = Bus()
    bus.subscribe(b"c", "a*")
    bus.consume(b"c", start("a"))
    assert bus.totals["unexpected_kind"] == 1
    bus.produce(start("a1"))
    bus.consume(b"c", Unsubscribe(["a*"]))
    bus.produce(step_batch(1, {"a1": 1}))
    got = bus.receive(b"c")
    assert [m.KIND for m in got] == ["error", "start"]
