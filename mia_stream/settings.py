"""Every ``MIA_STREAM_*`` environment setting: one table and the typed getters that parse it.

``SETTINGS`` is the only place a setting's name, form, default and meaning are written down. Code reads a
setting only through a getter (``get_int``, ``get_size``, ``get_flag``, ``get_choice``, ``get_path``,
``get_text``); a value that does not parse raises ``SettingError`` naming the variable, the value and the form
it takes. The README's table of settings is generated from ``SETTINGS`` (``scripts/settings_table.py``;
tests/test_settings.py checks that it matches and that every ``MIA_STREAM_`` name in the tree is here).

Forms: an unset or empty variable means the default.

- ``int``: a whole number (``4096``), at least the setting's minimum;
- ``size``: bytes, as a plain number in the setting's unit or with a binary suffix: ``K``, ``M``, ``G``, ``T``
  (optionally followed by ``iB`` or ``B``; ``512M`` = ``512MiB`` = 512 x 2^20 bytes);
- ``flag``: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (any case);
- ``choice``: one of the listed words (any case);
- ``path`` (``~`` expanded), ``text``, ``address`` (a broker address: a run dir, ``ipc://...``, ``tcp://...``).

This module depends on nothing in mia_stream but ``errors``, so every layer (broker included) may use it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mia_stream.errors import SettingError

MiB = 1 << 20

# where a setting is read, in the README's order
SCOPES = {
    "engine": "vLLM engine processes (the plugin); fixed at engine start",
    "bus": "every peer of the bus: publishers, broker, consumers",
    "broker": "the broker process (`mia-stream broker`): per-peer limits (docs/security.md); each has a flag",
    "consumers": "consumers: reading recordings, acting on alerts (docs/security.md)",
    "files": "caches and models",
    "setup": "scripts/setup.sh, demo.sh, test.sh (shell)",
    "tests": "the test suite",
    "internal": "set by mia_stream for its own child processes",
}


@dataclass(frozen=True)
class Setting:
    name: str
    form: str  # int | size | flag | choice | path | text | address
    scope: str  # a key of SCOPES
    doc: str
    default: Any = None  # the parsed default; None: none, or computed where it is read (``default_doc`` says)
    default_doc: str = ""  # the default as the README states it, when it is not ``default`` written out
    unit: int = 1  # size: bytes per unit of a plain number
    minimum: int | None = None  # int / size
    choices: tuple[str, ...] = ()

    def form_text(self) -> str:
        """The form, in a few words (the README's table)."""
        if self.form == "size":
            return f"size in {'MiB' if self.unit == MiB else 'bytes'} (or 512M, 1G)"
        if self.form == "flag":
            return "0 / 1"
        if self.form == "choice":
            return " / ".join(self.choices)
        if self.form == "int":
            return "whole number" + (f" >= {self.minimum}" if self.minimum is not None else "")
        return {"path": "path", "text": "text", "address": "broker address"}[self.form]

    def expected(self) -> str:
        """The form, in words (error messages)."""
        if self.form == "int":
            return "a whole number" + (f" >= {self.minimum}" if self.minimum is not None else "")
        if self.form == "size":
            unit = {1: "bytes", MiB: "MiB"}[self.unit]
            low = f" of at least {_size_text(self.minimum, 1)}" if self.minimum else ""
            return f"a size{low}: {unit} as a plain number, or with a suffix K, M, G (e.g. 512M, 1GiB)"
        if self.form == "flag":
            return "1/true/yes/on or 0/false/no/off"
        if self.form == "choice":
            return "one of " + ", ".join(self.choices)
        return {"path": "a path", "text": "text", "address": "a broker address (run dir, ipc://..., tcp://HOST:PORT)"}[
            self.form]

    def default_text(self) -> str:
        if self.default_doc:
            return self.default_doc
        if self.default is None:
            return "unset"
        if self.form == "flag":
            return "1" if self.default else "0"
        if self.form == "size":
            return _size_text(self.default, self.unit)
        return str(self.default)


def _size_text(nbytes: int, unit: int) -> str:
    for suffix, scale in (("G", 1 << 30), ("M", MiB), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0 and scale >= unit:
            return f"{nbytes // scale}{suffix}"
    return str(nbytes // unit)


def _table(*settings: Setting) -> dict[str, Setting]:
    return {s.name: s for s in settings}


SETTINGS: dict[str, Setting] = _table(
    # ---- engine
    Setting("MIA_STREAM_BROKER", "address", "engine",
            "The broker the plugin publishes to; the plugin is active only when this is set (unset: vLLM runs as "
            "without mia_stream). Consumers, the recorder and `mia-stream stats` use it when given no address.",
            default_doc="unset (plugin off; peers: the default run dir)"),
    Setting("MIA_STREAM_APERTURE_ROWS", "int", "engine",
            "Captured token rows per engine step, per captured kind (hs, q/k). A step that captures more rows "
            "drops the frames that do not fit (`aperture_full`, counted and announced). Device memory: layers x "
            "rows x (hidden + q width + k width) x dtype bytes (SmolLM2-135M float32: 158 KiB a row, 630 MiB at "
            "4096 rows; a Llama-3-8B in bf16: 576 KiB a row, 4.5 GiB at 8192).",
            default_doc="the scheduler's max_num_batched_tokens (every row of a step fits)", minimum=1),
    Setting("MIA_STREAM_HOST_RING_MB", "size", "engine",
            "Host memory per worker that captured rows wait in until the drain sidecar has published them "
            "(on CUDA pinned from the start). A step that finds it full drops its frames (`host_ring_full`); the engine "
            "logs at start when a full step capturing every layer would not fit (an 8B model's 16k-token prefill of "
            "all layers is 4 GiB).",
            default=512 * MiB, unit=MiB, minimum=MiB),
    Setting("MIA_STREAM_COPY_STAGING_MB", "size", "engine",
            "Device memory (two halves of this size, inside vLLM's budget) that a step's captured rows are copied "
            "into on the device before the copy to the host, so the next forward need not wait for that copy (it "
            "waits for a device copy of ~0.05 ms instead of ~1.2 ms for an 8B model's 64 MiB of all-layer rows "
            "on an H100). A step bigger than a half waits as before. 0: off (the default until measured on a GPU).",
            default=0, unit=MiB, minimum=0),
    Setting("MIA_STREAM_HOST_RING_SHM", "flag", "engine",
            "The host ring is a named /dev/shm ring consumers read in place: a step's rows that lie in it as one "
            "slice are published by reference, not copied again (issue 29). 0 (or no room in /dev/shm): an "
            "anonymous memfd whose rows the publisher copies into its own ring, as before.",
            default=True),
    Setting("MIA_STREAM_STEER_SLOTS", "int", "engine",
            "Distinct steering ops the engine holds at once (requests with identical ops share one).",
            default=512, minimum=1),
    Setting("MIA_STREAM_STEER_OPS_PER_LAYER", "int", "engine",
            "Steering ops one request may apply at one layer.", default=4, minimum=1),
    Setting("MIA_STREAM_CAPTURE_QK", "flag", "engine",
            "0 leaves the Q/K capture ops out of the graph; a request that captures `qk` is then refused at "
            "admission (ValueError naming this setting).", default=True),
    Setting("MIA_STREAM_QUANTIZE", "flag", "engine",
            "1 reserves device memory, inside vLLM's budget, for `capture.quantize`'s outputs: one byte per value of "
            "every aperture row (hs, and q/k unless MIA_STREAM_CAPTURE_QK=0) and a float32 scale per row and layer, "
            "half the apertures' bytes in bf16 (an 8B model at 8192 rows: 2.25 GiB). 0 (the default: most engines "
            "never quantize) refuses a request with `quantize` at admission (an error naming this setting). "
            "Requests of two formats in one step: the second format's outputs are allocated for that step, outside "
            "the budget (`quantize_out_of_memory` drops when the device has no room).", default=False),
    Setting("MIA_STREAM_STEERING", "flag", "engine",
            "0 leaves the steering ops out of the graph; a request with `steer` is then refused at admission and "
            "live steering commands get an error ack.", default=True),
    Setting("MIA_STREAM_DETECT", "flag", "engine",
            "0 leaves the in-engine detector ops out of the graph; a request with `detect` is then refused at "
            "admission.", default=True),
    Setting("MIA_STREAM_PROBE_SLOTS", "int", "engine",
            "Distinct detector probes the engine holds on the device at once (requests naming the same probe "
            "share one); a detector finding none free is refused for that request and counted.",
            default=64, minimum=1),
    Setting("MIA_STREAM_DETECTORS_PER_REQUEST", "int", "engine",
            "Detectors one request may name in `detect` (columns of the per-step score buffer).",
            default=4, minimum=1),
    Setting("MIA_STREAM_STEP_BATCHES", "flag", "engine",
            "0 makes the drain publish per request (a TensorFrame per request part and a TokenFrame per request "
            "each step, the pre-2.0 form) instead of one StepBatch and one TokenBatch per step: for comparisons.",
            default=True),
    Setting("MIA_STREAM_ALLOW_ANY_VLLM", "flag", "engine",
            "1 lets the plugin try a vLLM version other than the supported 0.26.x and 0.32.x.", default=False),
    Setting("MIA_STREAM_KERNELS", "choice", "engine",
            "Capture/steering kernels: `auto` (Triton on CUDA when it imports, else the torch reference), "
            "`triton`, `reference`.", default="auto", choices=("auto", "triton", "reference")),
    # ---- bus
    Setting("MIA_STREAM_SHM_BYTES", "size", "bus",
            "Size of a publisher's shared-memory tensor ring in /dev/shm (only to a broker on this host); 0: "
            "tensors go inline through the broker.", default=256 * MiB, minimum=0),
    Setting("MIA_STREAM_SHM_ZERO_COPY", "flag", "bus",
            "A consumer reads producers' shared-memory rings in place: its tensors are read-only views of the "
            "mapping, valid until the event is released (copy what you keep: `event.keep()`); an overwrite "
            "while in use is a `shm_overrun_in_use` gap. 0: each tensor is copied out of the ring, as before.",
            default=True),
    Setting("MIA_STREAM_SHM_AHEAD_BYTES", "size", "bus",
            "How far a publisher's ring may run ahead of what the broker has received before tensor frames are "
            "dropped at the source (`shm_ahead_of_broker`); 0: no bound.",
            default_doc="a quarter of the ring", minimum=0),
    Setting("MIA_STREAM_RUN_DIR", "path", "bus",
            "The default run dir (ipc sockets) when no broker address is given.",
            default_doc="/tmp/mia_stream-$UID"),
    Setting("MIA_STREAM_KEYS", "path", "bus",
            "CURVE key dir (`mia-stream keys DIR`) that peers use when given none; needed for tcp."),
    Setting("MIA_STREAM_KEY_NAME", "text", "bus",
            "The client key name within the key dir.", default_doc="producer (publishers), consumer (others)"),
    Setting("MIA_STREAM_METRICS_PORT", "int", "bus",
            "Opt-in Prometheus metrics (`mia_stream_*`, docs/nats.md): each mia_stream process (broker, "
            "publishers in the drain sidecars, consumers, analyzers, bridges) serves /metrics on the first free "
            "port of PORT .. PORT+63; unset: no metrics server.", minimum=1),
    Setting("MIA_STREAM_METRICS_HOST", "text", "bus",
            "The address the metrics servers listen on.", default="127.0.0.1"),
    # ---- broker (limits per peer: docs/security.md says what happens past each)
    Setting("MIA_STREAM_BROKER_MAX_STATS_BYTES", "size", "broker",
            "Bytes of free-form `stats` a peer's heartbeat may carry (its header); a larger heartbeat is still a "
            "heartbeat, its stats are not kept (`refused_stats_too_large`, ErrorNotice `stats_too_large`). "
            "Flag `--max-stats-bytes`.", default=64 << 10, minimum=0),
    Setting("MIA_STREAM_BROKER_MAX_STREAMS_PER_PRODUCER", "int", "broker",
            "Streams one producer connection may hold open (started, not ended) at once; a start past it is "
            "refused (`refused_too_many_streams`, ErrorNotice `too_many_streams`). Flag "
            "`--max-streams-per-producer`.", default=65536, minimum=1),
    Setting("MIA_STREAM_BROKER_MAX_REQUESTS_PER_MESSAGE", "int", "broker",
            "Requests one columnar message (step_batch, token_batch, analysis, gap_batch) may name; a larger "
            "one is refused whole (`refused_too_many_requests`, ErrorNotice `too_many_requests`). Flag "
            "`--max-requests-per-message`.", default=16384, minimum=1),
    Setting("MIA_STREAM_BROKER_MAX_PATTERNS", "int", "broker",
            "Glob patterns one consumer may hold (all its subscribes together); a subscribe past it is refused "
            "(`refused_too_many_patterns`, ErrorNotice `too_many_patterns`). Flag `--max-patterns`.",
            default=1024, minimum=1),
    Setting("MIA_STREAM_BROKER_MAX_GAPS_PER_STREAM", "int", "broker",
            "Producer gap notices one stream's late-join buffer keeps in place; past it they are still delivered "
            "live, and kept merged into seq ranges that a late joiner gets as one notice after the start "
            "(`producer_gaps_merged`): nothing is lost, memory stays bounded. Flag "
            "`--max-gaps-per-stream`.", default=1024, minimum=1),
    Setting("MIA_STREAM_BROKER_CONSUMER_PIPE_MESSAGES", "int", "broker",
            "zmq messages the broker's consumers socket holds per consumer beyond its queue (SNDHWM; a batch is "
            "one, at most 1 MiB). With a credit window the window bounds it by bytes; a consumer with window 0 "
            "that never reads pins at most this many. Flag `--consumer-pipe-messages`.", default=64,
            minimum=1),
    # ---- consumers
    Setting("MIA_STREAM_RECORDING_MAX_CHUNK_BYTES", "size", "consumers",
            "Bytes a compressed MCAP chunk of a recording may declare uncompressed; a larger one is refused "
            "before it is decompressed (`CorruptRecordingError`), and none decompresses past what it declares. "
            "Uncompressed chunks are read from the file, unbounded by it; `mia-stream record --compression lz4` "
            "keeps its compressed chunks within it and writes a larger message uncompressed.",
            default=64 * MiB, minimum=1),
    Setting("MIA_STREAM_TRUSTED_ANALYZERS", "text", "consumers",
            "Comma-separated `producer_id` prefixes of the analyses whose alerts may be acted on (abort, steer: "
            "`AlertWatcher`, `AlertActor`); other analyses are ignored, counted (`untrusted_analyses_ignored`) "
            "and logged. With CURVE roles a prefix names the analyzer key (docs/security.md).",
            default="analyzer/"),
    # ---- files
    Setting("MIA_STREAM_CACHE", "path", "files", "Root of mia_stream's caches (models, vectors).",
            default_doc="~/.cache/mia_stream"),
    Setting("MIA_STREAM_MODEL", "text", "files",
            "The model the demo and `StreamLLM` load: a local HF model dir, or an HF id already in the local cache.",
            default_doc="the embedded SmolLM2-135M-Instruct"),
    Setting("MIA_STREAM_VECTORS", "path", "files", "Where named steering vectors are stored.",
            default_doc="$MIA_STREAM_CACHE/vectors"),
    Setting("MIA_STREAM_PROBES", "path", "files", "Where registered detector probes are stored "
            "(`mia-stream probes add`).", default_doc="$MIA_STREAM_CACHE/probes"),
    # ---- setup (read by the shell scripts; listed here so that every name is in one table)
    Setting("MIA_STREAM_VENV", "path", "setup", "The virtualenv the scripts create and use.", default_doc="./.venv"),
    Setting("MIA_STREAM_SETUP_NEED_GB", "int", "setup", "Free disk (GiB) setup.sh requires for a fresh venv.",
            default=6, minimum=0),
    # ---- tests
    Setting("MIA_STREAM_GPU_MODELS", "path", "tests", "Where tests/test_gpu.py finds the random GPU test models.",
            default=Path("/tmp/models")),
    Setting("MIA_STREAM_TP_DEVICE", "choice", "tests", "Where tests/test_tp.py runs its TP engines.",
            default="cpu", choices=("cpu", "cuda")),
    Setting("MIA_STREAM_TP_DTYPE", "text", "tests", "The dtype of tests/test_tp.py's engines.",
            default_doc="float32 on cpu, bfloat16 on cuda"),
    # ---- internal
    Setting("MIA_STREAM_DEMO_OUT", "path", "internal", "The file the demo's consumer process writes its lines to."),
    Setting("MIA_STREAM_DEMO_TAG", "text", "internal", "The demo consumer's line tag.", default="live"),
    Setting("MIA_STREAM_DEMO_STREAMS", "int", "internal",
            "How many requests the demo's risk printer waits for (their ends and last scores) before it stops.",
            default=3),
    Setting("MIA_STREAM_CONTROL_TOKEN", "text", "internal",
            "The random part of an engine's control id (`host:pid:engine:TOKEN`, StreamStart.control_id): made "
            "(16 hex digits) by the first vLLM process that loads the plugin, inherited by the engine core and its "
            "workers, so a peer cannot guess the id to take the engine's steering commands (docs/security.md). "
            "Letters, digits, `_` and `-` only.", default_doc="random, per launching process"),
)

_TRUE = frozenset(("1", "true", "yes", "on"))
_FALSE = frozenset(("0", "false", "no", "off"))
_SIZE = re.compile(r"^(\d+)\s*(?:([KMGT])(?:I?B)?)?$", re.IGNORECASE)
_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def setting(name: str) -> Setting:
    try:
        return SETTINGS[name]
    except KeyError:
        raise SettingError(f"{name} is not a mia_stream setting (add it to mia_stream.settings.SETTINGS)") from None


def raw(name: str) -> str | None:
    """The variable's text, stripped; None when unset or empty."""
    setting(name)
    value = os.environ.get(name, "").strip()
    return value or None


def _bad(s: Setting, value: str, why: str = "") -> SettingError:
    return SettingError(f"{s.name}={value!r}: expected {s.expected()}{why}")


def _of(name: str, form: str) -> Setting:
    s = setting(name)
    if s.form != form:
        raise SettingError(f"{name} is a {s.form} setting, not {form}")
    return s


def get_int(name: str) -> int | None:
    s = _of(name, "int")
    value = raw(name)
    if value is None:
        return s.default
    try:
        n = int(value, 10)
    except ValueError:
        raise _bad(s, value) from None
    if s.minimum is not None and n < s.minimum:
        raise _bad(s, value)
    return n


def get_size(name: str) -> int | None:
    """Bytes."""
    s = _of(name, "size")
    value = raw(name)
    if value is None:
        return s.default
    m = _SIZE.match(value)
    if m is None:
        raise _bad(s, value)
    n = int(m.group(1)) * (_SUFFIX[m.group(2).upper()] if m.group(2) else s.unit)
    if s.minimum is not None and n < s.minimum:
        raise _bad(s, value)
    return n


def get_flag(name: str) -> bool:
    s = _of(name, "flag")
    value = raw(name)
    if value is None:
        return bool(s.default)
    low = value.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise _bad(s, value)


def get_choice(name: str) -> str:
    s = _of(name, "choice")
    value = raw(name)
    if value is None:
        return s.default
    low = value.lower()
    if low not in s.choices:
        raise _bad(s, value)
    return low


def get_path(name: str) -> Path | None:
    s = _of(name, "path")
    value = raw(name)
    return Path(value).expanduser() if value is not None else s.default


def get_text(name: str) -> str | None:
    s = setting(name)
    if s.form not in ("text", "address"):
        raise SettingError(f"{name} is a {s.form} setting, not text")
    value = raw(name)
    return value if value is not None else s.default


def get_address(name: str = "MIA_STREAM_BROKER") -> str | None:
    _of(name, "address")
    return raw(name)


# ---------------------------------------------------------------------------------------------- the README table
def markdown_table() -> str:
    """The README's table of settings (scripts/settings_table.py writes it between its markers)."""
    lines = ["| setting | form | default | what it does |", "|---|---|---|---|"]
    for scope, where in SCOPES.items():
        lines.append(f"| **{scope}** | | | *{where}* |")
        for s in SETTINGS.values():
            if s.scope == scope:
                lines.append(f"| `{s.name}` | {s.form_text()} | {s.default_text()} | {s.doc} |")
    return "\n".join(lines) + "\n"
