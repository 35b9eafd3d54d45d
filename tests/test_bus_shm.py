"""Shared-memory tensor payloads (spec section 9): large buffers go through the producer's ring, not the broker.

Real /dev/shm files, real broker processes and real ipc sockets; the spec-only decoder reads the ring too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import numpy as np
import pytest

import spec_decoder
from bus_helpers import (account, assert_exact, events_until, kill, payload, processes, publish_stream, run_dir,
                         start_broker, stats, wait_for)
from mia_stream.consumers import open_stream
from mia_stream.errors import MalformedFrameError, ShmOverrunError, ShmUnavailableError
from mia_stream.bus.publisher import FramePublisher
from mia_stream.schemas import Tensor, TensorFrame, decode, decode_header, encode, inline_shm, shm_extent
from mia_stream.bus.shm_ring import ShmRingReader, ShmRingWriter, shm_available, sweep_stale_rings

def _shm_free_bytes() -> int:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


# The rings here are at most 64 MiB; a publisher's default 256 MiB ring falls back to inline without room.
pytestmark = pytest.mark.skipif(not shm_available() or _shm_free_bytes() < 256 << 20,
                                reason="needs a writable /dev/shm with 256 MiB free")


@contextmanager
def _ring_publisher(address: str, producer_id: str, shm_bytes: int, **options):
    """A publisher with a ring, once the broker has said it takes ring references; closed on exit."""
    pub = FramePublisher(address, producer_id=producer_id, shm_bytes=shm_bytes, **options)
    try:
        wait_for(lambda: pub.broker_shm, timeout=10)
        yield pub
    finally:
        pub.close()


def _frame(seq: int, *tensors: Tensor) -> TensorFrame:
    return TensorFrame("r", "p", 1, seq, seq, positions=[seq], token_ids=[seq], tensors=list(tensors))


def test_ring_payloads_decode_bit_exact_by_the_code_and_by_the_spec():
    rng = np.random.default_rng(0)
    big32 = rng.standard_normal((2, 1, 4096)).astype(np.float32)
    big16 = rng.standard_normal((2, 1, 4096)).astype(np.float16)
    small = rng.standard_normal((1, 1, 8)).astype(np.float32)
    ring = ShmRingWriter(size=1 << 20, min_bytes=16 << 10)
    reader = ShmRingReader()
    try:
        msg = _frame(0, Tensor.from_array("hs", big32, layers=(0, 1)), Tensor.from_array("q", small, layers=(0,)),
                     Tensor.from_array("k", big16, layers=(0, 1)))
        frames = encode(msg, shm=ring)
        header = decode_header(frames)
        assert len(frames) == 3  # topic, header and the small tensor's buffer: the big two are in the ring
        assert header["shm_ring"] == ring.name and shm_extent(header)[2] == big32.nbytes + big16.nbytes
        got = decode(frames, shm=reader)
        for t, want in zip(got.tensors, (big32, small, big16)):
            assert np.array_equal(t.numpy(), want)
        by_spec = spec_decoder.decode(frames)
        for t, want in zip(by_spec.tensors, (big32, small, big16)):
            assert np.array_equal(t.values, want)
        inline = inline_shm(frames, reader)  # what a recorder or a peer on another host gets
        assert len(inline) == 5 and "shm_ring" not in decode_header(inline)
        assert all(np.array_equal(t.numpy(), w) for t, w in zip(decode(inline).tensors, (big32, small, big16)))
        with pytest.raises(ShmUnavailableError, match="ShmRingReader"):
            decode(frames)  # a decoder without a ring reader says what it needs
    finally:
        ring.close()
        reader.close()
    assert not os.path.exists(ring.path)


def test_overwritten_bytes_are_refused_never_returned_torn():
    ring = ShmRingWriter(size=1 << 20, min_bytes=1024)
    reader = ShmRingReader()
    try:
        first = encode(_frame(0, Tensor.from_array("hs", np.full((1, 1, 65536), 1.0, np.float32))), shm=ring)
        assert np.all(decode(first, shm=reader).tensors[0].numpy() == 1.0)
        for seq in range(1, 5):  # 4 x 256 KiB more: the writer reserves past first's bytes + 1 MiB
            encode(_frame(seq, Tensor.from_array("hs", np.full((1, 1, 65536), float(seq), np.float32))), shm=ring)
        copied = reader.bytes_copied
        with pytest.raises(ShmOverrunError, match="overwritten"):
            decode(first, shm=reader)
        assert reader.bytes_copied == copied  # known lost before the copy: not copied (a reader far behind
        # its writer must not spend its time copying what it will discard)
        with pytest.raises(spec_decoder.SpecDecodeError, match="shm_overrun"):
            spec_decoder.decode(first)
        with pytest.raises(ShmUnavailableError, match="past what ring"):  # only the ring shows it: lost (spec 9)
            reader.read(ring.name, ring.written, 1024)  # nothing was written there yet
        with pytest.raises(MalformedFrameError, match="not a shared-memory ring name"):
            reader.read("../../etc/passwd", 0, 8)  # a header cannot make a consumer open arbitrary files
        with pytest.raises(ShmUnavailableError, match="outside ring"):
            reader.read(ring.name, (1 << 20) - 16, 64)
    finally:
        ring.close()
        reader.close()


def test_the_ring_of_a_killed_producer_is_swept_and_a_live_one_is_not():
    child = subprocess.Popen([sys.executable, "-c", "from mia_stream.bus.shm_ring import ShmRingWriter\n"
                              "r = ShmRingWriter(size=1 << 20)\nprint(r.path, flush=True)\n"
                              "import time; time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    live = ShmRingWriter(size=1 << 20)
    try:
        path = child.stdout.readline().strip()
        assert os.path.exists(path)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        assert os.path.exists(path)  # SIGKILL: nothing in the child removed it
        assert sweep_stale_rings() >= 1
        assert not os.path.exists(path) and os.path.exists(live.path)
    finally:
        live.close()
        if child.poll() is None:
            child.kill()


def test_large_frames_skip_the_broker_and_arrive_bit_exact_for_ring_and_inline_consumers():
    n, nbytes = 24, 512 << 10  # a 12 MiB burst: within a quarter of the 64 MiB ring, so the source drops none
    with run_dir() as d, processes() as procs:
        procs.append(start_broker(d))
        with open_stream(d, patterns=("big-*",), timeout=20, consumer_id="reads-rings") as ring_side, \
                open_stream(d, patterns=("big-*",), timeout=20, consumer_id="inline", shm=False) as inline_side:
            wait_for(lambda: len(stats(d)["consumers"]) >= 2, timeout=10)
            with _ring_publisher(d, "shm", 64 << 20) as pub:
                publish_stream(pub, "big-0", frames=n, nbytes=nbytes)
                assert pub.flush(10)
                got_ring = account(events_until(ring_side, 1, 30))["big-0"]
                got_inline = account(events_until(inline_side, 1, 30))["big-0"]
                ring_bytes = pub.shm_ring.bytes
            st = stats(d)
    for rec in (got_ring, got_inline):
        assert_exact(rec)  # every seq delivered once, each tensor filled with its own seq
        assert rec["gap_seqs"] == [] and rec["steps"] == list(range(n))
    totals = st["totals"]
    assert ring_bytes == n * nbytes and totals["shm_bytes_in"] == n * nbytes
    assert totals["shm_inlined"] == n  # once per frame for the consumer that said it cannot read rings
    producer = next(v for k, v in st["producers"].items() if k.startswith("shm/"))
    assert producer["bytes"] < n * 4096  # through the broker's socket: headers only


def test_a_consumer_too_slow_for_the_ring_is_told_exactly_which_frames_it_lost():
    # A ring of 8 MiB and a consumer that reads nothing until 40 frames of 1 MiB were written: the first ones
    # were overwritten. It must get gaps (reason shm_overrun) for those, and correct bytes for the rest.
    n = 40
    with run_dir() as d, processes() as procs:
        procs.append(start_broker(d))
        with open_stream(d, patterns=("slow-*",), timeout=20) as events:
            wait_for(lambda: len(stats(d)["consumers"]) >= 1, timeout=10)
            # no bound on how far the producer runs ahead of the broker: every frame must reach the broker here
            # (the bound has its own test below)
            with _ring_publisher(d, "slow", 8 << 20, shm_ahead_bytes=0) as pub:
                publish_stream(pub, "slow-0", frames=n, nbytes=1 << 20)
                assert pub.flush(10)
                wait_for(lambda: stats(d)["totals"].get("shm_bytes_in", 0) >= n << 20, timeout=10)
                rec = account(events_until(events, 1, 30))["slow-0"]
    assert_exact(rec)
    assert set(rec["gap_reasons"]) == {"shm_overrun"}
    # Frame seq s lies at (s - 1) MiB; the writer ends at 40 MiB. Seqs 1-32 lie more than a ring behind it:
    # overwritten, lost whoever finds out (the broker, or this consumer when it reads them). Seqs 37-40 are at
    # most half a ring behind: always delivered. Seqs 33-36 depend on when the broker flushed to this
    # consumer: sent while less than half a ring behind, they are read intact; queued longer, the broker drops
    # them as stale (under load it flushes between the producer's writes, so these need not be contiguous).
    lost = set(rec["gap_seqs"])
    assert set(range(1, 33)) <= lost <= set(range(1, 37))
    assert set(range(37, 41)) <= set(rec["seqs"])


@pytest.mark.parametrize("bounded", [True, False], ids=["bounded", "unbounded"])
def test_a_producer_drops_at_its_source_rather_than_run_a_ring_ahead_of_its_broker(bounded):
    # The broker is stopped (SIGSTOP) while 64 frames of 256 KiB, two laps of an 8 MiB ring, are published.
    # Bounded (the default: a quarter of the ring past what the broker noted in the ring's header as received),
    # the producer writes 9 frames (the bound, plus the frame that crossed it) and drops the rest at its source,
    # announced; the 9 stay readable and arrive bit-exact. Unbounded, it writes all 64 and most of them are
    # overwritten before the broker even sees them.
    n, nbytes, ring = 64, 256 << 10, 8 << 20
    with run_dir() as d, processes() as procs:
        broker = start_broker(d)
        procs.append(broker)
        with open_stream(d, patterns=("ahead-*",), timeout=20) as events:
            wait_for(lambda: len(stats(d)["consumers"]) >= 1, timeout=10)
            with _ring_publisher(d, "ahead", ring, shm_ahead_bytes=None if bounded else 0) as pub:
                assert pub.broker_shm_received  # the broker said it keeps the ring's received field
                broker.send_signal(signal.SIGSTOP)
                try:
                    publish_stream(pub, "ahead-0", frames=n, nbytes=nbytes)
                    time.sleep(0.2)
                finally:
                    broker.send_signal(signal.SIGCONT)
                assert pub.flush(10)
                rec = account(events_until(events, 1, 30))["ahead-0"]
                drops = pub.drops_for("ahead-0")
                received, written = pub.shm_ring.received, pub.shm_ring.written
    assert_exact(rec)  # either way, every seq is delivered or reported lost
    if bounded:
        kept = ring // 4 // nbytes + 1
        assert drops == {"shm_ahead_of_broker": n - kept}
        assert rec["steps"] == list(range(kept)) and set(rec["gap_reasons"]) == {"shm_ahead_of_broker"}
        assert received == written == kept * nbytes  # the broker noted every payload it received
    else:
        assert drops == {} and written == n * nbytes
        assert "shm_overrun" in rec["gap_reasons"] and len(rec["steps"]) < n // 2


def test_the_source_bound_starts_over_with_a_restarted_broker():
    # Broker A is stopped while a burst fills the bound, then killed with those frames in flight: it never
    # noted them as received. The publisher must count from its last queued position again as soon as it
    # sees broker B (a new instance), not drop every frame as "ahead" of a broker that will never get them
    # (its stall fallback would take 3 s; B's stream must flow within 2).
    nbytes, ring = 256 << 10, 8 << 20
    with run_dir() as d, processes() as procs:
        broker_a = start_broker(d)
        procs.append(broker_a)
        with _ring_publisher(d, "restart", ring) as pub:
            broker_a.send_signal(signal.SIGSTOP)
            publish_stream(pub, "lost-0", frames=20, nbytes=nbytes, end=False)
            assert pub.drops_for("lost-0") == {"shm_ahead_of_broker": 20 - (ring // 4 // nbytes + 1)}
            kill(broker_a, signal.SIGKILL)
            procs.append(start_broker(d))
            with open_stream(d, patterns=("after-*",), timeout=20) as events:
                wait_for(lambda: len(stats(d)["consumers"]) >= 1, timeout=10)
                t_restart = time.monotonic()
                wait_for(lambda: pub.broker_shm_received and pub.stats()["shm_bytes_ahead_of_broker"] == 0,
                         timeout=2)
                assert time.monotonic() - t_restart < 2.0
                publish_stream(pub, "after-0", frames=8, nbytes=nbytes)
                assert pub.flush(10)
                rec = account(events_until(events, 1, 30))["after-0"]
            assert pub.drops_for("after-0") == {}
            assert pub.stats().get("shm_ahead_resets", 0) == 0  # the instance change did it, not the stall
    assert_exact(rec)
    assert rec["gap_seqs"] == [] and rec["steps"] == list(range(8))


def test_a_recording_made_through_a_real_broker_keeps_the_bytes_not_the_ring_position(tmp_path):
    # producer (ring) -> broker process -> `mia-stream record` process, which reads the ring itself
    # (Subscribe.shm on ipc); the recording must decode, bit-exact, after the ring was removed.
    from mia_stream.consumers.recording import iter_recording

    n, nbytes, rec_dir = 6, 256 << 10, tmp_path / "rec"
    with run_dir() as d, processes() as procs:
        procs.append(start_broker(d, "--ring-grace", "0.5"))
        recorder = subprocess.Popen([sys.executable, "-m", "mia_stream.cli", "record", str(rec_dir), "--broker", d,
                                     "--flush-interval", "0.1"], stderr=subprocess.PIPE)
        procs.append(recorder)
        wait_for(lambda: len(stats(d)["consumers"]) >= 1, timeout=20)
        with _ring_publisher(d, "rec", 16 << 20) as pub:
            publish_stream(pub, "rec-0", frames=n, nbytes=nbytes)
            assert pub.flush(10)
            ring_bytes, ring_path = pub.shm_ring.bytes, pub.shm_ring.path
        wait_for(lambda: not os.path.exists(ring_path), timeout=10)  # the broker removed it after the grace
        wait_for(lambda: sum(1 for _ in _recorded(rec_dir)) >= n + 2, timeout=20)  # start, frames, end
        recorder.send_signal(signal.SIGTERM)
        assert recorder.wait(10) == 0, recorder.stderr.read()
    assert ring_bytes == n * nbytes  # the frames did go through the ring
    got = [(frames, msg) for frames, msg in iter_recording(rec_dir) if msg.KIND == "tensors"]
    assert len(got) == n
    for frames, msg in got:
        assert "shm_ring" not in decode_header(frames)
        assert np.array_equal(msg.tensors[0].numpy(), payload(msg.seq, nbytes))


def _recorded(rec_dir):
    from mia_stream.consumers.recording import iter_recording

    try:
        yield from iter_recording(rec_dir)
    except Exception:  # the part being written has no footer yet
        return


def test_ring_frames_are_credited_in_full_so_a_small_window_never_stalls():
    # A consumer with a 4 MiB credit window gets 32 frames of 1 MiB through the ring, 8 windows' worth. The
    # broker counts each frame's ring bytes in flight; a consumer that credited only the few hundred bytes it
    # received on its socket would fill the window after 4 frames and wait for the rest for ever.
    n, nbytes = 32, 1 << 20
    with run_dir() as d, processes() as procs:
        procs.append(start_broker(d))
        with open_stream(d, patterns=("credit-*",), timeout=20, consumer_id="small-window",
                         window_bytes=4 << 20) as events:
            wait_for(lambda: len(stats(d)["consumers"]) >= 1, timeout=10)
            # a 32 MiB burst, more than a quarter of the ring: unbounded, so that every frame reaches the broker
            with _ring_publisher(d, "credit", 64 << 20, shm_ahead_bytes=0) as pub:
                publish_stream(pub, "credit-0", frames=n, nbytes=nbytes)
                assert pub.flush(10)
                rec = account(events_until(events, 1, 30))["credit-0"]
            totals = stats(d)["totals"]
    assert_exact(rec)
    assert rec["gap_seqs"] == [] and rec["steps"] == list(range(n))
    assert totals["shm_bytes_in"] == n * nbytes  # they did go through the ring


def test_a_producer_that_exits_at_once_hands_its_ring_to_the_broker_and_nothing_is_lost():
    # The consumer opens the ring only when it reads the first frame, and here that is after the producer has
    # closed. A producer that removed its ring at close cost this consumer every frame (gaps, shm_unavailable);
    # it now hands the ring to the broker, which removes it after --ring-grace.
    n, nbytes = 8, 256 << 10
    with run_dir() as d, processes() as procs:
        procs.append(start_broker(d, "--ring-grace", "3"))
        with open_stream(d, patterns=("exit-*",), timeout=20, consumer_id="late-reader") as events:
            wait_for(lambda: len(stats(d)["consumers"]) >= 1, timeout=10)
            pub = FramePublisher(d, producer_id="exits", shm_bytes=16 << 20)
            wait_for(lambda: pub.broker_shm, timeout=10)
            publish_stream(pub, "exit-0", frames=n, nbytes=nbytes)
            ring_path = pub.shm_ring.path
            pub.close()
            assert os.path.exists(ring_path)  # kept for the grace
            rec = account(events_until(events, 1, 30))["exit-0"]
            totals = stats(d)["totals"]
            wait_for(lambda: not os.path.exists(ring_path), timeout=15)  # then removed by the broker
            removed = stats(d)["totals"].get("shm_rings_removed", 0)
    assert_exact(rec)
    assert rec["gap_seqs"] == [] and rec["steps"] == list(range(n)) and rec["ended"]
    assert totals["shm_bytes_in"] == n * nbytes and totals["shm_rings_handed_over"] == 1
    assert removed == 1


def test_the_broker_removes_only_rings_their_own_producer_handed_over():
    # A producer that names another process's ring as its own closing ring: refused, counted, file untouched;
    # and a publisher whose offer is refused removes its own ring at close.
    from mia_stream.schemas import Heartbeat
    from mia_stream.bus.shm_ring import SHM_RING_CLOSED_KEY

    victim = ShmRingWriter(1 << 20)
    try:
        with run_dir() as d, processes() as procs:
            procs.append(start_broker(d, "--ring-grace", "0.2"))
            pub = FramePublisher(d, producer_id="liar", shm_bytes=0)
            try:
                wait_for(lambda: pub.broker_instance is not None, timeout=10)
                pub.publish(Heartbeat("liar", "producer", pub.epoch, 0, {SHM_RING_CLOSED_KEY: victim.name}))
                wait_for(lambda: stats(d)["totals"].get("shm_ring_handover_refused", 0) == 1, timeout=10)
                time.sleep(1.5)  # several housekeeping rounds past the grace
            finally:
                pub.close()
            assert stats(d)["totals"].get("shm_rings_removed", 0) == 0
            # a publisher that believes this broker took rings (forged here) offers one it never referenced
            pub = FramePublisher(d, producer_id="refused", shm_bytes=1 << 20)
            wait_for(lambda: pub.broker_instance is not None, timeout=10)
            pub._on_broker_heartbeat = lambda hb: None  # keeps broker_shm as set below, and never sees an answer
            pub.broker_shm = True
            pub.shm_ring.put(np.zeros(64 << 10, np.uint8))
            own = pub.shm_ring.path
            pub.close(timeout=0.5)
            assert not os.path.exists(own)
        assert os.path.exists(victim.path)
    finally:
        victim.close()


def test_a_sweep_keeps_a_handed_over_ring_of_an_exited_producer_and_removes_an_abandoned_one():
    make = ("import sys; from mia_stream.bus.shm_ring import ShmRingWriter; w = ShmRingWriter(1 << 20); "
            "w.mark_handed_over() if sys.argv[1] == 'handed' else None; w.close(unlink=False); print(w.path)")
    paths = {kind: subprocess.run([sys.executable, "-c", make, kind], capture_output=True, text=True,
                                  check=True).stdout.strip() for kind in ("handed", "abandoned")}
    try:
        assert all(os.path.exists(p) for p in paths.values())  # their writers' pids are gone now
        sweep_stale_rings()
        assert os.path.exists(paths["handed"]) and not os.path.exists(paths["abandoned"])
    finally:
        for p in paths.values():
            if os.path.exists(p):
                os.unlink(p)
