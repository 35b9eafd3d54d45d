"""Public alias of ``mia_stream.spec.vectors`` (``from mia_stream.producer.vectors import register_vector``)."""

from mia_stream.spec.vectors import *  # noqa: F401,F403
from mia_stream.spec.vectors import __all__  # noqa: F401
