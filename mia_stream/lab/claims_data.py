"""SciHal-style claim verification data, generated here from facts that Python packages ship (nothing downloads):
a reference passage about one entity and a claim that the passage supports (``entailment``), contradicts
(``contradiction``) or does not address (``unverifiable``), the three classes of the SciHal challenge that the
seed's ``science_hallucination`` classifies (IBM/vLLM-Hook ``examples/demo_scihal.py``).

Domains: countries (``countryinfo``: capital, subregion, population, demonym, calling code, internet domain) and
chemical elements (``periodictable``: symbol, atomic number, atomic mass, density). Per entity, the passage
states ``PASSAGE_FACTS`` of its attributes; its claims are: one of those facts reworded (entailment), one of
those attributes with another entity's value (contradiction), and an attribute the passage leaves out, with its
true or a wrong value (unverifiable: the passage cannot settle it either way). Each record carries ``group``
(the entity): splits are by entity, so an entity's passage never straddles train and test.

``scihal_messages(reference, claim)`` is the seed's prompt (a system task line, a few solved examples, the
"#Claim: ... #Reference: ..." input); its solved examples are about fictional people, a domain outside the data.
"""

from __future__ import annotations

import random

LABELS = ("entailment", "contradiction", "unverifiable")
PASSAGE_FACTS = 3

# attribute -> (passage sentence, claim sentence): {n} the entity, {v} the value
_COUNTRY_TEXT = {
    "capital": ("Its capital city is {v}.", "The capital of {n} is {v}."),
    "subregion": ("{n} lies in {v}.", "{n} is a country of {v}."),
    "population": ("About {v} million people live in {n}.", "The population of {n} is roughly {v} million."),
    "demonym": ("People from {n} are called {v}.", "A person from {n} is called {v}."),
    "calling_code": ("Its international calling code is +{v}.", "Phone numbers in {n} start with +{v}."),
    "tld": ("Websites of {n} use the {v} domain.", "The internet domain of {n} is {v}."),
}
_ELEMENT_TEXT = {
    "symbol": ("Its chemical symbol is {v}.", "The symbol of {n} is {v}."),
    "number": ("It has atomic number {v}.", "The atomic number of {n} is {v}."),
    "mass": ("Its atomic mass is {v}.", "{n} has an atomic mass of {v}."),
    "density": ("Its density is {v} grams per cubic centimetre.", "The density of {n} is {v} g/cm3."),
}


def _countries() -> list[tuple[str, dict]]:
    import countryinfo

    out, seen = [], set()
    for c in countryinfo.all_countries():
        try:
            i = c.info()
        except Exception:  # entries without some field
            continue
        name = i.get("name")
        if not isinstance(name, str) or name in seen:
            continue
        try:
            attrs = {"capital": i["capital"], "subregion": i.get("intermediateregion") or i["subregion"],
                     "population": f"{int(i['population']) / 1e6:.1f}", "demonym": i["demonym"],
                     "calling_code": i["callingCodes"][0], "tld": i["tld"][0]}
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        if not all(isinstance(v, str) and v.strip() for v in attrs.values()) or attrs["population"] == "0.0":
            continue
        seen.add(name)
        out.append((name, attrs))
    return out


def _elements() -> list[tuple[str, dict]]:
    import periodictable

    out = []
    for e in periodictable.elements:
        if e.number <= 0 or e.density is None or not e.mass:
            continue
        out.append((e.name.capitalize(), {"symbol": e.symbol, "number": str(e.number), "mass": f"{e.mass:.2f}",
                                          "density": f"{e.density:.3g}"}))
    return out


DOMAINS = {"countries": (_countries, _COUNTRY_TEXT, "{n} is a country."),
           "elements": (_elements, _ELEMENT_TEXT, "{n} is a chemical element.")}


def claim_set(domains=tuple(DOMAINS), seed: int = 0) -> list[dict]:
    """One claim of each class per entity: records ``id, domain, group, entity, reference, claim, label``
    (``label``: index into ``LABELS``), ``attribute``."""
    rng = random.Random(f"claims-{seed}")
    out = []
    for domain in domains:
        load, text, intro = DOMAINS[domain]
        entities = load()
        for name, attrs in entities:
            keys = [k for k in text if k in attrs]
            rng.shuffle(keys)
            stated, left_out = keys[:PASSAGE_FACTS], keys[PASSAGE_FACTS:]
            if not left_out:
                continue
            reference = " ".join([intro.format(n=name)] + [text[k][0].format(n=name, v=attrs[k]) for k in stated])

            def other_value(k):
                vals = sorted({a[k] for _, a in entities if a.get(k) and a[k] != attrs[k]})
                return rng.choice(vals)

            k_e, k_c, k_u = rng.choice(stated), rng.choice(stated), rng.choice(left_out)
            u_val = attrs[k_u] if rng.random() < 0.5 else other_value(k_u)
            for label, (k, v) in enumerate(((k_e, attrs[k_e]), (k_c, other_value(k_c)), (k_u, u_val))):
                out.append({"id": f"{domain}:{name}:{LABELS[label]}", "domain": domain, "group": f"{domain}:{name}",
                            "entity": name, "reference": reference, "claim": text[k][1].format(n=name, v=v),
                            "attribute": k, "label": label})
    return out


# ------------------------------------------------------------------------------------------ the seed's prompt

SCIHAL_SYSTEM = ("\nYou are a helpful assistant. Learn from the examples below and complete the task accordingly. \n\n"
                 "### Task: Detect if the claims are well-supported by the references. Provide a justification and "
                 "classify each example into three labels: entailment, contradiction, or unverifiable\n\n")
_SHOTS = [  # fictional people: a domain outside the data
    ("Rosa Novak works as a pilot.", "Rosa Novak is a pilot who lives in Graz and flies cargo planes.",
     "The reference says she is a pilot.", "entailment"),
    ("Hiro Brandt was born in Porto.", "Hiro Brandt was born in Leipzig and works as a baker.",
     "The reference gives Leipzig as his birthplace, not Porto.", "contradiction"),
    ("Ines Haddad speaks fluent Finnish.", "Ines Haddad was born in Lyon and enjoys chess.",
     "The reference does not mention which languages she speaks.", "unverifiable"),
]


def scihal_messages(reference: str, claim: str) -> list[dict]:
    """The seed's SciHal prompt as chat messages (``demo_scihal.py``: system task, solved examples, then
    "Input: #Claim: ... #Reference: ...", "Output:"), with this module's three solved examples."""
    shots = "".join(f"Input: #Claim: {c}\n #Reference: {r}\n\nOutput:\n{j}\n#Label: {lab}\n\n"
                    for c, r, j, lab in _SHOTS)
    user = shots + f"\n\n### Now, apply the same pattern: \n\nInput: #Claim: {claim}\n #Reference: {reference}\nOutput: \n"
    return [{"role": "system", "content": SCIHAL_SYSTEM}, {"role": "user", "content": user}]


def true_false_messages(reference: str, claim: str) -> list[dict]:
    """The logprob baseline's prompt: is the claim true according to the reference (answer true or false)."""
    return [{"role": "user", "content": f"Reference: {reference}\nClaim: {claim}\n"
                                        "According to the reference, is the claim true or false? "
                                        "Answer with one word: true or false."}]
