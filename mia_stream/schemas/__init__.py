"""The wire format of mia_stream: typed messages and their encoding (spec: docs/wire-format.md).

Producers, the broker and consumers all speak through this package and nothing else.
"""

from mia_stream.schemas import _messages  # noqa: F401  (first: it registers the kinds of _batches)
from mia_stream.schemas._batches import Analysis, AnalysisBatch, GapBatch, RowGroup, StepBatch, TokenBatch
from mia_stream.schemas._codec import (COLUMNAR_KINDS, DEFAULT_MAX_MESSAGE_BYTES, MULTI_REQUEST_KINDS,
                                      columnar_requests, compact, decode, decode_header, encode, encode_batch,
                                      has_partial_inline_rows, inline_shm, references_shm, select_requests, shm_extent, shm_loss_gap, shm_loss_gaps,
                                      shm_loss_reason, split_batch)
from mia_stream.schemas._oob import BufferSink, BufferSource, is_ring_name
from mia_stream.schemas._messages import (FINISH_REASONS, MESSAGE_TYPES, SCHEMA_VERSION, Credit, ErrorNotice,
                                          GapNotice, Heartbeat, Message, SteeringAck, SteeringCommand,
                                          StreamEnd, StreamStart, Subscribe, TensorFrame, TokenFrame,
                                          Unsubscribe, request_topic, stream_key)
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
]
