"""The semantics of a live steering command (``producer._steer_command.apply_command``), tested directly: no
engine, no bus. Ops here are stand-ins with a ``layer`` (the function never looks further). Also the engine
control identity the commands are addressed to (``producer._control``)."""

from __future__ import annotations

from collections import namedtuple

import pytest

from mia_stream.errors import SteeringSpecError
from mia_stream.producer._steer_command import STEERING_OFF, apply_command

Op = namedtuple("Op", "layer name")
A, B, C = Op(1, "a"), Op(2, "b"), Op(1, "c")


def _parse(raw):
    if raw == "bad":
        raise SteeringSpecError("bad op")
    return tuple(raw)


@pytest.mark.parametrize("action, raw, layers, ops_after", [
    ("replace", [C], (), (C,)),
    ("add", [C], (), (A, B, C)),
    ("remove", (), [1], (B,)),
    ("remove", (), [7], (A, B)),  # nothing at that layer: still a new configuration
    ("clear", (), (), ()),
])
def test_each_steering_change_sets_the_ops_and_bumps_the_version(action, raw, layers, ops_after):
    out = apply_command(action, (A, B), 3, raw, layers, parse=_parse)
    assert (out.ops, out.version, out.changed, out.abort, out.error) == (ops_after, 4, True, False, None)


def test_abort_leaves_steering_alone_and_acks_version_0_even_with_steering_off():
    for steering in (True, False):
        out = apply_command("abort", (A,), 5, steering=steering, parse=_parse)
        assert (out.ops, out.version, out.changed, out.abort, out.error) == ((A,), 0, False, True, None)


def test_steering_off_refuses_every_change_with_version_0():
    for action in ("replace", "add", "remove", "clear", "nonsense"):
        out = apply_command(action, (A,), 2, [B], steering=False, parse=_parse)
        assert (out.ops, out.version, out.changed, out.error) == ((A,), 0, False, STEERING_OFF)


def test_ops_that_do_not_parse_and_unknown_actions_are_refused_with_the_current_version():
    bad = apply_command("add", (A,), 2, "bad", parse=_parse)
    assert (bad.ops, bad.version, bad.changed, bad.error) == ((A,), 2, False, "bad op")
    unknown = apply_command("rotate", (A,), 2, [B], parse=_parse)
    assert (unknown.ops, unknown.version, unknown.changed) == ((A,), 2, False)
    assert "unknown action 'rotate'" in unknown.error


def test_only_replace_and_add_parse_their_ops():
    def parse(raw):
        raise AssertionError("parsed")
    assert apply_command("clear", (A,), 1, "bad", parse=parse).ops == ()
    assert apply_command("remove", (A, B), 1, "bad", [2], parse=parse).ops == (A,)


def test_the_engine_control_id_carries_a_random_token_shared_through_the_environment(monkeypatch):
    """Issue 24 item 5: the control id is ``host:pid:engine:TOKEN``; the token is made once, put in the
    environment (the engine core and its workers inherit it), and cannot be guessed from host and pid."""
    import re

    from mia_stream import settings
    from mia_stream.errors import SettingError
    from mia_stream.producer._control import engine_control_id, ensure_control_token

    monkeypatch.delenv("MIA_STREAM_CONTROL_TOKEN", raising=False)
    token = ensure_control_token()
    assert re.fullmatch(r"[0-9a-f]{16}", token) and settings.get_text("MIA_STREAM_CONTROL_TOKEN") == token
    assert ensure_control_token() == token and engine_control_id(42).endswith(f":42:engine:{token}")
    monkeypatch.delenv("MIA_STREAM_CONTROL_TOKEN")
    assert ensure_control_token() != token  # another launch, another token
    monkeypatch.setenv("MIA_STREAM_CONTROL_TOKEN", "a/b")  # would split the broker identity
    with pytest.raises(SettingError, match="MIA_STREAM_CONTROL_TOKEN"):
        ensure_control_token()
