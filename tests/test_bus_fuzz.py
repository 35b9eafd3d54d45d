"""Bad input never takes the broker down: fuzzed garbage and mutated frames over real sockets,
wrong schema versions and oversized messages are counted and reported, and a good stream still flows."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import numpy as np
import spec_decoder
from bus_helpers import (account, assert_exact, events_until, processes, publish_stream, run_dir, start_broker, stats,
                         wait_for)
from mia_stream.bus import transport
from mia_stream.consumers import open_stream
from mia_stream.errors import WireError
from mia_stream.bus.publisher import FramePublisher
from mia_stream.schemas import (AnalysisBatch, ErrorNotice, Heartbeat, RowGroup, StepBatch, StreamStart, Subscribe,
                                Tensor, TensorFrame, TokenBatch, decode, decode_header, encode, encode_batch,
                                split_batch)
from test_wire_spec import _COLUMNAR, _PER_REQUEST, _outcome


@pytest.fixture(scope="module")
def broker_dir():
    with run_dir() as d, processes() as procs:
        procs.append(start_broker(d, "--max-message-bytes", str(1 << 20)))
        yield d


def _dealer(endpoint: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 100_000)
    s.connect(endpoint)
    return s


def _valid_frames(seq: int) -> list[bytes]:
    arr = np.arange(64, dtype=np.float32).reshape(1, 1, 64)
    msg = TensorFrame("fuzz-req", "fuzzer", 7, seq, seq, tensors=[Tensor.from_array("hs", arr)])
    return [bytes(memoryview(f)) for f in encode(msg)]


def _mutate(frames: list[bytes], data) -> list[bytes]:
    frames = list(frames)
    i = data.draw(st.integers(0, len(frames) - 1))
    op = data.draw(st.sampled_from(["flip", "truncate", "drop", "extra", "header"]))
    if op == "flip" and frames[i]:
        b = bytearray(frames[i])
        j = data.draw(st.integers(0, len(b) - 1))
        b[j] ^= data.draw(st.integers(1, 255))
        frames[i] = bytes(b)
    elif op == "truncate":
        frames[i] = frames[i][: data.draw(st.integers(0, max(0, len(frames[i]) - 1)))]
    elif op == "drop":
        del frames[i]
    elif op == "extra":
        frames.append(data.draw(st.binary(max_size=64)))
    else:
        header = msgpack.unpackb(frames[1])
        key = data.draw(st.sampled_from(sorted(header)))
        header[key] = data.draw(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1), st.text(max_size=8), st.lists(st.integers(0, 2**32)),
                                          st.binary(max_size=8), st.booleans()))
        frames[1] = msgpack.packb(header)
    return frames


_garbage = st.lists(st.binary(max_size=200), min_size=0, max_size=5)


_SOCKETS: dict[str, tuple] = {}


def _fuzz_sockets(address: str) -> tuple:
    if address not in _SOCKETS:
        eps = transport.endpoints_for(address)
        _SOCKETS.clear()
        _SOCKETS[address] = (_dealer(eps.producers), _dealer(eps.consumers))
    return _SOCKETS[address]


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_frames_never_take_the_broker_down(broker_dir, data):
    prod, cons = _fuzz_sockets(broker_dir)
    for _ in range(data.draw(st.integers(1, 5))):
        if data.draw(st.booleans()):
            frames = data.draw(_garbage)
        else:
            frames = _mutate(_valid_frames(data.draw(st.integers(0, 1000))), data)
        target = prod if data.draw(st.booleans()) else cons
        if frames:
            target.send_multipart(frames)


def _serve_an_honest_stream(broker_dir, rid: str, frames: int, nbytes: int, timeout: float) -> None:
    """A valid stream published after the fuzzing arrives whole and exact."""
    pub = FramePublisher(broker_dir, producer_id=f"{rid}-producer")
    try:
        with open_stream(broker_dir, patterns=(rid,), timeout=10) as events:
            time.sleep(0.3)
            publish_stream(pub, rid, frames, nbytes, tokens=True)
            rec = account(events_until(events, 1, timeout))[rid]
    finally:
        pub.close()
    assert_exact(rec)
    assert rec["gap_seqs"] == [] and rec["steps"] == list(range(frames))


def test_after_fuzzing_the_broker_still_serves_a_valid_stream(broker_dir):
    test_fuzzed_frames_never_take_the_broker_down(broker_dir)  # run the fuzzer first (also standalone)
    _serve_an_honest_stream(broker_dir, "honest-1", frames=50, nbytes=4096, timeout=10)
    totals = stats(broker_dir)["totals"]
    assert totals["malformed"] > 0
    assert totals.get("internal_errors", 0) == 0


def _mutated_batch(data) -> list[bytes]:
    """A batch of valid messages with one mutation: in its own header, or in one carried message."""
    messages = [_valid_frames(data.draw(st.integers(0, 1000))) for _ in range(data.draw(st.integers(1, 4)))]
    if data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(messages) - 1))
        messages[i] = _mutate(messages[i], data)
    frames = [bytes(memoryview(f)) for f in encode_batch(messages)]
    if data.draw(st.booleans()):
        header = msgpack.unpackb(frames[1])
        header[data.draw(st.sampled_from(sorted(header)))] = data.draw(st.one_of(
            st.none(), st.integers(-3, 2**32), st.text(max_size=8), st.binary(max_size=8), st.booleans(),
            st.lists(st.one_of(st.integers(-2, 8), st.booleans(), st.none()), max_size=6)))
        frames[1] = msgpack.packb(header)
    return frames


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_batches_never_take_the_broker_down(broker_dir, data):
    prod, cons = _fuzz_sockets(broker_dir)
    (prod if data.draw(st.booleans()) else cons).send_multipart(_mutated_batch(data))


def test_after_fuzzing_batches_the_broker_counts_them_and_still_serves(broker_dir):
    test_fuzzed_batches_never_take_the_broker_down(broker_dir)
    before = stats(broker_dir)["totals"]
    _serve_an_honest_stream(broker_dir, "honest-b-1", frames=2000, nbytes=256, timeout=20)
    totals = stats(broker_dir)["totals"]
    assert before["malformed_batches"] > 0 and before["batches_in"] > 0
    assert totals["batches_in"] > before["batches_in"] and totals["batches_out"] > before.get("batches_out", 0)
    assert totals.get("internal_errors", 0) == 0


def test_wrong_schema_version_and_oversized_are_counted_and_reported(broker_dir):
    eps = transport.endpoints_for(broker_dir)
    before = stats(broker_dir)["totals"]
    prod = _dealer(eps.producers)
    try:
        frames = [bytes(memoryview(f)) for f in encode(StreamStart("v9", "old", 1))]
        header = msgpack.unpackb(frames[1])
        header["v"] = [9, 0]
        prod.send_multipart([frames[0], msgpack.packb(header)])
        # three frames under zmq's per-frame limit but 1.5 MiB together: over the broker's 1 MiB limit
        big = _valid_frames(1)
        prod.send_multipart([big[0], big[1], b"\0" * (1 << 19), b"\0" * (1 << 19), b"\0" * (1 << 19)])
        replies = []
        while prod.poll(2000) and len(replies) < 2:
            msg = decode(prod.recv_multipart())
            if isinstance(msg, ErrorNotice):
                replies.append(msg.code)
    finally:
        prod.close()
    after = stats(broker_dir)["totals"]
    assert sorted(replies) == ["oversized", "schema_version"]
    assert after["schema_version"] == before.get("schema_version", 0) + 1
    assert after["oversized"] == before.get("oversized", 0) + 1


# --- schema 2.0: columnar messages, and the one validator's refusals --------------------------------------------


def _columnar_frames(kind: str, seed: int) -> list[bytes]:
    """A valid columnar message of 0-4 requests (payloads inline, uncompressed, no checksum)."""
    rng = np.random.default_rng(seed)
    r = int(rng.integers(0, 5))
    ids = [f"fz-{seed % 7}-{i}" for i in range(r)]
    seqs = rng.integers(0, 1000, size=r)
    if kind == "step_batch":
        groups = []
        for part in (0, 1):
            members = [i for i in range(r) if rng.random() < 0.6]
            rows = rng.integers(0, 3, size=len(members))
            n = int(rows.sum())
            hs = rng.standard_normal((1, n, 16)).astype(np.float32)
            groups.append(RowGroup(members, rows, np.arange(n), [Tensor.from_array("hs", hs, layers=[0])], part=part))
        msg = StepBatch("fuzzer", 7, seed, ids, seqs, groups)
    elif kind == "token_batch":
        counts = rng.integers(0, 3, size=r)
        msg = TokenBatch("fuzzer", 7, seed, ids, seqs, counts, rng.integers(0, 50000, size=int(counts.sum())))
    else:
        rows = rng.integers(0, 3, size=r)
        n = int(rows.sum())
        msg = AnalysisBatch("fuzz-analyzer", 7, "fuzz", ids, seqs, rows, values={"x": rng.standard_normal(n)},
                            labels={"l": ["a"] * n}, alerts=rng.integers(0, 2, size=n))
    return [bytes(memoryview(f).cast("B")) for f in encode(msg)]


_ANY = st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1), st.booleans(), st.text(max_size=8),
                 st.binary(max_size=24), st.lists(st.one_of(st.integers(-3, 8), st.booleans(), st.none(),
                                                            st.text(max_size=3)), max_size=5),
                 st.dictionaries(st.text(max_size=4), st.integers(-3, 8), max_size=3))
_RING = "mia-stream-ring-1-0123456789ab"  # a valid name no ring has


def _mutate_columnar(frames: list[bytes], data) -> list[bytes]:
    """One or two changes where the columnar rules live: a top-level field, a column's bytes, a group field, a
    tensor entry field, a forged ring reference, a value or label, or the framing."""
    frames = list(frames)
    header = msgpack.unpackb(frames[1], raw=False)
    for _ in range(data.draw(st.integers(1, 2))):
        op = data.draw(st.sampled_from(["field", "column", "group", "entry", "ring", "value", "frames"]))
        groups = header.get("groups") if isinstance(header.get("groups"), list) else []
        if op == "field":
            header[data.draw(st.sampled_from(sorted(header) + ["shm_ring", "extra"]))] = data.draw(_ANY)
        elif op == "column":
            cols = [k for k, v in header.items() if isinstance(v, bytes)]
            if cols:
                k = data.draw(st.sampled_from(sorted(cols)))
                header[k] = data.draw(st.sampled_from([header[k][:-8], header[k] + header[k][:8], header[k][:-1],
                                                       np.full(len(header[k]) // 8, -1, "<i8").tobytes()]))
        elif op == "group" and groups and isinstance(groups[0], dict):
            g = groups[data.draw(st.integers(0, len(groups) - 1))]
            if isinstance(g, dict):
                g[data.draw(st.sampled_from(["part", "requests", "rows", "positions", "token_ids", "tensors",
                                             "row0", "stored_rows"]))] = data.draw(st.one_of(
                    _ANY, st.just(np.arange(3, dtype="<i8").tobytes())))
        elif op in ("entry", "ring") and groups and isinstance(groups[0], dict) and groups[0].get("tensors"):
            e = groups[0]["tensors"][0]
            if isinstance(e, dict) and op == "entry":
                e[data.draw(st.sampled_from(["name", "dtype", "shape", "layers", "raw_nbytes", "nbytes",
                                             "compression", "shard", "scale", "shm", "meta"]))] = data.draw(_ANY)
            elif isinstance(e, dict):  # a forged ring reference: the broker must not trust it
                e["shm"] = data.draw(st.integers(0, 2**40))
                header["shm_ring"] = _RING
                if len(frames) > 2:
                    del frames[2]
        elif op == "value" and isinstance(header.get("values"), dict) and "x" in header["values"]:
            v = header["values"]["x"]
            if isinstance(v, dict):
                v[data.draw(st.sampled_from(["dtype", "shape", "data"]))] = data.draw(_ANY)
        elif op == "frames":
            if data.draw(st.booleans()) or len(frames) <= 2:
                frames.append(data.draw(st.binary(max_size=64)))
            else:
                del frames[-1]
    frames[1] = msgpack.packb(header, use_bin_type=True)
    return frames


@pytest.fixture(scope="module")
def watchers(broker_dir):
    """Two raw consumers (DEALERs, no SDK): one takes everything, one only some requests (so the broker sends it
    selections of columnar messages); one takes batches, one does not; neither reads rings."""
    eps = transport.endpoints_for(broker_dir)
    socks = []
    for patterns, batch in ((["*"], False), (["fz-1-*", "fz-3-0", "honest-*"], True)):
        s = _dealer(eps.consumers)
        s.send_multipart(encode(Subscribe(patterns, from_start=False, consumer_id=f"watch-{batch}", batch=batch)))
        socks.append(s)
    wait_for(lambda: {"watch-False", "watch-True"} <= set(stats(broker_dir)["consumers"]))
    yield socks
    for s in socks:
        s.close()


def _drain(socks) -> list[list[bytes]]:
    """Every message the watchers got so far (batches split), heartbeating so the broker keeps them."""
    got = []
    for s in socks:
        s.send_multipart(encode(Heartbeat(f"watch-{id(s)}", "consumer", id(s))))
        while s.poll(200):
            frames = s.recv_multipart()
            got.extend(split_batch(frames) or [frames])
    return got


def _assert_forwarded_messages_are_valid(messages) -> int:
    """What the broker forwards, its validator passes, and both decoders reach the same outcome on it: the
    message, or a refusal only a payload can cause (an lz4 frame that is not one, a checksum)."""
    forwarded = 0
    for frames in messages:
        header = decode_header(frames)  # raises if the broker forwarded a header its validator refuses
        if header["kind"] in ("heartbeat", "error"):
            continue
        forwarded += 1
        official = _outcome(decode, frames)
        assert official == _outcome(spec_decoder.decode, frames), header
        if official != "ok":
            entries = [e for g in header.get("groups", [{"tensors": header.get("tensors", [])}])
                       for e in g.get("tensors", [])]
            assert official == "checksum" or any(e.get("compression") == "lz4" for e in entries), (official, header)
    return forwarded


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_columnar_messages_never_take_the_broker_down(broker_dir, data):
    prod, cons = _fuzz_sockets(broker_dir)
    messages = []
    for _ in range(data.draw(st.integers(1, 4))):
        frames = _columnar_frames(data.draw(st.sampled_from(["step_batch", "token_batch", "analysis"])),
                                  data.draw(st.integers(0, 1000)))
        messages.append(_mutate_columnar(frames, data) if data.draw(st.integers(0, 3)) else frames)
    target = prod if data.draw(st.integers(0, 4)) else cons
    if len(messages) > 1 and data.draw(st.booleans()):
        target.send_multipart(encode_batch(messages))
    else:
        for m in messages:
            target.send_multipart(m)


def test_after_fuzzing_columnar_messages_the_broker_forwards_only_valid_ones_and_serves(broker_dir, watchers):
    _drain(watchers)
    test_fuzzed_columnar_messages_never_take_the_broker_down(broker_dir)
    time.sleep(0.5)
    forwarded = _assert_forwarded_messages_are_valid(_drain(watchers))
    _serve_an_honest_stream(broker_dir, "honest-c-1", frames=50, nbytes=4096, timeout=10)
    assert _assert_forwarded_messages_are_valid(_drain(watchers)) >= 2 * 102  # the watchers do get what flows
    totals = stats(broker_dir)["totals"]
    assert totals["malformed"] > 0
    assert totals.get("internal_errors", 0) == 0
    print(f"columnar fuzz: {forwarded} messages forwarded to the watchers, all valid")


def _settled_totals(address: str) -> dict:
    """The broker's totals once they stop moving (messages sent before are all handled)."""
    last = None
    for _ in range(40):
        totals = stats(address)["totals"]
        if last is not None and totals == last:
            return totals
        last = totals
        time.sleep(0.1)
    return last


