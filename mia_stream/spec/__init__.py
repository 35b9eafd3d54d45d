"""The per-request spec in ``SamplingParams.extra_args["mia_stream"]``: parse, validate, normalize.

Accepted as a dict, or as a JSON string (what ``vllm_xargs`` can carry over HTTP)::

    {"capture": {"hidden_states": {"layers": [3, 7] | "all", "positions": "all"},
                 "qk": {"layers": [5], "heads": [0, 1] | "all", "positions": "last_prompt"}},
     "steer": [{"layer": 7, "op": "add", "vector": [...] | {"name": "joy"}, "scale": 4.0,
                "positions": "generated"}],
     "detect": [{"probe": "token-probe-smollm2-135m.json", "alert": {"threshold": 0.7}, "action": "abort"}],
     "tags": {"user": "alice"},
     "id": "my-key"}

``detect``: detectors scored inside the engine on the request's own rows (``spec.detect``).

Positions: ``all`` | ``prompt`` | ``generated`` | ``last_prompt``. A captured position p is the row computed
while token p is the input, so ``generated`` covers generated tokens 0..n-2 (the last sampled token is
never fed back) and ``last_prompt`` is the row whose logits chose the first generated token.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import struct
from dataclasses import dataclass, field
from itertools import chain, repeat
from typing import Any, Callable

import numpy as np

from mia_stream.errors import CaptureSpecError, SteeringSpecError
from mia_stream.schemas import STEER_OPS
from mia_stream.spec import _parse_cache

SPEC_KEY = "mia_stream"
POSITIONS = ("all", "prompt", "generated", "last_prompt")
STEER_POSITIONS = ("all", "prompt", "generated")
_TOP_KEYS = {"capture", "steer", "detect", "tags", "id", "prefix_cache"}
PREFIX_CACHE_POLICIES = ("recompute", "reuse")  # what a capture of prompt positions does with cached ones
_CAPTURE_KEYS = {"hidden_states", "qk", "quantize"}
QUANTIZE_FORMATS = ("int8", "fp8_e4m3")  # capture.quantize: per-row absmax scales, on the device
_HS_KEYS = {"layers", "positions"}
_QK_KEYS = {"layers", "heads", "positions"}
_STEER_KEYS = {"layer", "op", "vector", "scale", "threshold", "positions"}


@dataclass(frozen=True)
class ModelGeometry:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class SteerOp:
    layer: int
    op: str
    vector: bytes  # float32 little-endian, hidden_size values; unit-normalized for cap/ablate
    scale: float = 1.0
    threshold: float = 0.0
    positions: str = "all"
    # (name, digest) when the vector is a registered one: the compact wire form names it instead of carrying it
    vector_ref: tuple[str, str] | None = None

    @property
    def array(self) -> np.ndarray:
        """The vector as a read-only float32 array (a view of ``vector``)."""
        return np.frombuffer(self.vector, dtype="<f4")

    @functools.cached_property
    def _key(self) -> str:
        h = hashlib.blake2b(digest_size=12)  # the vector by its digest: ops of a list that share it hash it once
        h.update(f"{self.layer}|{self.op}|{self.scale!r}|{self.threshold!r}|{self.positions}|{self.digest}".encode())
        return h.hexdigest()

    def key(self) -> str:
        """Content hash: requests with equal ops share a steering-table slot (and a cache salt)."""
        return self._key

    @functools.cached_property
    def digest(self) -> str:
        """The content digest of ``vector`` (BLAKE2b-128 of its float32 bytes, as ``vectors.vector_digest``),
        computed once per vector of a parsed list (``_parse_new_op`` sets it for the list's ops that share one)."""
        return hashlib.blake2b(self.vector, digest_size=16).hexdigest()

    def to_wire(self, compact: bool = False, digest: bool = False) -> dict:
        """The op in steering-spec format; ``compact``: the vector as ``{"name", "digest"}`` when it is a
        registered one, else as ``{"f32": bytes}`` (what the producer puts in StreamStart: parsing 4096 floats
        per op per request was the engine's bottleneck, and 32 vectors per request were 512 KiB through vLLM
        and the bus). ``digest`` (with ``compact``; the frontend's hand-over to the engine core and the engine
        core's to the workers): an inline vector as ``{"f32": bytes, "digest": D}``, so the receiving process
        finds its parsed op by ``D`` without hashing the bytes (issue 26: the same work as a named vector)."""
        if not compact:
            vector: Any = self.array.tolist()
        elif self.vector_ref is not None:
            vector = {"name": self.vector_ref[0], "digest": self.vector_ref[1]}
        elif digest:
            vector = {"f32": self.vector, "digest": self.digest}
        else:
            vector = {"f32": self.vector}
        return {"layer": self.layer, "op": self.op, "vector": vector, "scale": self.scale,
                "threshold": self.threshold, "positions": self.positions}


class SteerOps(tuple):
    """A parsed steering list: a tuple of ``SteerOp``. ``parse_steer_ops`` hands out one such object per distinct
    list in a process (the list cache), so what every request derives from its list is made once: the wire forms
    (``wire``), the prefix-cache salt (``salt``), the ops' steering-table keys (``table_keys``). Immutable, like
    its ops."""

    def wire(self, compact: bool = True, digest: bool = False) -> list:
        """``[op.to_wire(compact, digest) for op in self]``, built once: a new list on each call, its op dicts
        shared (read them, never change them)."""
        made = self.__dict__.setdefault("_wires", {})
        ops = made.get((compact, digest))
        if ops is None:
            ops = made[(compact, digest)] = _wire_of(self, compact, digest)
        return list(ops)

    @functools.cached_property
    def salt(self) -> str:
        return _salt_of(self)

    @functools.cached_property
    def table_keys(self) -> tuple[str, ...]:
        return tuple(o.key() for o in self)


def steer_wire(ops: tuple, compact: bool = True, digest: bool = False) -> list:
    """The wire form of a steering list (``SteerOp.to_wire`` of each), made once per ``SteerOps``."""
    if isinstance(ops, SteerOps):
        return ops.wire(compact, digest)
    return _wire_of(ops, compact, digest)


def _wire_of(ops, compact: bool, digest: bool) -> list:
    """``SteerOp.to_wire`` of each op; in the normalized form (``compact`` and ``digest``) an inline vector's
    bytes travel once per list: a later op with the same content names it as ``{"digest": D}`` (a request steering
    32 layers with one array moved 512 KiB through vLLM's IPC and the engine core for an 8B model; now 16)."""
    out = [o.to_wire(compact, digest) for o in ops]
    if compact and digest:
        carried = set()
        for i, w in enumerate(out):
            vec = w["vector"]
            if "f32" in vec:
                if vec["digest"] in carried:
                    out[i] = dict(w, vector={"digest": vec["digest"]})
                carried.add(vec["digest"])
    return out


def _salt_of(ops) -> str:
    return "mia-steer-" + hashlib.blake2b("".join(o.key() for o in ops).encode(), digest_size=12).hexdigest()


class SpecWire(dict):
    """The normalized spec (``RequestSpec.to_wire``): plain data, never changed once made (one per request; its
    op dicts are shared by every request with the same steering list). A deep copy is the object itself: vLLM
    deep-copies every request's SamplingParams (``clone``), and copying the ~300 small objects of a 32-op list took
    0.1-0.6 ms a request in the frontend; msgpack and pickle see a dict."""

    def __deepcopy__(self, memo):
        return self


@dataclass(frozen=True)
class RequestSpec:
    """A validated, normalized spec. ``hs_layers``/``qk_layers`` empty means "not captured"."""

    hs_layers: tuple[int, ...] = ()
    hs_positions: str = "all"
    qk_layers: tuple[int, ...] = ()
    qk_heads: tuple[int, ...] = ()
    qk_positions: str = "all"
    steer: tuple[SteerOp, ...] = ()
    detect: tuple = ()  # spec.detect.DetectorSpec, in the order given (column k of the engine's score buffer)
    tags: dict = field(default_factory=dict)
    stream_id: str | None = None
    prefix_cache: str = "recompute"
    quantize: str = ""  # "" | one of QUANTIZE_FORMATS: captured rows travel quantized, with per-row scales

    @property
    def captures(self) -> bool:
        return bool(self.hs_layers or self.qk_layers)

    @property
    def needs_every_prompt_token(self) -> bool:
        """Capturing prompt positions means the prefix cache must not skip computing them."""
        return ((bool(self.hs_layers) and self.hs_positions in ("all", "prompt"))
                or (bool(self.qk_layers) and self.qk_positions in ("all", "prompt")))

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether the request may take prompt KV from the prefix cache: always, unless it captures prompt
        positions under the ``recompute`` policy (then they are computed, so they can be captured); under
        ``reuse`` the cached positions are not captured and ``StreamEnd.uncaptured_positions`` names them."""
        return not (self.needs_every_prompt_token and self.prefix_cache == "recompute")

    def steering_salt(self) -> str | None:
        """A prefix-cache salt derived from the steering that shapes this request's KV: requests steered
        alike share cache entries, steered and unsteered KV never meet (None: unsteered)."""
        if not self.steer:
            return None
        return self.steer.salt if isinstance(self.steer, SteerOps) else _salt_of(self.steer)

    def capture_wire(self) -> dict:
        out: dict[str, Any] = {}
        if self.hs_layers:
            out["hidden_states"] = {"layers": list(self.hs_layers), "positions": self.hs_positions}
        if self.qk_layers:
            out["qk"] = {"layers": list(self.qk_layers), "heads": list(self.qk_heads),
                         "positions": self.qk_positions}
        if self.quantize and out:
            out["quantize"] = self.quantize
        return out

    def to_wire(self, compact: bool = True) -> dict:
        """The normalized spec as plain data (what the frontend puts back into extra_args; steering vectors by
        name and digest, or as float32 bytes with their digest, unless ``compact=False``)."""
        return SpecWire({"capture": self.capture_wire(), "steer": steer_wire(self.steer, compact, digest=compact),
                         **({"detect": [d.to_wire() for d in self.detect]} if self.detect else {}),
                         "tags": self.tags, "id": self.stream_id, "prefix_cache": self.prefix_cache,
                         "_normalized": True})


def _fail(cls, path: str, msg: str):
    raise cls(f"extra_args['{SPEC_KEY}']{path}: {msg}")


def _layers(value: Any, geo: ModelGeometry, path: str, cls=CaptureSpecError) -> tuple[int, ...]:
    if value == "all":
        return tuple(range(geo.num_layers))
    if not isinstance(value, (list, tuple)) or not value:
        _fail(cls, path, f"must be 'all' or a non-empty list of layer indices, got {value!r}")
    out = []
    for x in value:
        if not isinstance(x, int) or isinstance(x, bool):
            _fail(cls, path, f"layer indices must be integers, got {x!r}")
        if not 0 <= x < geo.num_layers:
            _fail(cls, path, f"layer {x} is out of range: the model has layers 0..{geo.num_layers - 1}")
        out.append(x)
    return tuple(sorted(set(out)))


def _positions(value: Any, path: str, allowed=POSITIONS, cls=CaptureSpecError) -> str:
    if value not in allowed:
        _fail(cls, path, f"must be one of {list(allowed)}, got {value!r}")
    return value


def _keys(d: Any, allowed: set, path: str, cls) -> dict:
    if not isinstance(d, dict):
        _fail(cls, path, f"must be an object, got {type(d).__name__}")
    unknown = set(d) - allowed
    if unknown:
        _fail(cls, path, f"unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    return d


def parse_spec(raw: Any, geo: ModelGeometry,
               resolve_vector: Callable[[str], np.ndarray] | None = None) -> RequestSpec:
    """Validate ``extra_args["mia_stream"]`` against the model; raise a ``SpecError`` naming the bad field."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise CaptureSpecError(f"extra_args['{SPEC_KEY}'] is a string but not valid JSON: {e}") from None
    if isinstance(raw, dict) and raw.get("_normalized"):
        raw = {k: v for k, v in raw.items() if k != "_normalized"}
        if raw.get("id") is None:
            raw.pop("id", None)
    d = _keys(raw, _TOP_KEYS, "", CaptureSpecError)
    kw: dict[str, Any] = {}
    cap = _keys(d.get("capture", {}), _CAPTURE_KEYS, "['capture']", CaptureSpecError)
    if "hidden_states" in cap:
        hs = _keys(cap["hidden_states"], _HS_KEYS, "['capture']['hidden_states']", CaptureSpecError)
        kw["hs_layers"] = _layers(hs.get("layers", "all"), geo, "['capture']['hidden_states']['layers']")
        kw["hs_positions"] = _positions(hs.get("positions", "all"), "['capture']['hidden_states']['positions']")
    if "qk" in cap:
        qk = _keys(cap["qk"], _QK_KEYS, "['capture']['qk']", CaptureSpecError)
        kw["qk_layers"] = _layers(qk.get("layers", "all"), geo, "['capture']['qk']['layers']")
        heads = qk.get("heads", "all")
        if heads == "all":
            kw["qk_heads"] = tuple(range(geo.num_heads))
        else:
            if not isinstance(heads, (list, tuple)) or not heads:
                _fail(CaptureSpecError, "['capture']['qk']['heads']", f"must be 'all' or a non-empty list, got {heads!r}")
            for h in heads:
                if not isinstance(h, int) or isinstance(h, bool) or not 0 <= h < geo.num_heads:
                    _fail(CaptureSpecError, "['capture']['qk']['heads']",
                          f"head {h!r} is out of range: the model has query heads 0..{geo.num_heads - 1}")
            kw["qk_heads"] = tuple(sorted(set(heads)))
        kw["qk_positions"] = _positions(qk.get("positions", "all"), "['capture']['qk']['positions']")
    if "quantize" in cap:
        if cap["quantize"] not in QUANTIZE_FORMATS:
            _fail(CaptureSpecError, "['capture']['quantize']",
                  f"must be one of {', '.join(QUANTIZE_FORMATS)}, got {cap['quantize']!r}")
        kw["quantize"] = cap["quantize"]
    if "steer" in d:
        kw["steer"] = parse_steer_ops(d["steer"], geo, resolve_vector)
    if d.get("detect"):
        from mia_stream.spec.detect import parse_detect  # (it imports this module)

        kw["detect"] = parse_detect(d["detect"], geo)
    tags = d.get("tags", {})
    if not isinstance(tags, dict):
        _fail(CaptureSpecError, "['tags']", f"must be an object, got {type(tags).__name__}")
    kw["tags"] = tags
    if "id" in d:
        if not isinstance(d["id"], str) or not d["id"] or "\x00" in d["id"]:
            _fail(CaptureSpecError, "['id']", f"must be a non-empty string without NUL, got {d['id']!r}")
        kw["stream_id"] = d["id"]
    if "prefix_cache" in d:
        if d["prefix_cache"] not in PREFIX_CACHE_POLICIES:
            _fail(CaptureSpecError, "['prefix_cache']",
                  f"must be one of {', '.join(PREFIX_CACHE_POLICIES)}, got {d['prefix_cache']!r}")
        kw["prefix_cache"] = d["prefix_cache"]
    return RequestSpec(**kw)


def parse_steer_ops(ops: Any, geo: ModelGeometry,
                    resolve_vector: Callable[[str], np.ndarray] | None = None) -> tuple[SteerOp, ...]:
    """The steering list ``ops``, checked, as a ``SteerOps``. A list whose every op is recognizable (see
    ``_op_cache_key``) is found whole in the list cache when it was parsed before: the same object comes back,
    with its wire forms and salt already made."""
    if not isinstance(ops, (list, tuple)):
        _fail(SteeringSpecError, "['steer']", f"must be a list of operations, got {type(ops).__name__}")
    memo: dict = {}  # one token per vector object, one stat per vector name, for the whole list
    one = _op_cache_key(ops[0], geo, resolve_vector, memo) if len(ops) == 1 else None  # cheaper than _list_key
    whole = (None if one is None else ("one", one)) if len(ops) == 1 else _list_key(ops, geo, resolve_vector, memo)
    if whole is not None:
        hit = _parse_cache.LISTS.get(whole)
        if hit is not None:
            _parse_cache.LISTS.hits += 1
            _op_cache.hits += len(hit)
            return hit
        _parse_cache.LISTS.misses += 1
    parsed = SteerOps(_parse_op(op, geo, resolve_vector, f"['steer'][{i}]",
                                one if one is not None else _op_cache_key(op, geo, resolve_vector, memo), memo)
                      for i, op in enumerate(ops))
    if whole is not None:
        tokens = (one[2],) if one is not None else whole[-1] if whole[-1][0] != "wire" else ()  # bytes they hold
        _parse_cache.LISTS.put(whole, parsed, sum(len(o.vector) for o in parsed)
                               + sum(_token_bytes(t) for t in {id(t): t for t in tokens}.values()))
    return parsed


_KEY_FIELDS = ("layer", "op", "scale", "threshold", "positions")


def _list_key(ops: list | tuple, geo: ModelGeometry, resolve_vector, memo: dict) -> tuple | None:
    """The list cache's key: what every op's ``_op_cache_key`` says, gathered field by field over the whole list
    with C-level maps (~10 µs for 32 ops; op by op it was ~100 µs, most of a cached request's admission). None:
    the list is parsed op by op (an op that is not a plain dict, an injected resolver, unusual field types)."""
    if resolve_vector is not None or not ops or set(map(type, ops)) != {dict}:  # plain dicts: dict.get is theirs
        return None
    names = tuple(chain.from_iterable(ops))  # every op's keys, in order: a missing key is not a None value
    fields = tuple(tuple(map(dict.get, ops, repeat(name))) for name in _KEY_FIELDS)
    vectors = list(map(dict.get, ops, repeat("vector")))
    if not _STEER_KEYS.issuperset(names):
        return None
    types = tuple(map(type, chain.from_iterable(fields)))  # typed: True == 1 == 1.0 must not share an entry
    if not _KEY_TYPES.issuperset(types):
        return None
    signs = ()  # -0.0 == 0.0, but they scale differently: the signs of zero scales and thresholds, in order
    if 0.0 in fields[2] or 0.0 in fields[3]:
        signs = tuple(math.copysign(1.0, x) for x in chain(fields[2], fields[3]) if x == 0.0 and type(x) is float)
    tokens = _wire_tokens(vectors)
    if tokens is not None:
        return (geo.num_layers, geo.hidden_size, names, types, fields, signs, tokens)
    ids = list(map(id, vectors))
    if ids.count(ids[0]) == len(ids):  # one vector object for every op (all layers steered alike)
        token = _vector_token(vectors[0], geo.hidden_size, None, memo)
        tokens = None if token is None else (token,) * len(ids)
    else:
        tokens = tuple(_vector_token(v, geo.hidden_size, None, memo) for v in vectors)
    if tokens is None or None in tokens:
        return None
    return (geo.num_layers, geo.hidden_size, names, types, fields, signs, tokens)


# (keys, (type of name, type of f32)) of {name, digest}, {f32, digest} and {digest} (bytes carried by an earlier op)
_WIRE_FORMS = frozenset({(2, (str, type(None))), (2, (type(None), bytes)), (1, (type(None), type(None)))})


def _wire_tokens(vectors: list) -> tuple | None:
    """The vectors of a normalized list (what the engine core and the workers parse: every vector a fresh dict
    from vLLM's IPC, named by its digest) identified at C speed: their names, digests and forms. None: not all are
    ``{"name", "digest"}``, ``{"f32", "digest"}`` or ``{"digest"}``. A digest stands for the bytes the op cache
    checked it against at the list's first parse in this process (as ``_vector_token``'s ``("f32", digest)``); a
    ``{"digest"}`` names the bytes an earlier op of the list carries, and whether it has one is a matter of the
    forms and digests alone, which the key holds."""
    if set(map(type, vectors)) != {dict}:
        return None
    digests = tuple(map(dict.get, vectors, repeat("digest")))
    names = tuple(map(dict.get, vectors, repeat("name")))
    forms = tuple(zip(map(len, vectors), zip(map(type, names), map(type, map(dict.get, vectors, repeat("f32"))))))
    if set(map(type, digests)) != {str} or not _WIRE_FORMS.issuperset(forms):
        return None
    return ("wire", names, digests, forms)


def _list_bytes(vec: list | tuple) -> bytes | None:
    """A list of numbers as float64 bytes, or None if it is not one. struct converts in one C pass (~15 µs for
    4096, array('d') ~40) and refuses strings, None, nested lists and ints beyond a float; only bools slip
    through (as 0/1), so the element types are scanned only when a 0 or 1 is present. Admission of 32 ops x
    4096 floats went from 8.2 to ~3 ms a request (the frontend's cost of steering every layer of an 8B model at
    256 requests: scripts/bench_spec_admission.py), then to ~1 ms."""
    try:
        raw = struct.pack(f"<{len(vec)}d", *vec)
    except (struct.error, TypeError, ValueError, OverflowError):
        return None
    arr = np.frombuffer(raw, dtype=np.float64)
    if ((arr == 0.0) | (arr == 1.0)).any() and any(issubclass(t, bool) for t in set(map(type, vec))):
        return None
    return raw


def _float_list(vec: list | tuple, path: str) -> np.ndarray:
    raw = _list_bytes(vec)
    if raw is None:
        _fail(SteeringSpecError, path + "['vector']", "must be a list of numbers")
    return np.frombuffer(raw, dtype=np.float64)


def _parse_op(op: Any, geo: ModelGeometry, resolve_vector, path: str, key: tuple | None, memo: dict) -> SteerOp:
    """One steering op, checked. Ops are parsed once and reused while their vector is unchanged, whatever form
    it is given in: a request steering all 32 layers of an 8B model repeats the same 32 ops as every other such
    request, and parsing them again (~2 ms a request) held back vLLM's admission of the next request."""
    if key is None:
        _op_cache.uncached += 1
        return _parse_new_op(op, geo, resolve_vector, path, memo)
    parsed = _op_cache.get(key)
    if parsed is not None:
        _op_cache.hits += 1
        return parsed
    _op_cache.misses += 1
    parsed = _parse_new_op(op, geo, resolve_vector, path, memo)
    _op_cache.put(key, parsed, len(parsed.vector) + _token_bytes(key[2]))
    return parsed


def _token_bytes(token: tuple) -> int:
    return len(token[2]) if token[0] == "raw" else 0  # the other tokens name content by digest or file version


_op_cache = _parse_cache.OPS


def op_cache_info() -> dict:
    """This process's parsed-op cache: ``hits`` (ops found parsed, one by one or in a cached list), ``misses``
    (parsed, then kept), ``uncached`` (ops not recognizable cheaply: an injected resolver, unusual field types),
    ``entries`` and ``bytes``; ``lists`` and ``inline``: the same counters of the parsed-list cache and of the
    inline vectors' tokens (``spec._parse_cache``)."""
    return _parse_cache.info()


_FIELD_TYPES = (int, float, str, type(None))
_KEY_TYPES = frozenset(_FIELD_TYPES)


def _vector_token(vec: Any, hidden_size: int, resolve_vector, memo: dict) -> tuple | None:
    """What identifies the vector of an op (with the model geometry and the op's other fields, the parsed op):
    inline content by its bytes, a digest-carrying form by its digest (no bytes touched: the engine side of every
    form), a name by its file's version. None: parse it anew. ``memo`` (one per steering list): one token per
    vector object and one stat per name, however many ops share them (a request steering 32 layers with one
    array converts and compares it once)."""
    kind = type(vec)
    if kind is dict:
        keys = vec.keys()
        if keys == {"f32"} and type(vec["f32"]) is bytes:
            return ("raw", "<f4", vec["f32"])  # bytes hash once per object, and compare by content
        if keys == {"f32", "digest"} and type(vec["f32"]) is bytes and type(vec["digest"]) is str:
            memo[("digest", vec["digest"])] = vec["f32"]  # for later ops of the list that name it alone
            return ("f32", vec["digest"])  # its first parse checked the digest against the bytes
        if keys == {"digest"} and type(vec["digest"]) is str:  # the bytes an earlier op of the list carries
            return ("f32", vec["digest"]) if ("digest", vec["digest"]) in memo else None
        if keys == {"name", "digest"} and type(vec["name"]) is str and type(vec["digest"]) is str:
            return ("digest", vec["name"], vec["digest"])  # content-addressed: no file to check
        if keys == {"name"} and type(vec["name"]) is str and resolve_vector is None:
            name = vec["name"]
            if name in memo:
                version = memo[name]
            else:
                from mia_stream.spec.vectors import vector_version

                version = memo[name] = vector_version(name)
            return None if version is None else ("name", name, version)
        return None
    if kind is np.ndarray or kind is list or kind is tuple:
        seen = memo.get(id(vec))
        if seen is not None and seen[0] is vec:
            return seen[1]
        if kind is np.ndarray:  # an array may change between requests: its content of now is the key
            if vec.shape != (hidden_size,) or vec.dtype.kind not in "iuf":
                return None
            dtype, raw = vec.dtype.str, vec.tobytes()
        else:
            raw = _list_bytes(vec) if len(vec) == hidden_size else None  # a wrong length: the parse says so
            if raw is None:
                return None
            dtype = "<f8"
        token = _parse_cache.INLINE.token(id(vec), dtype, raw)
        memo[id(vec)] = (vec, token)  # the object is alive (in the caller's list) while this list is parsed
        return token
    return None


def _op_cache_key(op: Any, geo: ModelGeometry, resolve_vector, memo: dict) -> tuple | None:
    """A key that identifies the parsed op, or None when the op cannot be recognized cheaply (an injected
    resolver, unusual field types: those are parsed every time)."""
    if type(op) is not dict or not op.keys() <= _STEER_KEYS:
        return None
    token = _vector_token(op.get("vector"), geo.hidden_size, resolve_vector, memo)
    if token is None:
        return None
    fields = []
    for name in ("layer", "op", "scale", "threshold", "positions"):
        value = op.get(name)
        kind = type(value)
        if kind not in _FIELD_TYPES:
            return None
        if kind is float and value == 0.0:  # -0.0 == 0.0, but they scale differently
            fields.append((kind, value, math.copysign(1.0, value)))
        else:
            fields.append((kind, value))  # typed: True == 1 == 1.0 must not share an entry
    return (geo.num_layers, geo.hidden_size, token, *fields)


def _parse_new_op(op: Any, geo: ModelGeometry, resolve_vector, path: str, memo: dict) -> SteerOp:
    op = _keys(op, _STEER_KEYS, path, SteeringSpecError)
    layer = op.get("layer")
    if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < geo.num_layers:
        _fail(SteeringSpecError, path + "['layer']",
              f"must be a layer index in 0..{geo.num_layers - 1}, got {layer!r}")
    kind = op.get("op")
    if kind not in STEER_OPS:
        _fail(SteeringSpecError, path + "['op']", f"must be one of {list(STEER_OPS)}, got {kind!r}")
    vec = op.get("vector")
    source = _vector_source(vec)
    made = memo.get(("vector", source, kind != "add")) if source is not None else None
    if made is None:
        vector, ref, digest = _vector_bytes(vec, kind, geo, resolve_vector, path, memo)
        made = (vector, ref, digest or hashlib.blake2b(vector, digest_size=16).hexdigest())
        if source is not None:
            memo[("vector", source, kind != "add")] = made
            if source[0] == "bytes" and type(vec.get("digest")) is str:  # checked: later {"digest"} ops reuse it
                memo[("vector", ("digest", vec["digest"]), kind != "add")] = made
    vector, ref, digest = made
    scale, threshold = op.get("scale", 1.0), op.get("threshold", 0.0)
    for name, value in (("scale", scale), ("threshold", threshold)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            _fail(SteeringSpecError, path + f"['{name}']", f"must be a finite number, got {value!r}")
    positions = _positions(op.get("positions", "all"), path + "['positions']", STEER_POSITIONS, SteeringSpecError)
    parsed = SteerOp(layer, kind, vector, float(scale), float(threshold), positions, ref)
    parsed.__dict__["digest"] = digest  # its cached_property: one hash per vector of the list, not per op
    return parsed


def _vector_source(vec: Any) -> tuple | None:
    """What a vector's conversion depends on, within one list's parse (the objects are alive in the caller's list
    until it returns): the object itself for an inline vector, the bytes object of an ``f32`` form, the digest of a
    ``{"digest"}`` form (the bytes it names), the name and digest of a named one. None: convert it for each op."""
    kind = type(vec)
    if kind is list or kind is tuple or kind is np.ndarray:
        return ("object", id(vec))
    if kind is dict:
        if "f32" in vec:
            return ("bytes", id(vec["f32"]))
        if vec.keys() == {"digest"}:
            return ("digest", vec["digest"]) if type(vec["digest"]) is str else None
        if "name" in vec and type(vec["name"]) is str and type(vec.get("digest", "")) is str:
            return ("name", vec["name"], vec.get("digest"))
    return None


def _vector_bytes(vec: Any, kind: str, geo: ModelGeometry, resolve_vector, path: str,
                  memo: dict) -> tuple[bytes, tuple | None, str | None]:
    """An op's vector, checked, as float32 bytes (unit-normalized for cap/ablate), its (name, digest) when it is a
    registered one, and the digest of those bytes when it is known already (None: hash them)."""
    ref = None
    given = None  # (float32 bytes, their checked digest or None) of a vector given as float32 bytes
    if isinstance(vec, dict) and set(vec) in ({"f32"}, {"f32", "digest"}):  # float32 little-endian bytes
        if not isinstance(vec["f32"], (bytes, bytearray, memoryview)) or len(vec["f32"]) != 4 * geo.hidden_size:
            _fail(SteeringSpecError, path + "['vector']",
                  f"{{'f32': bytes}} must hold {geo.hidden_size} float32 values ({4 * geo.hidden_size} bytes)")
        raw = bytes(vec["f32"])
        # the normalized form names its content: checked here, at its first parse in a process (later ones find
        # the op by the digest alone), so no digest can stand for other bytes
        if "digest" in vec and vec["digest"] != hashlib.blake2b(raw, digest_size=16).hexdigest():
            _fail(SteeringSpecError, path + "['vector']['digest']", "is not the digest of the vector's f32 bytes")
        given = (raw, vec.get("digest"))
        arr = np.frombuffer(raw, dtype="<f4").astype(np.float64)
    elif isinstance(vec, dict) and set(vec) == {"digest"}:  # the normalized form: an earlier op carries the bytes
        raw = memo.get(("digest", vec["digest"])) if isinstance(vec["digest"], str) else None
        if raw is None:
            _fail(SteeringSpecError, path + "['vector']", "{'digest': D} names no vector an earlier op of the list "
                  "carries as {'f32': bytes, 'digest': D}")
        if len(raw) != 4 * geo.hidden_size or vec["digest"] != hashlib.blake2b(raw, digest_size=16).hexdigest():
            _fail(SteeringSpecError, path + "['vector']['digest']", "is not the digest of the vector's f32 bytes")
        given = (raw, vec["digest"])
        arr = np.frombuffer(raw, dtype="<f4").astype(np.float64)
    elif isinstance(vec, dict):
        if set(vec) not in ({"name"}, {"name", "digest"}) or not all(isinstance(x, str) for x in vec.values()):
            _fail(SteeringSpecError, path + "['vector']", "a named vector is {'name': NAME}")
        name = vec["name"]
        try:
            if "digest" in vec:  # the normalized form: exactly the content the frontend checked
                from mia_stream.spec.vectors import vector_by_digest

                arr = np.asarray(vector_by_digest(vec["digest"]), dtype=np.float64)
                ref = (name, vec["digest"])
            elif resolve_vector is None:
                from mia_stream.spec.vectors import named_vector

                loaded, digest = named_vector(name)
                arr, ref = np.asarray(loaded, dtype=np.float64), (name, digest)
            else:
                arr = np.asarray(resolve_vector(name), dtype=np.float64)
        except KeyError:
            version = f" in the version of digest {vec['digest']}" if "digest" in vec else ""
            _fail(SteeringSpecError, path + "['vector']",
                  f"no registered vector named {name!r}{version} (register it with `mia-stream vectors add`)")
        except ValueError as e:
            _fail(SteeringSpecError, path + "['vector']", str(e))
    elif isinstance(vec, (list, tuple)):
        seen = memo.get(id(vec))  # its token holds the float64 bytes already (_vector_token)
        if seen is not None and seen[0] is vec and seen[1] is not None and seen[1][1] == "<f8":
            arr = np.frombuffer(seen[1][2], dtype=np.float64)
        else:
            arr = _float_list(vec, path)
    elif isinstance(vec, np.ndarray):
        if vec.dtype.kind not in "iuf":  # bool or non-numeric arrays
            _fail(SteeringSpecError, path + "['vector']", "must be a list of numbers")
        arr = vec.astype(np.float64)
    else:
        _fail(SteeringSpecError, path + "['vector']", f"must be a list of floats or {{'name': NAME}}, got {vec!r}")
    if arr.ndim != 1:
        _fail(SteeringSpecError, path + "['vector']", "must be a flat list of numbers")
    if arr.shape[0] != geo.hidden_size:
        _fail(SteeringSpecError, path + "['vector']",
              f"has length {arr.size}; the model's hidden size is {geo.hidden_size}")
    if not np.all(np.isfinite(arr)):
        _fail(SteeringSpecError, path + "['vector']", "contains NaN or inf")
    if kind == "add" and given is not None:  # float32 -> float64 -> float32 is exact: the bytes as given
        return given[0], ref, given[1]
    if kind != "add":
        norm = float(np.linalg.norm(arr))
        if norm == 0.0:
            _fail(SteeringSpecError, path + "['vector']", f"a '{kind}' direction must be non-zero")
        arr = arr / norm
    return arr.astype("<f4").tobytes(), ref, None
