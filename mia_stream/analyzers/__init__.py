"""Analyzers: consumer processes that compute on the captured streams while requests run, vectorized over every
request of an engine step, and publish their results back onto the bus as ``analysis`` messages.

Run one (``mia-stream analyze --list`` shows them)::

    mia-stream analyze hidden_states --print-spec                  # the capture spec requests must send
    mia-stream analyze hnode --source /tmp/mia-run --publish       # live; results back onto the bus
    mia-stream analyze hnode --source runs/rec1                    # a recording; results as JSON lines

The API (stable; other analyzers build on it)
---------------------------------------------

``Analyzer`` (subclass it)
    ``name``, ``version`` (str), ``defaults`` (dict: every config key it accepts, with its default; unknown keys
    are an ``AnalyzerConfigError``), ``description`` (one line for ``--list``; else the docstring's first line).

    ``configure(config)``: validate the merged config; raise ``AnalyzerConfigError`` naming the bad key/file.
    ``needs() -> Needs``: what must be captured; ``capture_spec()`` is ``needs().capture_spec()``.
    ``on_start(start: StreamStart)``: a request's stream begins. The default checks ``needs()`` against
    ``start.capture``; raise ``AnalyzerInputError`` (one line naming the missing piece) to reject the request:
    the runner prints the line, publishes one row with label ``error`` for it and skips its data.
    ``on_batch(batch: StepBatch, out: Results)``: one engine step of every accepted request, columnar:
    iterate ``batch.groups`` (requests captured alike share a ``RowGroup``: ``g.tensor("hs").numpy()``
    ``[L, N, H]``, ``g.positions`` ``[N]``, ``g.row_requests`` ``[N]`` (index into ``batch.request_ids``),
    ``g.requests``/``g.rows``/``g.offsets`` per segment), or ``batch.tensor("hs")`` / ``batch.positions`` when
    one group holds them all; ``batch.segment(rid)`` gives one request's ``TensorFrame`` s (a per-request
    fallback). Raising ``AnalyzerInputError`` here rejects the batch's requests.
    ``on_tokens(batch: TokenBatch, out)``: what the requests sampled at a step.
    ``on_end(request_id, end: StreamEnd | None, out)``: the request ended (``end`` None: rejected or lost);
    report final results and free its state.

``Needs(hs_layers=(..)|"all", hs_positions="all", qk_layers=(), qk_heads="all"|(..), qk_positions="all")``
    positions: "all" | "prompt" | "generated" | "last_prompt". ``check(start)`` raises ``AnalyzerInputError``.

``Results`` (the ``out`` argument)
    ``out.add(request_ids, row_requests, positions=None, values=None, labels=None, alerts=None)``: many rows at
    once (``row_requests``: per row, the index into ``request_ids``; ``values``: name -> array with one leading
    entry per row, dtypes float32/64/16, int8/32/64, uint8, bool; ``labels``: name -> list of str|None per row;
    ``alerts``: bool per row; ``positions``: token position per row, -1 = the request as a whole).
    ``out.add_one(request_id, values, position=-1, labels=None, alert=False)``: one row.
    Everything added in one callback becomes one ``AnalysisBatch`` (wire kind ``analysis``, docs/wire-format.md
    3.15): rows grouped by request, each request's ``seq`` counted in its analysis stream (request, the
    analyzer's producer id, epoch); ``step`` = the engine step (-1 for ``on_end``), ``source_time_ns`` = the
    newest frame's ``time_ns``.

``RequestTable(name=((shape), dtype), ...)``: per-request state as rows of numpy arrays:
    ``slots = table.slots(request_ids)`` (int64 rows, zeroed for new requests), ``table["name"][slots] += ...``,
    ``table.release(rid)``, ``table.slot(rid)``. ``layer_rows(tensor, layers)``: indices of ``layers`` in a
    tensor's dim 0 (``AnalyzerInputError`` when absent); ``layer_values(tensor, rows)``: those layers as float32,
    widening only them (cheaper than ``tensor.numpy()[rows]`` for bfloat16).
    ``self.position_mask(batch, group, "generated")``: which rows are at those positions of their request.

Running: ``run_analyzer(analyzer, source, patterns=..., sinks=[...], publish=ADDR)`` (returns the
``AnalyzerRunner``: ``counters``, ``rejected``); ``AnalyzerRunner(analyzer, sinks)`` takes stream callbacks
directly (``on_start(stream_or_start)``, ``on_batch``, ``on_tokens``, ``on_gap``, ``on_end``) -- the same code
path for live streams and recordings, so results are identical. ``create(name, config)``,
``analyzer_class(name)``, ``available()``, ``load_config(path)``.

Registering a third-party analyzer: in its package's ``pyproject.toml``::

    [project.entry-points."mia_stream.analyzers"]
    token_norm = "my_pkg.analyzers:TokenNorm"

Errors: ``mia_stream.errors.AnalyzerError`` (unknown analyzer, bad registration), ``AnalyzerConfigError``
(a malformed config or probe file; also a ``ValueError``), ``AnalyzerInputError`` (a stream lacking what the
analyzer needs). Each is one line naming the missing or bad piece.
"""

from mia_stream.analyzers._base import Analyzer, Needs, RequestTable, Results, layer_rows, layer_values
from mia_stream.analyzers._registry import (BUILTIN, ENTRY_POINT_GROUP, analyzer_class, available, create,
                                            load_config)
from mia_stream.analyzers._runner import (AnalysisPublisher, AnalyzerRunner, analyze_main, jsonl_printer,
                                          result_dict, run_analyzer)

__all__ = ["Analyzer", "AnalysisPublisher", "AnalyzerRunner", "BUILTIN", "ENTRY_POINT_GROUP", "Needs",
           "RequestTable", "Results", "analyze_main", "analyzer_class", "available", "create", "jsonl_printer",
           "layer_rows", "layer_values", "load_config", "result_dict", "run_analyzer"]
