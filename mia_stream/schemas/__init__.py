"""The wire format of mia_stream: typed messages and their encoding (spec: docs/wire-format.md).

Producers, the broker and consumers all speak through this package and nothing else. It depends on
``mia_stream.errors`` only; shared-memory rings reach the codec through the ``_oob`` hook.

Modules, each importing only those listed before it: ``_tensors`` (tensors on the wire), ``_messages``
(per-request kinds), ``_batches`` (columnar kinds), ``_kinds`` (the registry of every kind), ``_steering`` (op names,
actions and codes), ``_framing``, ``_validate``, ``_entries``, ``_columnar``, ``_codec`` (encode/decode),
``_rings`` (ring references), ``_selection`` (a subscriber's layers, positions, tensors); ``seqranges`` and ``_oob`` stand alone.
"""

from mia_stream.schemas._batches import Analysis, AnalysisBatch, GapBatch, RowGroup, StepBatch, TokenBatch
from mia_stream.schemas._codec import compact, decode, decode_header, encode
from mia_stream.schemas._columnar import columnar_requests, has_partial_inline_rows, select_requests
from mia_stream.schemas._framing import (BATCH_KIND, DEFAULT_MAX_MESSAGE_BYTES, SHM_RING_KEY, batch_header,
                                         encode_batch, split_batch)
from mia_stream.schemas._kinds import COLUMNAR_KINDS, MESSAGE_TYPES, MULTI_REQUEST_KINDS
from mia_stream.schemas._messages import (FINISH_REASONS, SCHEMA_VERSION, Credit, ErrorNotice, GapNotice, Heartbeat,
                                          Message, SteeringAck, SteeringCommand, StreamEnd, StreamStart, Subscribe,
                                          TensorFrame, TokenFrame, Unsubscribe, request_topic, stream_key)
from mia_stream.schemas._oob import BufferSink, BufferSource, is_ring_name
from mia_stream.schemas._selection import RELATIVE_POSITIONS, ViewSelection, parse_selection, select_view
from mia_stream.schemas._rings import (inline_shm, references_shm, shm_extent, shm_loss_gap, shm_loss_gaps,
                                       shm_loss_reason)
from mia_stream.schemas._steering import (OP_ABLATE, OP_ADD, OP_CAP, OP_CODES, OP_NONE, STEER_ACTIONS, STEER_OPS)
from mia_stream.schemas._tensors import WIRE_DTYPES, Shard, Tensor

__all__ = [
    "Analysis", "AnalysisBatch", "COLUMNAR_KINDS", "GapBatch", "MULTI_REQUEST_KINDS", "RowGroup", "StepBatch", "TokenBatch", "columnar_requests",
    "compact", "has_partial_inline_rows", "select_requests", "shm_loss_gaps",
    "DEFAULT_MAX_MESSAGE_BYTES", "FINISH_REASONS", "MESSAGE_TYPES", "SCHEMA_VERSION", "WIRE_DTYPES",
    "Credit", "ErrorNotice", "GapNotice", "Heartbeat", "Message", "Shard", "SteeringAck", "SteeringCommand",
    "StreamEnd", "StreamStart", "Subscribe", "Tensor", "TensorFrame", "TokenFrame", "Unsubscribe",
    "BufferSink", "BufferSource", "is_ring_name", "decode", "decode_header", "encode", "encode_batch", "inline_shm",
    "references_shm", "request_topic", "shm_extent", "shm_loss_gap", "shm_loss_reason",
    "split_batch", "stream_key",
    "BATCH_KIND", "SHM_RING_KEY", "batch_header",
    "RELATIVE_POSITIONS", "ViewSelection", "parse_selection", "select_view",
    "OP_ABLATE", "OP_ADD", "OP_CAP", "OP_CODES", "OP_NONE", "STEER_ACTIONS", "STEER_OPS",
]