def test_every_refusal_of_the_spec_is_made_by_the_broker_and_nothing_refused_is_forwarded(broker_dir, watchers):
    """Issue 13 items 10 and 13 against a broker process: every malformed case of tests/test_wire_spec.py (the
    header variants the broker used to forward, element types, nil and empty values, ranges, shard geometry,
    ring names, columnar columns and groups) sent to either endpoint is counted malformed once, and none
    reaches a consumer."""
    cases = {**_PER_REQUEST, **_COLUMNAR}
    eps = transport.endpoints_for(broker_dir)
    _drain(watchers)
    before = _settled_totals(broker_dir)
    socks = [_dealer(eps.producers), _dealer(eps.consumers)]
    try:
        for frames in cases.values():
            for s in socks:
                s.send_multipart(frames)
        want = before.get("malformed", 0) + 2 * len(cases)
        wait_for(lambda: stats(broker_dir)["totals"].get("malformed", 0) >= want, timeout=20)
        after = _settled_totals(broker_dir)
    finally:
        for s in socks:
            s.close()
    assert after["malformed"] == want
    assert after.get("internal_errors", 0) == 0
    assert _assert_forwarded_messages_are_valid(_drain(watchers)) == 0


def test_a_ring_payload_that_cannot_be_read_is_a_gap_whose_origin_is_the_reader(broker_dir):
    """Section 9: a valid header naming a ring payload no one can read (its producer's ring, removed before the
    reference is read) is lost, not malformed: a consumer that reads rings itself reports it as a gap with
    origin "consumer", and the broker, which must put the payload inline for a consumer that does not read
    rings, as one with origin "broker"; both name exactly the message's seq, and the stream goes on around it.
    (The producer proved it owns the ring first: the broker takes ring references only from a ring's owner.)"""
    from mia_stream.bus.client import BrokerClient
    from mia_stream.schemas import GapNotice, StreamEnd
    from mia_stream.bus.shm_ring import ShmRingWriter

    rid = "ring-origin"
    readers = {"consumer": BrokerClient(broker_dir, consumer_id="reads-rings", shm=True),
               "broker": BrokerClient(broker_dir, consumer_id="inline-only", shm=False)}
    prod = _dealer(transport.endpoints_for(broker_dir).producers)
    ring = ShmRingWriter(size=1 << 20)
    try:
        for c in readers.values():
            c.subscribe([rid])
        wait_for(lambda: {"reads-rings", "inline-only"} <= set(stats(broker_dir)["consumers"]))
        proven = stats(broker_dir)["totals"].get("shm_rings_proven", 0)
        prod.send_multipart(encode(Heartbeat("forger", "producer", 5, 0, {"shm_ring_proof": ring.ownership_proof()})))
        wait_for(lambda: stats(broker_dir)["totals"].get("shm_rings_proven", 0) == proven + 1)
        ring_name = ring.name
        ring.close()  # removed: no reader can open it now
        prod.send_multipart(encode(StreamStart(rid, "forger", 5)))
        tf = encode(TensorFrame(rid, "forger", 5, 1, 0, tensors=[
            Tensor.from_array("hs", np.ones((1, 1, 8), np.float32), layers=[0])]))
        header = msgpack.unpackb(bytes(tf[1]), raw=False)
        header["tensors"][0]["shm"] = 0
        header["shm_ring"] = ring_name
        prod.send_multipart([tf[0], msgpack.packb(header, use_bin_type=True)])
        prod.send_multipart(encode(StreamEnd(rid, "forger", 5, 2)))
        for origin, client in readers.items():
            got = []
            while not got or not isinstance(got[-1], StreamEnd):
                item = client.recv(timeout=10)
                assert item is not None, (origin, got)
                got.append(item[1])
            assert [m.KIND for m in got] == ["start", "gap", "end"], (origin, got)
            gap = got[1]
            assert isinstance(gap, GapNotice)
            assert (gap.missing, gap.reason, gap.origin) == ([[1, 1]], "shm_unavailable", origin)
    finally:
        prod.close()
        ring.close()
        for c in readers.values():
            c.close()
    assert stats(broker_dir)["totals"].get("internal_errors", 0) == 0
