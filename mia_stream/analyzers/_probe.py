"""Linear probe files (format ``mia_stream.probe/1``): the loader lives in ``mia_stream.spec.probes``, so the
engine (in-engine detectors) and the analyzers read a probe file the same way."""

from mia_stream.spec.probes import (FORMAT, PROBES_DIR, LinearProbe, load_probe,  # noqa: F401
                                    resolve_probe_path, sigmoid)

__all__ = ["FORMAT", "LinearProbe", "PROBES_DIR", "load_probe", "resolve_probe_path", "sigmoid"]
