"""The vLLM plugin (entry point ``vllm.general_plugins: mia_stream``).

Active only when ``MIA_STREAM_BROKER`` names a broker endpoint; with it unset, this function returns
at once and vLLM runs exactly as without mia_stream.
"""

from __future__ import annotations

import os

from mia_stream import settings
from mia_stream.bus.transport import ENV_BROKER as BROKER_ENV


def active() -> bool:
    return settings.get_address(BROKER_ENV) is not None


def register() -> None:
    if not active():
        return
    # Compiled artifacts made without the capture ops must not be reused with them (and the reverse):
    # vLLM's compile-cache key does not see the plugin.
    os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
    from mia_stream.producer import _vllm_adapter

    _vllm_adapter.install()

