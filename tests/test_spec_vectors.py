"""Steering vectors at admission: every form parses to the same float32 op, parsed ops are reused only while
their vector is unchanged, and bad lists are refused (the fast list conversion must not let bools through)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from mia_stream.errors import SteeringSpecError
from mia_stream.spec import ModelGeometry, op_cache_info, parse_spec
from mia_stream.spec.vectors import register_vector, vector_digest

GEO = ModelGeometry(num_layers=4, hidden_size=16, num_heads=4, num_kv_heads=2, head_dim=4)


@pytest.fixture(autouse=True)
def vectors_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MIA_STREAM_VECTORS", str(tmp_path / "vectors"))
    return tmp_path / "vectors"


def _op(vector, layer=1, **kw):
    return parse_spec({"steer": [dict({"layer": layer, "op": "add", "vector": vector, "scale": 0.5}, **kw)]},
                      GEO).steer[0]


def test_every_vector_form_gives_the_same_op():
    v = np.random.default_rng(0).standard_normal(16).astype(np.float32)
    register_vector("v", v)
    forms = [v.tolist(), tuple(v.tolist()), v, v.astype(np.float64), {"f32": v.astype("<f4").tobytes()},
             {"name": "v"}]
    ops = [_op(f) for f in forms]
    for op in ops:
        assert np.array_equal(op.array, v) and op.key() == ops[0].key()
    ints = _op(list(range(16)))
    assert np.array_equal(ints.array, np.arange(16, dtype=np.float32))


def test_a_named_op_is_parsed_once_and_again_when_the_vector_is_registered_again(vectors_dir):
    register_vector("joy", np.ones(16, np.float32))
    first = _op({"name": "joy"})
    assert _op({"name": "joy"}) is first  # reused: no second parse
    assert _op({"name": "joy"}, layer=2) is not first and _op({"name": "joy"}, scale=1.0).scale == 1.0
    register_vector("joy", np.full(16, 2.0, np.float32))  # replaced in place by name
    again = _op({"name": "joy"})
    assert again is not first and np.all(again.array == 2.0) and again.key() != first.key()
    (vectors_dir / "joy.npy").unlink()
    with pytest.raises(SteeringSpecError, match="no registered vector named 'joy'"):
        _op({"name": "joy"})


def test_bytes_ops_are_reused_by_content_and_typed_fields_do_not_collide():
    raw = np.arange(16, dtype="<f4").tobytes()
    first = _op({"f32": raw})
    assert _op({"f32": bytes(bytearray(raw))}) is first  # equal content, another object
    assert _op({"f32": np.zeros(16, "<f4").tobytes()}) is not first
    with pytest.raises(SteeringSpecError, match=r"\['scale'\]"):
        _op({"f32": raw}, scale=True)  # True == 1 must not hit the cached scale=1 op
    _op({"f32": raw}, scale=1)


@pytest.mark.parametrize("vector", [
    [True] * 16, [0.5] * 15 + [True], [0.5] * 15 + [False], ["0.5"] * 16, [[0.5]] * 16, [None] * 16,
    [0.5] * 15 + [1 + 2j], [0.5] * 15 + [10 ** 400],
])
def test_a_list_that_is_not_numbers_is_refused(vector):
    with pytest.raises(SteeringSpecError, match="must be a list of numbers"):
        _op(vector)


def test_a_list_of_ones_and_zeros_is_numbers():
    op = _op([0.0, 1.0] * 8)
    assert np.array_equal(op.array, np.tile([0.0, 1.0], 8).astype(np.float32))


def test_a_named_op_travels_by_name_and_digest_and_resolves_to_the_content_the_frontend_checked(vectors_dir):
    """The normalized (compact) form of a named op names the vector and its content digest instead of carrying
    512 KiB per request steering 32 layers of an 8B model; the worker loads exactly that content, even when the
    name was registered again between the frontend's check and the worker's parse."""
    old = np.random.default_rng(1).standard_normal(16).astype(np.float32)
    register_vector("mood", old)
    spec = parse_spec({"steer": [{"layer": 1, "op": "cap", "vector": {"name": "mood"}, "threshold": 0.5}]}, GEO)
    wire = spec.to_wire()
    vec = wire["steer"][0]["vector"]
    assert vec.keys() == {"name", "digest"} and vec["name"] == "mood" and len(vec["digest"]) == 32
    register_vector("mood", -old)  # registered again while the request is on its way to the engine
    worker = parse_spec(wire, GEO).steer[0]
    assert worker.vector == spec.steer[0].vector and worker.key() == spec.steer[0].key()
    assert np.allclose(worker.array, old / np.linalg.norm(old))  # cap: the unit direction of the OLD vector
    assert worker.to_wire(compact=True)["vector"] == vec  # and it stays by reference downstream
    assert np.allclose(_op({"name": "mood"}).array, -old)  # the name now means the new vector
    assert _op({"f32": old.tobytes()}).to_wire(compact=True)["vector"].keys() == {"f32"}  # inline: bytes
    assert isinstance(worker.to_wire()["vector"], list)  # the readable form: floats


@pytest.mark.parametrize("digest, match", [
    ("0" * 32, r"no registered vector named 'mood' in the version of digest 0{32}"),
    ("../../etc/passwd", "must be 32 hex digits"),
    ("ABC", "must be 32 hex digits"),
])
def test_an_unknown_or_malformed_digest_is_a_spec_error(digest, match):
    register_vector("mood", np.ones(16, np.float32))
    with pytest.raises(SteeringSpecError, match=match):
        _op({"name": "mood", "digest": digest})
    with pytest.raises(SteeringSpecError, match="a named vector is"):
        _op({"name": "mood", "digest": 7})


def test_a_vector_file_placed_by_hand_gets_its_digest_copy_on_first_use(vectors_dir):
    v = np.arange(16, dtype=np.float32)
    vectors_dir.mkdir(parents=True)
    np.save(vectors_dir / "hand.npy", v)  # not through register_vector: no digest copy yet
    digest = _op({"name": "hand"}).to_wire(compact=True)["vector"]["digest"]
    assert (vectors_dir / ".by-digest" / f"{digest}.npy").exists()
    assert np.array_equal(_op({"name": "hand", "digest": digest}).array, v)


def _hits_misses():
    info = op_cache_info()
    return info["hits"], info["misses"]


@pytest.mark.parametrize("form", ["list", "tuple", "ndarray", "ndarray f64", "f32"])
def test_an_inline_vector_is_parsed_once_and_found_by_its_digest_downstream(form):
    """Issue 26: an inline vector costs what a named one does. The frontend's second request with equal content
    (another object, as a caller builds it anew) hits the parsed-op cache; the engine side finds the op by the
    digest the frontend put beside the bytes, without hashing them (and its second parse is a hit too)."""
    v = np.random.default_rng(7).standard_normal(16).astype(np.float32)
    make = {"list": lambda: v.tolist(), "tuple": lambda: tuple(v.tolist()), "ndarray": lambda: v.copy(),
            "ndarray f64": lambda: v.astype(np.float64), "f32": lambda: {"f32": v.tobytes()}}[form]
    spec = lambda: {"steer": [{"layer": 2, "op": "cap", "vector": make(), "threshold": 0.25}]}  # noqa: E731
    first = parse_spec(spec(), GEO)
    before = _hits_misses()
    again = parse_spec(spec(), GEO)
    assert _hits_misses() == (before[0] + 1, before[1]) and again.steer[0] is first.steer[0]
    wire = first.to_wire()["steer"][0]["vector"]  # what the frontend hands the engine core (and it the workers)
    assert wire.keys() == {"f32", "digest"} and wire["digest"] == vector_digest(first.steer[0].array)
    engine = parse_spec(msgpack.unpackb(msgpack.packb(first.to_wire())), GEO)  # fresh objects, as from vLLM's IPC
    assert engine.steer[0].vector == first.steer[0].vector and engine.steer[0].key() == first.steer[0].key()
    before = _hits_misses()
    parse_spec(msgpack.unpackb(msgpack.packb(first.to_wire())), GEO)
    assert _hits_misses() == (before[0] + 1, before[1])
    assert engine.steer[0].to_wire(compact=True)["vector"].keys() == {"f32"}  # StreamStart: the bytes alone


def test_every_form_of_one_vector_gets_one_digest_and_one_key():
    v = np.random.default_rng(8).standard_normal(16).astype(np.float32)
    register_vector("same", v)
    ops = [_op(f) for f in (v.tolist(), v, {"f32": v.tobytes()}, {"name": "same"})]
    assert len({o.key() for o in ops}) == 1 and len({o.digest for o in ops}) == 1  # one steering-table slot


def test_a_digest_that_is_not_the_bytes_digest_is_refused():
    v = np.arange(16, dtype="<f4")
    with pytest.raises(SteeringSpecError, match=r"\['digest'\]: is not the digest"):
        _op({"f32": v.tobytes(), "digest": vector_digest(v + 1)})
    with pytest.raises(SteeringSpecError, match="must hold 16 float32 values"):
        _op({"f32": v.tobytes()[:8], "digest": vector_digest(v)})


def test_the_op_cache_is_bounded_in_bytes():
    from mia_stream.spec import _op_cache

    rng = np.random.default_rng(9)
    for _ in range(64):
        _op(rng.standard_normal(16))
    assert op_cache_info()["bytes"] <= _op_cache.MAX_BYTES
    old = _op_cache.MAX_BYTES
    try:
        _op_cache.MAX_BYTES = 1000  # about 5 entries of 16 float64 key bytes and a 16-float vector
        for _ in range(20):
            _op(rng.standard_normal(16))
        assert op_cache_info()["bytes"] <= 1000 and 0 < op_cache_info()["entries"] <= 6
    finally:
        _op_cache.MAX_BYTES = old


# ---------------------------------------------------------------------------------------------- issue 26: any form,
# the cost of a named vector; never a stale vector

def _steer(vector, layers=range(4), **kw):
    return {"steer": [dict({"layer": layer, "op": "add", "vector": vector, "scale": 0.5}, **kw) for layer in layers]}


@pytest.mark.parametrize("mutate", ["ndarray in place", "ndarray one element", "ndarray -0.0", "list one element",
                                    "list -0.0", "list append then pop"])
def test_the_same_object_changed_in_place_parses_to_its_content_of_now(mutate):
    """The same spec object twice, its vector changed in place in between: the second parse is the new content
    (compared with numpy's float32 of that content), never the cached op, down to the sign of a zero."""
    base = np.random.default_rng(30).standard_normal(16)
    base[3] = 0.0
    vec = base.astype(np.float32) if mutate.startswith("ndarray") else base.tolist()
    spec = _steer(vec)
    first = parse_spec(spec, GEO).steer
    assert all(np.array_equal(op.array, base.astype(np.float32)) for op in first)
    if mutate == "ndarray in place":
        vec[:] = np.arange(16)
    elif mutate in ("ndarray one element", "list one element"):
        vec[7] = vec[7] + 0.25
    elif mutate in ("ndarray -0.0", "list -0.0"):
        vec[3] = -0.0
    else:
        vec.append(1.0)
        vec.pop(0)
        vec.insert(0, base[0] + 1.0)
        vec.pop()
    now = np.asarray(vec, np.float32)
    again = parse_spec(spec, GEO).steer
    assert all(op.array.tobytes() == now.tobytes() for op in again)  # bit-exact: -0.0 is not 0.0
    assert again[0].key() != first[0].key()


def test_a_cached_list_does_not_let_a_bad_field_or_element_through():
    """What a fresh parse refuses is refused after an equal-looking list was cached: a bool layer (True == 1), a
    numpy integer layer, a bool element of a vector (True == 1.0), an unknown key."""
    vec = [1.0] + [0.5] * 15
    parse_spec(_steer(vec, layers=[1]), GEO)
    with pytest.raises(SteeringSpecError, match=r"\['layer'\]"):
        parse_spec(_steer(vec, layers=[True]), GEO)
    with pytest.raises(SteeringSpecError, match=r"\['layer'\]"):
        parse_spec(_steer(vec, layers=[np.int64(1)]), GEO)
    with pytest.raises(SteeringSpecError, match="must be a list of numbers"):
        parse_spec(_steer([True] + vec[1:], layers=[1]), GEO)
    with pytest.raises(SteeringSpecError, match="unknown key"):
        parse_spec(_steer(vec, layers=[1], bogus=1), GEO)
    assert parse_spec(_steer(vec, layers=[1], scale=-0.0), GEO).steer[0].key() != \
        parse_spec(_steer(vec, layers=[1], scale=0.0), GEO).steer[0].key()


@pytest.mark.parametrize("form", ["list", "ndarray", "f32", "named"])
def test_a_repeated_list_is_one_cached_object_in_the_frontend_and_the_engine(form):
    """The 2nd request with the same steering, in any form, finds the parsed list whole (one object: its wire,
    salt and table keys made once), in the frontend (the caller's objects) and on the engine side (fresh objects
    from vLLM's IPC); the vector's bytes travel once per list however many layers use it."""
    v = np.random.default_rng(31).standard_normal(16).astype(np.float32)
    register_vector("rep", v)
    vec = {"list": v.tolist(), "ndarray": v, "f32": {"f32": v.tobytes()}, "named": {"name": "rep"}}[form]
    spec = _steer(vec)
    first = parse_spec(spec, GEO)
    before = op_cache_info()
    again = parse_spec(spec, GEO)
    after = op_cache_info()
    assert again.steer is first.steer and again.steering_salt() == first.steering_salt()
    assert after["lists"]["hits"] == before["lists"]["hits"] + 1 and after["misses"] == before["misses"]
    wire = msgpack.packb(first.to_wire())
    if form != "named":  # one op carries the bytes, the other three name them by digest
        carried = [op["vector"] for op in msgpack.unpackb(wire)["steer"]]
        assert [set(c) for c in carried] == [{"f32", "digest"}] + [{"digest"}] * 3
        assert len(wire) < 2 * v.nbytes + 600
    engine = [parse_spec(msgpack.unpackb(wire), GEO) for _ in range(2)]
    assert engine[1].steer is engine[0].steer  # found whole on the engine side too
    assert [o.vector for o in engine[0].steer] == [o.vector for o in first.steer]
    assert [o.key() for o in engine[0].steer] == [o.key() for o in first.steer]


def test_a_digest_alone_must_name_bytes_an_earlier_op_of_the_list_carries():
    v = np.random.default_rng(32).standard_normal(16).astype(np.float32)
    digest = vector_digest(v)
    with pytest.raises(SteeringSpecError, match="names no vector an earlier op"):
        parse_spec({"steer": [{"layer": 1, "op": "add", "vector": {"digest": digest}}]}, GEO)
    forged = {"steer": [{"layer": 1, "op": "add", "vector": {"f32": (v + 1).tobytes(), "digest": digest}},
                        {"layer": 2, "op": "add", "vector": {"digest": digest}}]}
    with pytest.raises(SteeringSpecError, match="is not the digest"):
        parse_spec(forged, GEO)
    good = {"steer": [{"layer": 1, "op": "add", "vector": {"f32": v.tobytes(), "digest": digest}},
                      {"layer": 2, "op": "add", "vector": {"digest": digest}}]}
    ops = parse_spec(good, GEO).steer
    assert [np.array_equal(o.array, v) for o in ops] == [True, True]


def test_the_inline_and_list_caches_are_bounded_and_counted():
    from mia_stream.spec import _parse_cache

    rng = np.random.default_rng(33)
    caches = (_parse_cache.INLINE, _parse_cache.LISTS)
    old = [(c.MAX_ENTRIES, c.MAX_BYTES) for c in caches]
    try:
        for c in caches:
            c.MAX_ENTRIES, c.MAX_BYTES = 8, 2000  # a 16-float vector: 64-128 bytes as a token, 64 as an op
        held = [rng.standard_normal(16) for _ in range(40)]  # alive: their ids are not reused
        before = op_cache_info()
        for arr in held:
            parse_spec(_steer(arr, layers=[1, 2]), GEO)
        info = op_cache_info()
        for name, c in (("inline", _parse_cache.INLINE), ("lists", _parse_cache.LISTS)):
            assert 0 < info[name]["entries"] <= 8 and info[name]["bytes"] <= 2000
            assert info[name]["bytes"] == sum(c.sizes.values())
        assert info["inline"]["misses"] - before["inline"]["misses"] == 40  # one per distinct array, not per op
        assert info["lists"]["misses"] - before["lists"]["misses"] == 40
        parse_spec(_steer(held[-1], layers=[1, 2]), GEO)
        assert op_cache_info()["inline"]["hits"] == info["inline"]["hits"] + 1
        assert op_cache_info()["lists"]["hits"] == info["lists"]["hits"] + 1
    finally:
        for c, (entries, size) in zip(caches, old):
            c.MAX_ENTRIES, c.MAX_BYTES = entries, size
