"""Recordings made before the redesign (issue 23) replay to the same events with today's code.

tests/data/recording-2.1.mcap was recorded from a real CPU vLLM engine by the code at commit 9f39963 (the last
before the redesign), and tests/data/recording-2.1-events.json holds the events that code read back from it
through ``open_stream`` and ``open_batches`` (tensor values hashed): tests/data/make_recording_2_1.py made both.
The digest function is that script's own, applied to today's events.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"


def _maker():
    spec = importlib.util.spec_from_file_location("make_recording_2_1", DATA / "make_recording_2_1.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_pre_redesign_recording_replays_to_the_same_events_in_both_apis():
    expected = json.loads((DATA / "recording-2.1-events.json").read_text())
    got = json.loads(json.dumps(_maker().digest_events(str(DATA / "recording-2.1.mcap"))))
    assert set(got) == {"open_stream", "open_batches"}
    for api in got:
        assert sorted(got[api]) == sorted(expected[api]) == ["compat-0", "compat-1", "compat-2"]
        for rid in expected[api]:
            assert got[api][rid] == expected[api][rid], (api, rid)
    kinds = {e[0] for per in expected.values() for evs in per.values() for e in evs}
    assert {"start", "frame", "tokens", "batch", "end"} <= kinds  # what the recording exercises


def test_every_recorded_message_re_encodes_to_its_recorded_bytes():
    """Today's codec decodes each recorded message and encodes it back to the very bytes the old code wrote, but
    for the schema version it stamps in the header (msgpack ``"v": [2, minor]``: today's minor where 2.1 was)."""
    from mia_stream.consumers.recording import iter_recording
    from mia_stream.schemas import SCHEMA_VERSION, encode

    now = b"\xa1v\x92" + bytes(SCHEMA_VERSION)
    n = 0
    for frames, msg in iter_recording(DATA / "recording-2.1.mcap", include_bus=True):
        again = [bytes(f) for f in encode(msg)]
        stamped = [i for i, f in enumerate(again) if now in f]  # the header (after a topic frame, for some kinds)
        assert stamped, type(msg).__name__
        h = stamped[0]
        again[h] = again[h].replace(now, b"\xa1v\x92\x02\x01")
        assert again == [bytes(f) for f in frames], type(msg).__name__
        n += 1
    assert n > 30
