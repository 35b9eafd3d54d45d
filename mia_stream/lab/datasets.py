"""Evaluation sets made here from facts that Python packages ship (nothing downloads): questions with checkable
answers, labelled automatically from what the model answers.

- ``capital_questions()``: "What is the capital of X?" (and two rephrasings) for the ~250 countries of the
  ``countryinfo`` package; correct when the capital's words appear in the answer.
- ``element_questions()``: chemical symbol, atomic number and element-from-symbol questions for the 118 elements
  of the ``periodictable`` package.

Each item: ``id``, ``set``, ``group`` (the fact: items of one group always land on the same side of a train/test
split), ``entity`` (``country:FR``, ``element:26``: the key ``hallucination_data.entity_split`` groups every set
by), ``question``, ``answer`` (the reference), ``kind`` (which checker). ``is_correct(item, text)`` labels an
answer (``hallucination_data.check_answer``'s rules: a capital answer naming other cities too is wrong, "I'm not
sure." is no symbol); ``label = 1`` means the answer is wrong (a hallucination).
"""

from __future__ import annotations

import re
import unicodedata
from typing import Iterable

INSTRUCTION = "Answer in a few words."


def _norm(text: str) -> str:
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c)).lower()
    return " " + " ".join(re.findall(r"[a-z0-9]+", text)) + " "


def capital_questions() -> list[dict]:
    import countryinfo

    from mia_stream.lab.fact_questions import countries

    iso = {c["name"]: c["iso2"] for c in countries()}

    items = []
    seen = set()
    for c in countryinfo.all_countries():
        try:
            name, capital = c.name(), c.capital()
        except Exception:  # entries without the field
            continue
        if isinstance(capital, list):  # one entry lists it
            capital = capital[0] if capital else None
        if not isinstance(name, str) or not isinstance(capital, str) or not capital or name in seen:
            continue
        seen.add(name)
        if _norm(capital).strip() in _norm(name):  # "Singapore": repeating the question would count as right
            continue
        for k, q in enumerate((f"What is the capital of {name}?", f"Which city is the capital of {name}?",
                               f"Name the capital city of {name}.")):
            items.append({"id": f"capital-{len(seen)}-{k}", "set": "capitals", "group": f"capital:{name}",
                          "entity": f"country:{iso.get(name, name)}", "question": q, "answer": capital,
                          "kind": "capital"})
    return items


def element_questions() -> list[dict]:
    import periodictable

    items = []
    for e in periodictable.elements:
        if e.number <= 0:
            continue
        name = e.name.capitalize()
        g = f"element:{e.number}"
        items.append({"id": f"symbol-{e.number}", "set": "elements", "group": g, "entity": g,
                      "question": f"What is the chemical symbol of {name}?", "answer": e.symbol, "kind": "symbol"})
        items.append({"id": f"number-{e.number}", "set": "elements", "group": g, "entity": g,
                      "question": f"What is the atomic number of {name}?", "answer": str(e.number),
                      "kind": "first_number"})
        items.append({"id": f"element-{e.number}", "set": "elements", "group": g, "entity": g,
                      "question": f"Which element has the chemical symbol {e.symbol}?", "answer": name,
                      "kind": "contains"})
    return items


def is_correct(item: dict, text: str) -> bool:
    """Whether ``text`` (the model's answer) gives ``item``'s reference answer."""
    kind, ref = item["kind"], item["answer"]
    if kind == "contains":
        return _norm(ref) in _norm(text)
    if kind in ("symbol", "capital"):  # the first symbol given (no pronoun "I"); a capital and no other city
        from mia_stream.lab.hallucination_data import check_answer

        return check_answer(item, text)
    if kind == "first_number":
        m = re.search(r"\d+", text)
        return m is not None and m.group(0) == ref
    raise ValueError(f"unknown answer kind {kind!r}")


def chat_messages(item: dict) -> list[dict]:
    return [{"role": "user", "content": f"{item['question']} {INSTRUCTION}"}]


def group_split(items: Iterable[dict], test_fraction: float = 0.3, seed: int = 0) -> tuple[list[int], list[int]]:
    """Indices of a train/test split by ``group`` (deterministic for a seed)."""
    import random

    items = list(items)
    groups = sorted({it["group"] for it in items})
    rng = random.Random(seed)
    rng.shuffle(groups)
    test_groups = set(groups[:round(len(groups) * test_fraction)])
    train = [i for i, it in enumerate(items) if it["group"] not in test_groups]
    test = [i for i, it in enumerate(items) if it["group"] in test_groups]
    return train, test
