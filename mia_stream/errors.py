"""The error hierarchy of mia_stream: catch ``MiaStreamError`` for everything, or a branch of it.

    MiaStreamError
    ├── WireError                  a message that cannot be decoded
    │   ├── MalformedFrameError    wrong framing, missing or mistyped header fields, bad buffers
    │   ├── SchemaVersionError     a header whose major schema version this decoder does not know
    │   ├── OversizedMessageError  a message larger than the configured limit
    │   ├── ChecksumError          a tensor whose bytes do not match the checksum sent with it
    │   └── SharedBufferError      a tensor carried in a producer's shared-memory ring that cannot be read
    │       ├── ShmOverrunError    the ring was overwritten before this reader got to it (a loss, reported)
    │       └── ShmUnavailableError  the ring cannot be opened here (another host, user or a gone producer)
    ├── SpecError (ValueError)     an invalid capture or steering spec
    │   ├── CaptureSpecError
    │   └── SteeringSpecError
    ├── StreamError                a stream that cannot be assembled
    │   └── IncompleteShardError   a TP step missing some ranks' shards
    ├── TransportError             sockets, endpoints, keys
    │   ├── BrokerTimeoutError     no answer from the broker in time
    │   └── BridgeError            a NATS server, stream or bridge setting that cannot be used (mia_stream.bridge)
    ├── SteeringCommandError       a steering command the producer refused (unknown request, not authorised…)
    ├── ModelError                 a model dir that is missing or corrupt
    ├── SettingError (ValueError)  a MIA_STREAM_* environment setting that does not parse
    ├── SpanError (ValueError)     a prompt whose parts cannot be mapped to token spans (mia_stream.spans)
    ├── AnalyzerError              an analyzer that cannot run (mia_stream.analyzers)
    │   ├── AnalyzerConfigError (ValueError)  a malformed analyzer config or probe file
    │   ├── AnalyzerInputError     a stream lacking what the analyzer needs (layers, Q/K, spans)
    │   └── ProbeDataError (ValueError)  a labels file or recording that cannot train or evaluate a probe
    └── UnsupportedVLLMError       a vLLM version or runner the producer adapter does not support
"""

from __future__ import annotations


class MiaStreamError(Exception):
    """Base of every error mia_stream raises on purpose."""


class WireError(MiaStreamError):
    """A message on the bus (or in a recording) could not be decoded."""


class MalformedFrameError(WireError):
    pass


class SchemaVersionError(WireError):
    pass


class OversizedMessageError(WireError):
    pass


class ChecksumError(WireError):
    pass


class SharedBufferError(WireError):
    """A tensor whose bytes travel in the producer's shared-memory ring could not be read from it."""


class ShmOverrunError(SharedBufferError):
    pass


class ShmUnavailableError(SharedBufferError):
    pass


class SpecError(MiaStreamError, ValueError):
    """An invalid ``extra_args["mia_stream"]`` spec; the message says which field and why."""


class CaptureSpecError(SpecError):
    pass


class SteeringSpecError(SpecError):
    pass


class DetectSpecError(SpecError):
    """A bad ``detect`` entry: an unknown or malformed probe, one for another model, a bad alert policy or action."""


class StreamError(MiaStreamError):
    pass


class IncompleteShardError(StreamError):
    pass


class TransportError(MiaStreamError):
    pass


class BrokerTimeoutError(TransportError):
    pass


class BridgeError(TransportError):
    pass


class SteeringCommandError(MiaStreamError):
    pass


class ModelError(MiaStreamError):
    pass


class SettingError(MiaStreamError, ValueError):
    """A ``MIA_STREAM_*`` environment variable that does not parse; the message names it and the form it takes."""


class SpanError(MiaStreamError, ValueError):
    """A chat prompt whose parts cannot be found in its rendering (``mia_stream.spans``)."""


class AnalyzerError(MiaStreamError):
    """An analyzer that cannot run; the message names the missing or bad piece in one line."""


class AnalyzerConfigError(AnalyzerError, ValueError):
    pass


class AnalyzerInputError(AnalyzerError):
    pass


class ProbeDataError(AnalyzerError, ValueError):
    """``mia-stream probe train/eval``: a labels file or recording that does not hold what training needs."""


class UnsupportedVLLMError(MiaStreamError):
    pass
