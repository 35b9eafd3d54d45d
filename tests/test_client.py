"""``StreamClient`` against a real broker (its own thread, real ZeroMQ sockets) with synthetic producers: a
request's stream published like the engine does, and an analyzer's results published like ``mia-stream
analyze --publish`` does, its final result (step -1) after the request's end. No model engine: the served
end-to-end run is tests/test_served.py."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from mia_stream.served.client import StreamClient
from mia_stream.errors import BrokerTimeoutError, MiaStreamError
from mia_stream.bus.publisher import FramePublisher
from mia_stream.schemas import AnalysisBatch, StreamEnd, StreamStart, TokenFrame


def _publish(address: str, rid: str, *, analyzer: str | None, final_delay: float) -> None:
    """``rid``'s start, two token steps (each with the analyzer's result for it), its end, and ``final_delay``
    s later the analyzer's final result."""
    with FramePublisher(address, producer_id="synthetic-engine") as pub, \
            FramePublisher(address, producer_id="analyzer/late") as ana:
        pub.publish(StreamStart(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), prompt_token_ids=[1, 2, 3],
                                time_ns=time.time_ns()))

        def result(step: int, value: float) -> None:
            ana.publish(AnalysisBatch(ana.producer_id, ana.epoch, analyzer, [rid], [ana.next_seq(rid)],
                                      positions=[step + 2 if step >= 0 else -1],
                                      values={"score": np.array([value], np.float32)}, step=step,
                                      time_ns=time.time_ns()))

        for step in range(2):
            pub.publish(TokenFrame(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), step, token_ids=[7 + step],
                                   positions=[3 + step]))
            pub.flush(5)
            if analyzer:
                result(step, 0.25 * step)
                ana.flush(5)
        pub.publish(StreamEnd(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), "length", 2, 2,
                              time_ns=time.time_ns()))
        pub.flush(5)
        time.sleep(final_delay)
        if analyzer:
            result(-1, 0.5)
            ana.flush(5)


def _follow(address: str, rid: str, analyzer: str | None, final_delay: float, idle_timeout: float = 30, **open_kw):
    """Follow ``rid`` with ``StreamClient.open`` (in a thread), publish it once the client subscribed; the
    request and the kinds of the events it gave, or the error it raised."""
    from mia_stream.broker import fetch_stats

    client = StreamClient(broker=address, openai_client=object(), idle_timeout=idle_timeout,
                          stream_options={"consumer_id": f"client-{rid}"})
    req = client.open(rid, **open_kw)
    kinds: list = []
    errors: list = []

    def follow():
        try:
            kinds.extend(ev.kind for ev in req)
        except Exception as e:  # noqa: BLE001 — raised by the caller
            errors.append(e)

    t = threading.Thread(target=follow)
    t.start()
    deadline = time.monotonic() + 60
    while f"client-{rid}" not in fetch_stats(address)["consumers"]:
        assert time.monotonic() < deadline and t.is_alive(), errors
        time.sleep(0.05)
    _publish(address, rid, analyzer=analyzer, final_delay=final_delay)
    t.join(120)
    if errors:
        raise errors[0]
    return req, kinds


def test_analyzers_keeps_the_request_open_for_their_final_results(broker_address):
    req, kinds = _follow(broker_address, "cl-wait", "late", 1.5, analyzers=["late"])
    assert kinds == ["start", "tokens", "analysis", "tokens", "analysis", "end", "analysis"]
    assert [(a.analyzer, a.step, a.positions) for a in req.analyses] == [("late", 0, [2]), ("late", 1, [3]),
                                                                        ("late", -1, [-1])]
    assert req.analyses[-1].value("score").tolist() == [0.5]
    assert req.end.finish_reason == "length"


def test_without_analyzers_the_iteration_ends_at_the_stream_end(broker_address):
    req, kinds = _follow(broker_address, "cl-nowait", "late", 1.5)
    assert kinds == ["start", "tokens", "analysis", "tokens", "analysis", "end"]
    assert [a.step for a in req.analyses] == [0, 1]


def test_an_analyzer_that_sends_no_final_result_is_a_timeout_naming_it(broker_address):
    t0 = time.monotonic()
    with pytest.raises(BrokerTimeoutError, match=r"before the final result of analyzer\(s\) \['absent'\]"):
        _follow(broker_address, "cl-absent", None, 0.0, analyzers="absent", idle_timeout=3)
    assert time.monotonic() - t0 < 30


def test_the_request_machine_alone_sans_io():
    """The sync and async clients' one protocol, fed by hand: streamed chunks become text events (a chunk
    without text is kept, no event), a whole response becomes text then response, the request is over only
    once the response, the stream's end and the awaited final result came, and the end deadline runs from the
    response."""
    from types import SimpleNamespace as NS

    from mia_stream.served._protocol import RequestMachine

    def chunk(text):
        return NS(choices=[NS(delta=NS(content=text))])

    from mia_stream.consumers import EVENT_CLASSES

    def bus(kind, **kw):  # the SDK's own event classes, around a stand-in stream
        stream = NS(request_id="r", end=None)
        if kind == "end":
            kw.setdefault("end", None)
        return EVENT_CLASSES[kind](stream=stream, **kw)

    m = RequestMachine("r", chat=True, keep_frames=False, analyzers=frozenset({"late"}), end_timeout=5.0)
    assert m.wait_time(0.0) is None  # no response yet: no deadline
    m.receive("bus", bus("start"))
    m.receive("chunk", chunk("Hel"))
    m.receive("chunk", chunk(None))
    m.receive("chunk", chunk("lo"))
    m.receive("response", "last")
    kinds = []
    while (ev := m.next_event()) is not None:
        kinds.append((ev.kind, ev.text))
    assert kinds == [("start", None), ("text", "Hel"), ("text", "lo"), ("response", None)]
    assert "".join(m.state.text_parts) == "Hello" and len(m.state.chunks) == 3 and not m.finished
    assert m.wait_time(10.0) == 5.0 and m.wait_time(12.0) == 3.0
    m.receive("bus", bus("end"))
    assert m.next_event().kind == "end" and not m.finished  # still awaiting analyzer "late"
    assert "analyzer(s) ['late']" in str(m.timeout_error())
    m.receive("bus", bus("analysis", analysis=NS(step=-1, analyzer="late")))
    assert not m.finished and m.next_event().kind == "analysis" and m.finished

    whole = RequestMachine("w", chat=False, keep_frames=False, attached=False)
    whole.receive("result", NS(choices=[NS(text="all of it")]))
    assert [(e.kind, e.text) for e in (whole.next_event(), whole.next_event())] == [("text", "all of it"),
                                                                                    ("response", None)]
    with pytest.raises(MiaStreamError, match="stopped before its end"):
        whole.receive("bus_closed", None)
    with pytest.raises(ValueError, match="boom"):
        whole.receive("http_error", ValueError("boom"))
