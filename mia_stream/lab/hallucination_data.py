"""Question sets for training and evaluating the hallucination detectors, made here (nothing downloads), and
the automatic labelling of the model's own answers: right or wrong, which characters are the answer, and which
answers of several samples mean the same (for semantic entropy).

Sets (each item: ``id``, ``set``, ``group``, ``question``, ``answer`` (the reference), ``kind`` (its checker),
``difficulty``):

- ``arithmetic``: sums, differences and products of graded difficulty (``add1`` single digits ... ``mul2`` two
  two-digit numbers), generated from a seed; correct when the model's result number equals the true one.
- ``capitals``: "What is the capital of X?" for the countries of the ``countryinfo`` package (one phrasing per
  country, from ``datasets.capital_questions``); correct when the capital's words appear in the answer.
- ``elements``: chemical symbol and atomic number questions for the 118 elements of ``periodictable``
  (``datasets.element_questions``).
- ``populations``: "What is the population of X?" for the countries of ``countryinfo`` with at least a million
  people; correct when the first number given (with "million"/"billion") is within ``POPULATION_TOLERANCE`` of
  the package's figure (its figures are from about 2014; the tolerance covers the growth since).

``check_answer(item, text)`` labels an answer (True = right); ``answer_span(item, text)`` gives the character
range ``[start, stop)`` of the answer in the model's text: for a right answer where the reference is, else the
number it gives (numeric kinds) or its first run of content words (words not in the question nor in
``STOPWORDS``); None when the text has none. ``answer_key(item, text)`` is the normalized answer used to
cluster sampled answers: the number (populations: to two significant digits) or the span's words, lower-cased
with accents stripped. Clustering by this exact key stands in for the bidirectional-entailment clustering of
Kossen et al. / Farquhar et al. (2024): adequate for answers of a word or a number, not for sentences.
"""

from __future__ import annotations

import math
import random
import re
import unicodedata
from typing import Iterable, Sequence

from mia_stream.lab import datasets

SETS = ("arithmetic", "capitals", "elements", "populations")
POPULATION_TOLERANCE = 0.3  # relative
ARITHMETIC_LEVELS = (  # (name, op, range of a, range of b): graded difficulty
    ("add1", "+", (1, 9), (1, 9)),
    ("mul1", "times", (2, 9), (2, 9)),
    ("add2", "+", (10, 99), (10, 99)),
    ("sub2", "-", (20, 99), (10, 19)),
    ("mul21", "times", (11, 99), (2, 9)),
    ("add3", "+", (100, 999), (100, 999)),
    ("mul2", "times", (11, 99), (11, 99)),
)
STOPWORDS = frozenset("""
a an the of is are was be been it its this that these those in on at to for from by with as and or not no
what which who whom whose how name called known city capital country answer chemical symbol atomic number
element population people inhabitants approximately about around roughly estimated over nearly almost
i im sorry don dont know do does can cannot t s m million billion thousand
""".split())
_WORD = re.compile(r"[^\W_]+")
_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
_SCALE = re.compile(r"\s*(thousand|million|billion)", re.I)
_SCALES = {"thousand": 1e3, "million": 1e6, "billion": 1e9}


def _fold(text: str) -> str:
    """Lower case without accents (one character in, one out where possible)."""
    text = unicodedata.normalize("NFKD", text)
    return "".join(c for c in text if not unicodedata.combining(c)).lower()


def _words(text: str) -> list[tuple[int, int, str]]:
    """(start, stop, folded word) for each word of ``text`` (character offsets into ``text`` itself)."""
    return [(m.start(), m.end(), _fold(m.group(0))) for m in _WORD.finditer(text)]


# ------------------------------------------------------------------------------------------------ question sets

