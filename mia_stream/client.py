"""Public alias of ``mia_stream.served.client`` (``from mia_stream.client import StreamClient``)."""

from mia_stream.served.client import *  # noqa: F401,F403
from mia_stream.served.client import __all__  # noqa: F401
