"""Token spans of a chat prompt: which tokens are the system prompt, each message, its content, a document.

Span analyzers (attention to the instruction vs. the data, document relevance, ...) need exact token ranges
of a served request's parts, but a chat request reaches the engine as one token sequence rendered by the
model's chat template. ``chat_spans`` renders the same template with the same tokenizer, cuts the text at
each message boundary (found by rendering growing prefixes of the conversation) and at each content's edges,
and maps the cuts to token indices::

    sp = chat_spans(tokenizer, [{"role": "system", "content": "Summarize."}, {"role": "user", "content": doc}])
    sp.token_ids                      # == StreamStart.prompt_token_ids of the served request
    sp.message(1).content             # token range of the user's text, e.g. range(25, 310)
    sp.locate("ignore previous")      # token range of a substring

A cut is ``exact`` when the tokenization of the text before it followed by that of the text after it equals
the tokenization of the whole (no token straddles it); ``ChatSpans.exact`` says all cuts are. Chat templates
that put special tokens around each message (ChatML, Llama 3, ...) give exact cuts. An inexact cut is placed
at the first token starting at or after it (offset mapping) and reported, never hidden.

To send exactly these tokens, use the completions endpoint with ``prompt=sp.token_ids`` (no re-tokenization
on the server); a chat request is rendered by the server, which matches ``token_ids`` when the server uses the
same template and tokenizer (checked end to end in tests/test_served.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from mia_stream.errors import SpanError

__all__ = ["ChatSpans", "PromptParts", "Span", "chat_spans", "load_tokenizer", "prompt_parts", "spans_from_tags"]

_PROBE = "\x1emia-stream-probe\x1e"


@dataclass(frozen=True)
class Span:
    """A part of the prompt. ``start``/``stop``: token range ``[start, stop)``; ``chars``: the character range
    in the rendered text; ``content``: the token range of the message's own text (None where the template
    changed it); ``exact``: both edges fall on token boundaries."""

    name: str  # a message's role, "template" (text the template adds before the first message),
    # "generation_prompt", "document", or "text" (``ChatSpans.locate``)
    index: int | None
    start: int
    stop: int
    chars: tuple[int, int]
    content: range | None = None
    exact: bool = True

    @property
    def tokens(self) -> range:
        return range(self.start, self.stop)


@dataclass(frozen=True)
class ChatSpans:
    text: str  # the rendered prompt
    token_ids: list[int]
    parts: tuple[Span, ...]  # cover the prompt in order: [template], one per message, [generation_prompt]
    documents: tuple[Span, ...] = ()
    _cuts: dict = field(default_factory=dict, repr=False, compare=False)
    _tokenizer: Any = field(default=None, repr=False, compare=False)

    @property
    def exact(self) -> bool:
        return all(p.exact for p in self.parts + self.documents) and all(
            p.content is None or self._cuts.get(("content", p.index), True) for p in self.parts)

    def message(self, index: int) -> Span:
        for p in self.parts:
            if p.index == index and p.name not in ("template", "generation_prompt"):
                return p
        raise SpanError(f"no message {index}; the prompt has {self.num_messages} message(s)")

    @property
    def num_messages(self) -> int:
        return sum(p.name not in ("template", "generation_prompt") for p in self.parts)

    def role(self, role: str) -> list[Span]:
        """Every message span of ``role`` ("system", "user", ...), in order."""
        return [p for p in self.parts if p.name == role and p.index is not None]

    def locate(self, substring: str, occurrence: int = 0, start_char: int = 0) -> Span:
        """The tokens covering the ``occurrence``-th appearance of ``substring`` at or after ``start_char``."""
        pos = start_char - 1
        for _ in range(occurrence + 1):
            pos = self.text.find(substring, pos + 1)
            if pos < 0:
                raise SpanError(f"{substring[:60]!r} does not occur {occurrence + 1} time(s) in the rendered "
                                "prompt")
        lo, lo_exact = _token_index(self._tokenizer, self.text, self.token_ids, pos, "lo")
        hi, hi_exact = _token_index(self._tokenizer, self.text, self.token_ids, pos + len(substring), "hi")
        return Span("text", None, lo, hi, (pos, pos + len(substring)), range(lo, hi), lo_exact and hi_exact)


def load_tokenizer(tokenizer: Any):
    """An HF tokenizer object as is, or one loaded (offline) from a model dir / cached id."""
    if isinstance(tokenizer, (str, bytes)) or hasattr(tokenizer, "__fspath__"):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(tokenizer))
    return tokenizer


def _encode(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"]) if text else []


def _render(tok, messages, add_generation_prompt: bool, kwargs: dict) -> str:
    out = tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                                  **kwargs)
    if not isinstance(out, str):
        raise SpanError(f"the chat template rendered {type(out).__name__}, not text")
    return out


def _token_index(tok, text: str, ids: list[int], cut: int, mode: str = "split") -> tuple[int, bool]:
    """The token index of character ``cut`` and whether it is exact (no token straddles it).

    Where a token straddles the cut, ``mode`` decides: "split" (a boundary between parts) gives the token to
    the part it starts in; "lo"/"hi" (the start/end of a covered text) include it.
    """
    if cut <= 0:
        return 0, True
    if cut >= len(text):
        return len(ids), True
    head = _encode(tok, text[:cut])
    if ids[:len(head)] == head and _encode(tok, text[cut:]) == ids[len(head):]:
        return len(head), True
    offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    if mode == "hi":
        return sum(1 for s, _ in offsets if s < cut), False
    for i, (s, e) in enumerate(offsets):
        if (e > cut if mode == "lo" else s >= cut):
            return i, False
    return len(ids), False


def _content_text(message: dict) -> str | None:
    content = message.get("content")
    return content if isinstance(content, str) and content else None


def _preamble_end(tok, messages, first_stop: int, content_start: int | None, text: str, kwargs: dict) -> int:
    """Where the template's own preamble (e.g. a default system prompt) ends and message 0's header begins.

    The header of a message of message 0's role is learnt by rendering a probe conversation: message 0 then
    a second message of the same role. Templates that refuse that (strict role alternation) keep the
    preamble inside message 0's span (returns 0).
    """
    if content_start is None:
        return 0
    role = messages[0].get("role")
    try:
        first = _render(tok, messages[:1], False, kwargs)
        probe = _render(tok, [messages[0], {"role": role, "content": _PROBE}], False, kwargs)
    except Exception:  # the template refuses the probe: no header to learn
        return 0
    if not probe.startswith(first) or _PROBE not in probe:
        return 0
    header = probe[len(first):probe.index(_PROBE)]
    prefix = text[:content_start]
    if header and prefix.endswith(header) and len(prefix) > len(header) and content_start <= first_stop:
        return content_start - len(header)
    return 0


def chat_spans(tokenizer: Any, messages: Sequence[dict], add_generation_prompt: bool = True,
               documents: Sequence[Any] | None = None, **template_kwargs: Any) -> ChatSpans:
    """Render ``messages`` with the tokenizer's chat template (as vLLM's chat endpoint does) and return the
    token spans of each part. ``documents``: handed to the template (RAG templates render them); each one's
    text must appear in the rendered prompt, else ``SpanError`` (the template dropped it). Other keyword
    arguments go to ``apply_chat_template`` (``tools``, ``chat_template``, ...)."""
    tok = load_tokenizer(tokenizer)
    messages = [dict(m) for m in messages]
    if not messages:
        raise SpanError("no messages")
    kwargs = dict(template_kwargs)
    if documents is not None:
        kwargs["documents"] = list(documents)
    text = _render(tok, messages, add_generation_prompt, kwargs)
    ids = _encode(tok, text)
    cuts: dict = {}

    def index(cut: int, mode: str = "split") -> tuple[int, bool]:
        key = (cut, mode)
        if key not in cuts:
            cuts[key] = _token_index(tok, text, ids, cut, mode)
        return cuts[key]

    # message boundaries: the rendering of messages[:i] must be a prefix of the whole
    stops = []
    for i in range(1, len(messages) + 1):
        prefix = text if i == len(messages) and not add_generation_prompt else _render(tok, messages[:i], False,
                                                                                      kwargs)
        if not text.startswith(prefix):
            raise SpanError(f"the chat template renders messages[:{i}] as something that is not a prefix of the "
                            "whole conversation; its message boundaries cannot be found")
        stops.append(len(prefix))
    parts: list[Span] = []
    begin = 0
    content_cuts: dict = {}
    for i, (m, stop) in enumerate(zip(messages, stops)):
        content = _content_text(m)
        c_lo = text.find(content, begin, stop) if content is not None else -1
        if i == 0:
            pre = _preamble_end(tok, messages, stop, c_lo if c_lo >= 0 else None, text, kwargs)
            if pre > 0:
                lo, lo_x = index(0)
                hi, hi_x = index(pre)
                parts.append(Span("template", None, lo, hi, (0, pre), None, lo_x and hi_x))
                begin = pre
        lo, lo_x = index(begin)
        hi, hi_x = index(stop)
        content_range = None
        if c_lo >= 0:
            a, a_x = index(c_lo, "lo")
            b, b_x = index(c_lo + len(content), "hi")
            content_range = range(a, b)
            content_cuts[("content", i)] = a_x and b_x
        parts.append(Span(str(m.get("role")), i, lo, hi, (begin, stop), content_range, lo_x and hi_x))
        begin = stop
    if begin < len(text):
        lo, lo_x = index(begin)
        parts.append(Span("generation_prompt", None, lo, len(ids), (begin, len(text)), None, lo_x))
    docs = []
    for j, doc in enumerate(documents or ()):
        body = doc if isinstance(doc, str) else (doc.get("text") or doc.get("content")) if isinstance(doc, dict) \
            else None
        if not isinstance(body, str) or not body:
            raise SpanError(f"document {j} has no text (a string, or a dict with 'text' or 'content')")
        pos = text.find(body)
        if pos < 0:
            raise SpanError(f"document {j} does not appear in the rendered prompt: this chat template does not "
                            "render documents; put them in a message instead")
        a, a_x = index(pos, "lo")
        b, b_x = index(pos + len(body), "hi")
        docs.append(Span("document", j, a, b, (pos, pos + len(body)), range(a, b), a_x and b_x))
    return ChatSpans(text, ids, tuple(parts), tuple(docs), content_cuts, tok)


# ---------------------------------------------------------------------------------------------------------------
# Named parts of a prompt (instruction, data, documents, query, schema columns) and their transport in tags.

SPANS_TAG = "spans"


@dataclass(frozen=True)
class PromptParts:
    """A chat prompt built from named pieces: ``spans[name]`` lists the token span of each piece of that name,
    in prompt order (a name may repeat: one span per document, per schema column)."""

    chat: ChatSpans
    spans: dict  # name -> tuple[Span, ...]

    @property
    def token_ids(self) -> list[int]:
        return self.chat.token_ids

    @property
    def text(self) -> str:
        return self.chat.text

    @property
    def exact(self) -> bool:
        return all(s.exact for spans in self.spans.values() for s in spans)

    def ranges(self, name: str) -> list[tuple[int, int]]:
        try:
            return [(s.start, s.stop) for s in self.spans[name]]
        except KeyError:
            raise SpanError(f"the prompt has no part named {name!r}; it has {sorted(self.spans)}") from None

    def tags(self) -> dict:
        """``{"spans": {name: [[start, stop], ...]}}``: what a request carries in ``tags`` so that span
        analyzers (attention_tracker, core_reranker, attnlink) know its parts (``spans_from_tags``)."""
        return {SPANS_TAG: {name: [[s.start, s.stop] for s in spans] for name, spans in self.spans.items()}}


def _pieces(content: Any, i: int) -> list[tuple[str | None, str]]:
    if isinstance(content, str):
        return [(None, content)]
    if not isinstance(content, (list, tuple)):
        raise SpanError(f"message {i}: content must be a string or a list of pieces, got {type(content).__name__}")
    out = []
    for p in content:
        if isinstance(p, str):
            out.append((None, p))
        elif isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], str):
            out.append((p[0], p[1]))
        elif isinstance(p, dict) and isinstance(p.get("name"), str) and isinstance(p.get("text"), str):
            out.append((p["name"], p["text"]))
        else:
            raise SpanError(f"message {i}: a piece must be text, (name, text) or {{'name', 'text'}}, got {p!r}")
    return out


def prompt_parts(tokenizer: Any, messages: Sequence[dict], add_generation_prompt: bool = True,
                 **template_kwargs: Any) -> PromptParts:
    """Render a chat whose message contents are lists of pieces, some named, and return each named piece's
    token span::

        pp = prompt_parts(tok, [{"role": "system", "content": [("instruction", "Summarize the text.")]},
                                {"role": "user", "content": ["Data:\\n", ("data", text)]}])
        pp.ranges("data")   # [(start, stop)]: tokens of ``text`` in pp.token_ids
        pp.tags()           # {"spans": {"instruction": [[a, b]], "data": [[c, d]]}} for the request's tags

    A piece's span holds every token that overlaps its characters (a token straddling an edge, such as a space
    merged into the next word, counts for the piece it reaches into); ``Span.exact`` says whether both edges
    fall on token boundaries.
    """
    tok = load_tokenizer(tokenizer)
    flat, pieces = [], []
    for i, m in enumerate(messages):
        ps = _pieces(m.get("content", ""), i)
        pieces.append(ps)
        flat.append({**m, "content": "".join(t for _, t in ps)})
    chat = chat_spans(tok, flat, add_generation_prompt, **template_kwargs)
    text, ids = chat.text, chat.token_ids
    spans: dict[str, list[Span]] = {}
    for i, ps in enumerate(pieces):
        if not any(name for name, _ in ps):
            continue
        msg = chat.message(i)
        content = flat[i]["content"]
        c0 = text.find(content, msg.chars[0], msg.chars[1]) if content else -1
        if c0 < 0:
            raise SpanError(f"message {i}: the chat template changed the message text (e.g. trimmed it); its "
                            "named pieces cannot be located")
        pos = c0
        for name, piece in ps:
            if name is not None:
                if not piece:
                    raise SpanError(f"message {i}: piece {name!r} is empty")
                a, a_x = _token_index(tok, text, ids, pos, "lo")
                b, b_x = _token_index(tok, text, ids, pos + len(piece), "hi")
                spans.setdefault(name, []).append(Span(name, i, a, b, (pos, pos + len(piece)), range(a, b),
                                                       a_x and b_x))
            pos += len(piece)
    return PromptParts(chat, {k: tuple(v) for k, v in spans.items()})


def spans_from_tags(tags: Any, num_tokens: int) -> dict[str, list[tuple[int, int]]]:
    """The named spans a request carries in its tags (``PromptParts.tags``), each checked against its prompt of
    ``num_tokens`` tokens; a one-line ``SpanError`` for anything malformed or out of range."""
    raw = tags.get(SPANS_TAG) if isinstance(tags, dict) else None
    if raw is None:
        raise SpanError(f"the request has no tags[{SPANS_TAG!r}]: send the prompt's part spans with it "
                        "(tags=mia_stream.spans.prompt_parts(...).tags())")
    if not isinstance(raw, dict):
        raise SpanError(f"tags[{SPANS_TAG!r}] must map names to lists of [start, stop], got {type(raw).__name__}")
    out: dict[str, list[tuple[int, int]]] = {}
    for name, ranges in raw.items():
        if not isinstance(ranges, (list, tuple)):
            raise SpanError(f"tags[{SPANS_TAG!r}][{name!r}] must be a list of [start, stop], got {ranges!r}")
        got = []
        for r in ranges:
            if (not isinstance(r, (list, tuple)) or len(r) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) for x in r)):
                raise SpanError(f"tags[{SPANS_TAG!r}][{name!r}]: {r!r} is not a [start, stop] pair of integers")
            a, b = r
            if not 0 <= a < b <= num_tokens:
                raise SpanError(f"span {name!r} [{a}, {b}) is out of range: the prompt has {num_tokens} tokens")
            got.append((a, b))
        out[str(name)] = got
    return out