def arithmetic_questions(per_level: int = 40, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    items, seen = [], set()
    for level, op, (a0, a1), (b0, b1) in ARITHMETIC_LEVELS:
        n = 0
        while n < per_level:
            a, b = rng.randint(a0, a1), rng.randint(b0, b1)
            if (level, a, b) in seen:
                continue
            seen.add((level, a, b))
            result = a + b if op == "+" else a - b if op == "-" else a * b
            items.append({"id": f"arith-{level}-{a}-{b}", "set": "arithmetic", "group": f"arith:{level}:{a}:{b}",
                          "question": f"What is {a} {op} {b}?", "answer": str(result), "kind": "arithmetic",
                          "operands": [a, b], "difficulty": level})
            n += 1
    return items


def capital_questions() -> list[dict]:
    """One phrasing per country (the first of ``datasets.capital_questions``)."""
    return [dict(it, difficulty="capital") for it in datasets.capital_questions() if it["id"].endswith("-0")]


def element_questions() -> list[dict]:
    """Symbol and atomic-number questions (``datasets.element_questions`` without element-from-symbol)."""
    return [dict(it, difficulty=it["id"].split("-")[0]) for it in datasets.element_questions()
            if not it["id"].startswith("element-")]


def population_questions(min_population: int = 1_000_000) -> list[dict]:
    import countryinfo

    items, seen = [], set()
    for c in countryinfo.all_countries():
        try:
            name, pop = c.name(), c.population()
        except Exception:  # entries without the field
            continue
        if not isinstance(name, str) or not isinstance(pop, (int, float)) or pop < min_population or name in seen:
            continue
        seen.add(name)
        items.append({"id": f"population-{len(seen)}", "set": "populations", "group": f"population:{name}",
                      "question": f"What is the population of {name}?", "answer": str(int(pop)),
                      "kind": "population", "difficulty": "population"})
    return items


def question_set(sets: Sequence[str] = SETS, limit: int | None = None, seed: int = 0) -> list[dict]:
    """The items of ``sets``; ``limit``: at most this many per set, a seeded sample spread over its
    difficulties (the test uses small ones)."""
    makers = {"arithmetic": lambda: arithmetic_questions(seed=seed), "capitals": capital_questions,
              "elements": element_questions, "populations": population_questions}
    out = []
    for name in sets:
        if name not in makers:
            raise ValueError(f"unknown question set {name!r}; sets: {', '.join(SETS)}")
        items = makers[name]()
        if limit is not None and len(items) > limit:
            rng = random.Random(seed)
            keep = sorted(rng.sample(range(len(items)), limit))
            items = [items[i] for i in keep]
        out += items
    return out


def chat_messages(item: dict) -> list[dict]:
    """The question with the instruction in the user message and the template's default system prompt
    (``datasets.chat_messages``, as the other probes were trained): on a 100-question pilot, a system prompt
    holding the instruction instead made the model describe the country rather than name its capital."""
    return datasets.chat_messages(item)


# ------------------------------------------------------------------------------------------------ answers

def _numbers(text: str) -> list[tuple[int, int, float]]:
    """(start, stop, value) of each number, a following thousand/million/billion applied (span includes it)."""
    out = []
    for m in _NUMBER.finditer(text):
        raw = m.group(0).rstrip(",")
        try:
            value = float(raw.replace(",", ""))
        except ValueError:
            continue
        stop = m.start() + len(raw)
        s = _SCALE.match(text, stop)
        if s:
            value *= _SCALES[s.group(1).lower()]
            stop = s.end()
        out.append((m.start(), stop, value))
    return out


def _result_number(item: dict, text: str) -> tuple[int, int, float] | None:
    """The number the answer gives as its result: arithmetic skips a restatement of the operands ("7 times 8
    is 56": 56); other kinds take the first number."""
    nums = _numbers(text)
    if item["kind"] == "arithmetic":
        operands = list(item["operands"])
        while nums and operands and nums[0][2] == operands[0]:
            nums.pop(0)
            operands.pop(0)
    return nums[0] if nums else None


def _content_run(item: dict, text: str) -> tuple[int, int] | None:
    """The first maximal run of content words of ``text``: words neither in the question nor stopwords."""
    question = {w for _, _, w in _words(item["question"])}
    start = stop = None
    for a, b, w in _words(text):
        content = w not in question and w not in STOPWORDS
        if start is not None and (not content or text[stop:a].strip(" -'")):  # a stopword or punctuation ends it
            break
        if content:
            start, stop = (a if start is None else start), b
    return None if start is None else (start, stop)


def check_answer(item: dict, text: str) -> bool:
    """Whether ``text`` gives ``item``'s reference answer (True = right)."""
    kind = item["kind"]
    if kind == "arithmetic":
        n = _result_number(item, text)
        return n is not None and n[2] == float(item["answer"])
    if kind == "population":
        n = _result_number(item, text)
        ref = float(item["answer"])
        return n is not None and abs(n[2] - ref) <= POPULATION_TOLERANCE * ref
    return datasets.is_correct(item, text)


def answer_span(item: dict, text: str) -> tuple[int, int] | None:
    """Character range ``[start, stop)`` of the answer in ``text`` (see the module docstring); None if none."""
    kind = item["kind"]
    if kind in ("arithmetic", "population", "first_number"):
        n = _result_number(item, text)
        return None if n is None else (n[0], n[1])
    if kind == "symbol":
        m = re.search(rf"(?<![A-Za-z]){re.escape(item['answer'])}(?![a-z])", text)
        if m:
            return m.start(), m.end()
    elif kind == "contains":
        ref = [w for _, _, w in _words(item["answer"])]
        words = _words(text)
        for i in range(len(words) - len(ref) + 1):
            if [w for _, _, w in words[i:i + len(ref)]] == ref:
                return words[i][0], words[i + len(ref) - 1][1]
    return _content_run(item, text)


def answer_key(item: dict, text: str) -> str:
    """The normalized answer for clustering samples ("" when the text gives none)."""
    kind = item["kind"]
    if kind in ("arithmetic", "population", "first_number"):
        n = _result_number(item, text)
        if n is None:
            return ""
        v = n[2]
        if kind == "population" and v > 0:
            v = round(v, 1 - int(math.floor(math.log10(v))))  # two significant digits
        return f"{v:g}"
    span = answer_span(item, text)
    if span is None:
        return ""
    return " ".join(w for _, _, w in _words(text[span[0]:span[1]]))


def semantic_entropy(keys: Iterable[str]) -> tuple[float, int]:
    """Discrete semantic entropy (Farquhar et al. 2024, Kossen et al. 2024) of sampled answers clustered by
    ``answer_key``: ``-sum_c p_c ln p_c`` with ``p_c`` the fraction of samples in cluster ``c``; and the number of
    clusters. An empty key (no answer) is a cluster of its own."""
    counts: dict[str, int] = {}
    for k in keys:
        counts[k] = counts.get(k, 0) + 1
    n = sum(counts.values())
    if not n:
        return 0.0, 0
    return float(-sum(c / n * math.log(c / n) for c in counts.values())), len(counts)


def best_split(values: Sequence[float]) -> float:
    """Kossen et al.'s binarization of semantic entropy: the threshold that minimizes the summed squared
    deviation of the two classes from their means (``high`` = value > threshold)."""
    xs = sorted(set(float(v) for v in values))
    if len(xs) < 2:
        return xs[0] if xs else 0.0
    vals = [float(v) for v in values]
    best = None
    for lo, hi in zip(xs, xs[1:]):
        t = (lo + hi) / 2
        a = [v for v in vals if v <= t]
        b = [v for v in vals if v > t]
        cost = sum((v - sum(a) / len(a)) ** 2 for v in a) + sum((v - sum(b) / len(b)) ** 2 for v in b)
        if best is None or cost < best[0]:
            best = (cost, t)
    return best[1]


def token_char_ranges(tokenizer, token_ids: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, stop)`` in the decoded text of each token (decoding growing prefixes: exact for byte-level BPE,
    a token that ends inside a multi-byte character gets the characters completed by the next one)."""
    out, prev = [], 0
    for i in range(len(token_ids)):
        n = len(tokenizer.decode(list(token_ids[:i + 1]), skip_special_tokens=True))
        out.append((prev, max(prev, n)))
        prev = max(prev, n)
    return out


def span_token_indices(char_ranges: Sequence[tuple[int, int]], span: tuple[int, int] | None) -> list[int]:
    """Indices of the tokens whose characters overlap ``span``."""
    if span is None:
        return []
    a, b = span
    return [i for i, (s, e) in enumerate(char_ranges) if s < b and e > a]
