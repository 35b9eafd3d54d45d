"""Every message kind by its ``kind`` name: the registry the codec validates and decodes by.

It sits above both message modules (the per-request kinds of ``_messages``; the columnar kinds of ``_batches``,
which build on them), so the dependency runs one way: ``_messages`` <- ``_batches`` <- ``_kinds`` <- codec.
"""

from __future__ import annotations

from mia_stream.schemas._batches import BATCH_MESSAGE_TYPES, GapBatch
from mia_stream.schemas._messages import (Credit, ErrorNotice, GapNotice, Heartbeat, Message, SteeringAck,
                                          SteeringCommand, StreamEnd, StreamStart, Subscribe, TensorFrame, TokenFrame,
                                          Unsubscribe)

MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.KIND: cls
    for cls in (StreamStart, TensorFrame, TokenFrame, StreamEnd, GapNotice, Heartbeat,
                SteeringCommand, SteeringAck, Subscribe, Unsubscribe, Credit, ErrorNotice, *BATCH_MESSAGE_TYPES,
                GapBatch)
}

COLUMNAR_KINDS = frozenset(cls.KIND for cls in BATCH_MESSAGE_TYPES)  # name many requests, one seq of each
# every kind that names many requests (routed, recorded and narrowed by request_ids): the columnar kinds and
# gap_batch, which has no seqs
MULTI_REQUEST_KINDS = COLUMNAR_KINDS | {GapBatch.KIND}
