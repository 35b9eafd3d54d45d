"""attention_tracker: prompt-injection detection from where the last prompt token looks.

Method: Kuo-Han Hung, Ching-Yun Ko, Ambrish Rawat, I-Hsin Chung, Winston H. Hsu, Pin-Yu Chen, "Attention
Tracker: Detecting Prompt Injection Attacks in LLMs", arXiv:2411.00348 (2024), NAACL Findings 2025.

An injected instruction inside the data distracts a few "important" heads: at the last prompt token (the row
that predicts the first answer token) they attend less to the real instruction. Per head ``(l, h)``::

    ratio[l, h] = sum_{i in I} alpha[l, h, last, i] / (sum_{i in I} alpha + sum_{i in D} alpha + 1e-8)

with ``I`` the instruction's tokens and ``D`` the data's; the focus score is the mean ratio over the important
heads, and a prompt is flagged when it falls below a threshold. Attention is rebuilt from the captured
post-RoPE Q/K (``_attention.attention_rows``).

Head discovery (the paper's section 3.3): run normal data and the same data with an appended "ignore previous
instructions" attack under one instruction; keep the heads whose ratio separates the two sets,
``(mu_N - k sigma_N) - (mu_A + k sigma_A) > 0`` with ``k = 4``. ``discover_heads`` does the arithmetic,
``mia-stream analyze attention_tracker --discover-heads`` runs it on a model and writes the config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from mia_stream.analyzers._attention import HeadSet, attention_rows, kv_index, span_mask
from mia_stream.errors import AnalyzerConfigError, AnalyzerInputError

NAME = "attention_tracker"
VERSION = "1"
EPS = 1e-8  # the reference implementation's epsilon in the ratio's denominator
DEFAULT_K = 4.0


def instruction_ratios(alpha: np.ndarray, instruction: np.ndarray, data: np.ndarray) -> np.ndarray:
    """``alpha [..., T]`` (attention of one query row over its keys), boolean masks ``[T]`` of the instruction
    and data tokens -> ``[...]``: the share of attention to the instruction, ``S_I / (S_I + S_D + eps)``."""
    s_i = alpha[..., instruction].sum(axis=-1)
    s_d = alpha[..., data].sum(axis=-1)
    return s_i / (s_i + s_d + EPS)


def head_ratios(q_last: np.ndarray, k: np.ndarray, kv_of_q: np.ndarray, last_position: int,
                instruction: Sequence[tuple[int, int]], data: Sequence[tuple[int, int]],
                scale: float | None = None) -> np.ndarray:
    """Per captured (layer, head) ratio ``[L, Hq]`` from Q at the last prompt position ``q_last [L, 1, Hq, D]``
    and K at positions ``0..last_position`` ``k [L, last_position + 1, Hk, D]``."""
    n = k.shape[1]
    if n != last_position + 1:
        raise AnalyzerInputError(f"K covers {n} positions; the last prompt token is at {last_position}")
    alpha = attention_rows(q_last, k, [last_position], kv_of_q, scale)[:, :, 0]  # [L, Hq, T]
    inst = span_mask(instruction, n, "instruction span")
    dat = span_mask(data, n, "data span")
    if (inst & dat).any():
        raise AnalyzerInputError("the instruction and data spans overlap")
    return instruction_ratios(alpha, inst, dat)


def head_margins(normal: np.ndarray, attack: np.ndarray, k: float = DEFAULT_K) -> np.ndarray:
    """``(mu_N - k sigma_N) - (mu_A + k sigma_A)`` per head from ratios ``normal [N, L, H]``, ``attack [M, L, H]``."""
    normal = np.asarray(normal, dtype=np.float64)
    attack = np.asarray(attack, dtype=np.float64)
    return (normal.mean(0) - k * normal.std(0)) - (attack.mean(0) + k * attack.std(0))


@dataclass
class TrackerConfig:
    """What ``attention_tracker`` reads from its ``--config`` JSON file."""

    heads: HeadSet
    threshold: float
    instruction_span: str = "instruction"
    data_span: str = "data"
    scale: float | None = None  # attention scale; None: head_dim ** -0.5
    extra: dict = field(default_factory=dict)  # discovery statistics etc., kept as written

    @classmethod
    def from_dict(cls, d: Any, num_layers: int, num_heads: int) -> "TrackerConfig":
        if not isinstance(d, dict):
            raise AnalyzerConfigError(f"{NAME} config must be a JSON object, got {type(d).__name__}")
        known = {"heads", "threshold", "instruction_span", "data_span", "scale"}
        missing = [x for x in ("heads", "threshold") if x not in d]
        if missing:
            raise AnalyzerConfigError(f"{NAME} config lacks {missing} (write one with --discover-heads)")
        thr = d["threshold"]
        if not isinstance(thr, (int, float)) or isinstance(thr, bool) or not np.isfinite(thr):
            raise AnalyzerConfigError(f"{NAME} config: threshold must be a number, got {thr!r}")
        for key in ("instruction_span", "data_span"):
            if key in d and (not isinstance(d[key], str) or not d[key]):
                raise AnalyzerConfigError(f"{NAME} config: {key} must be a span name, got {d[key]!r}")
        scale = d.get("scale")
        if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale <= 0):
            raise AnalyzerConfigError(f"{NAME} config: scale must be a positive number, got {scale!r}")
        try:
            heads = HeadSet.parse(d["heads"], num_layers, num_heads, f"{NAME} config: heads")
        except AnalyzerInputError as e:
            raise AnalyzerConfigError(str(e)) from None
        return cls(heads, float(thr), d.get("instruction_span", "instruction"), d.get("data_span", "data"),
                   None if scale is None else float(scale), {k: v for k, v in d.items() if k not in known})

    @classmethod
    def load(cls, path: str | Path, num_layers: int, num_heads: int) -> "TrackerConfig":
        try:
            d = json.loads(Path(path).read_text())
        except OSError as e:
            raise AnalyzerConfigError(f"{NAME} config {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise AnalyzerConfigError(f"{NAME} config {path} is not valid JSON: {e}") from None
        return cls.from_dict(d, num_layers, num_heads)

    def to_dict(self) -> dict:
        return {"heads": [list(p) for p in self.heads.pairs], "threshold": self.threshold,
                "instruction_span": self.instruction_span, "data_span": self.data_span,
                **({"scale": self.scale} if self.scale is not None else {}), **self.extra}

    def capture_spec(self) -> dict:
        return {"qk": self.heads.qk_spec("prompt")}


def focus_score(ratios: np.ndarray, layers: Sequence[int], heads: Sequence[int], chosen: HeadSet) -> float:
    """Mean ratio over the chosen heads, from ``ratios [len(layers), len(heads)]`` of the captured ones."""
    return float(chosen.select(ratios, layers, heads).mean())


def score_request(cfg: TrackerConfig, q_last: np.ndarray, k: np.ndarray, layers: Sequence[int],
                  q_heads: Sequence[int], k_heads: Sequence[int], num_heads: int, num_kv_heads: int,
                  prompt_len: int, spans: dict) -> dict:
    """One request's result: ``focus`` (the focus score), ``ratios`` of the chosen heads, ``alert``."""
    for name in (cfg.instruction_span, cfg.data_span):
        if name not in spans:
            raise AnalyzerInputError(f"the request's spans lack {name!r} (it has {sorted(spans)})")
    ratios = head_ratios(q_last, k, kv_index(q_heads, k_heads, num_heads, num_kv_heads), prompt_len - 1,
                         spans[cfg.instruction_span], spans[cfg.data_span], cfg.scale)
    chosen = cfg.heads.select(ratios, layers, q_heads)
    focus = float(chosen.mean())
    return {"focus": focus, "ratios": chosen, "alert": focus < cfg.threshold}


def discover_heads(normal: np.ndarray, attack: np.ndarray, k: float = DEFAULT_K) -> dict:
    """The heads that separate normal from attacked prompts, and a threshold between the two sets' focus
    scores over those heads. ``normal [N, L, H]``, ``attack [M, L, H]``: every head's ratio per prompt."""
    margins = head_margins(normal, attack, k)
    keep = np.argwhere(margins > 0)
    best = np.unravel_index(int(np.argmax(margins)), margins.shape)
    out = {"k": k, "num_normal": int(len(normal)), "num_attack": int(len(attack)),
           "best_head": [int(best[0]), int(best[1])], "best_margin": float(margins[best]),
           "heads": [[int(l), int(h)] for l, h in keep]}
    if len(keep):
        sel = (keep[:, 0], keep[:, 1])
        fn = np.asarray(normal)[:, sel[0], sel[1]].mean(1)
        fa = np.asarray(attack)[:, sel[0], sel[1]].mean(1)
        out["threshold"] = float((fn.mean() + fa.mean()) / 2)  # midway between the two sets' mean focus
        out["focus_normal_mean"] = float(fn.mean())
        out["focus_attack_mean"] = float(fa.mean())
    return out
