"""Alert policies for detector analyzers: the one implementation lives in ``mia_stream.spec.alerts``, so a policy
in an analyzer's config and one in a request's ``detect`` spec (judged inside the engine) behave the same."""

from mia_stream.spec.alerts import (DEFAULTS, MAX_WINDOW, MODES, AlertAction, AlertPolicy,  # noqa: F401
                                    risk_column)

__all__ = ["AlertAction", "AlertPolicy", "DEFAULTS", "MAX_WINDOW", "MODES", "risk_column"]
