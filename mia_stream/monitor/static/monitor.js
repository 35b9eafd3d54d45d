// mia-stream monitor page: one server-sent-event stream of coalesced updates (see mia_stream/monitor/_server.py).
// Plain DOM and <canvas>; no framework, nothing fetched from elsewhere.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  // Page state. Also read by the tests and the load benchmark (shownAt / scoredAt / latency / renderMs / listMs).
  const M = (window.__mia = {
    client: null, recording: false, loaded: true, select: null, tick: null, ticks: [], updates: 0,
    rows: new Map(), d: null, scoreKey: null, userKey: false, overview: null,
    shownAt: {}, scoredAt: {}, latency: [], renderMs: [], listMs: [],
  });
  const COLS = 10;

  // ------------------------------------------------------------------------------------------ formatting
  const fmt = (v, digits = 1) => (v === null || v === undefined ? "" : typeof v === "number" ? +v.toFixed(digits) + "" : v + "");
  const human = (n) => {
    const u = ["", "K", "M", "G", "T"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < u.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : n.toFixed(0)) + u[i];
  };
  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const setText = (e, t) => { if (e.textContent !== t) e.textContent = t; };

  // ------------------------------------------------------------------------------------------ server link
  let viewInFlight = false, viewPending = false;
  async function sendView() {
    if (!M.client) return;
    if (viewInFlight) { viewPending = true; return; }
    viewInFlight = true;
    try {
      await fetch("api/view", {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ client: M.client, select: M.select, tick: M.tick }),
      });
    } catch (e) { /* the event stream reconnects and sends the view again */ }
    viewInFlight = false;
    if (viewPending) { viewPending = false; sendView(); }
  }

  function connect() {
    const es = new EventSource("api/events");
    es.addEventListener("hello", (e) => {
      const h = JSON.parse(e.data);
      M.client = h.client;
      M.recording = h.recording;
      setText($("source"), h.source);
      setText($("mode"), h.recording ? "recording" : "live");
      $("timeline").hidden = !h.recording;
      setText($("broker-title"), h.recording ? "recording" : "broker");
      sendView();
    });
    es.addEventListener("update", (e) => {
      const t0 = performance.now();
      apply(JSON.parse(e.data));
      M.updates++;
      M.renderMs.push(performance.now() - t0);
      if (M.renderMs.length > 2000) M.renderMs.splice(0, 1000);
      status();
    });
    es.onerror = () => setText($("status"), "disconnected, retrying…");
  }

  // ------------------------------------------------------------------------------------------ updates
  function apply(u) {
    const t0 = performance.now();
    if (u.full) M.rows.clear();
    for (const id of u.gone || []) M.rows.delete(id);
    for (const r of u.rows || []) M.rows.set(r[0], r);
    if (u.full || (u.gone && u.gone.length) || (u.rows && u.rows.length)) {
      M.viewStale = true;
      renderList();
      M.listMs.push(performance.now() - t0);
      if (M.listMs.length > 2000) M.listMs.splice(0, 1000);
    }
    if (u.overview) applyOverview(u.overview);
    if (u.detail) applyDetail(u.detail);
    if (u.ticks !== undefined) setTicks(u.ticks, u.tick);
    updateCounts();
  }

  function status() {
    const lat = M.latency.slice(-200).sort((a, b) => a - b);
    const p50 = lat.length ? lat[Math.floor(lat.length / 2)] : null;
    const parts = [M.recording ? (M.loaded ? "recording loaded" : "loading recording…") : "live", `${M.updates} updates`];
    if (p50 !== null) parts.push(`token→page ${p50} ms (p50)`);
    setText($("status"), parts.join(" · "));
  }

  // ------------------------------------------------------------------------------------------ request list
  // The list is virtual: the page keeps every row's data (M.rows: id -> row) but only the rows in view are in the
  // DOM (a pool of <tr>, between two spacer rows), so an update of 256 requests touches about 40 rows. Writing
  // all 256 rows took 24 ms (median) and 180 ms (p95) per list update on the shared 2-core machine.
  let rowH = 22;  // the CSS height; measured from a filled row once one is laid out (fonts differ)
  const tbody = document.querySelector("#requests tbody"), wrap = document.querySelector(".table-wrap");
  const topPad = el("tr", "pad"), bottomPad = el("tr", "pad");
  tbody.append(topPad, bottomPad);
  const pool = [];
  M.view = [];

  function rowMatches(r) {
    const q = filterInput.value.trim().toLowerCase();
    const [id, tags, state] = r;
    return (!q || id.toLowerCase().includes(q) || tags.toLowerCase().includes(q)) && (!runningOnly.checked || state === "running");
  }

  function poolRow() {
    const tr = el("tr");
    const cells = [];
    for (let i = 0; i < COLS; i++) {
      const td = el("td", i >= 3 ? "num" : i === 1 ? "tags" : "");
      tr.appendChild(td);
      cells.push(td);
    }
    tr.addEventListener("click", () => select(tr.dataset.id));
    tbody.insertBefore(tr, bottomPad);
    const p = { tr, cells, data: null };
    pool.push(p);
    return p;
  }

  function fillRow(p, r) {
    if (p.data === r) return;
    const [id, tags, state, prompt, gen, tps, drops, lag, alerts, top] = r;
    const vals = [id, tags, state, prompt, gen, fmt(tps), drops, fmt(lag), alerts, fmt(top, 3)];
    for (let i = 0; i < COLS; i++) setText(p.cells[i], vals[i] + "");
    if (p.tr.dataset.id !== id) p.tr.dataset.id = id;
    p.cells[0].title = id;
    p.cells[1].title = tags;
    p.tr.classList.toggle("ended", state !== "running" && state !== "no start");
    p.tr.classList.toggle("selected", id === M.select);
    p.cells[8].classList.toggle("alerting", alerts > 0);
    p.data = r;
  }

  function renderList() {
    if (M.viewStale) {  // newest (highest arrival order) first, filtered
      M.view = [...M.rows.values()].filter(rowMatches).sort((a, b) => b[10] - a[10]);
      M.viewStale = false;
    }
    const first = Math.max(0, Math.floor(wrap.scrollTop / rowH) - 5);
    const last = Math.min(M.view.length, first + Math.ceil((wrap.clientHeight || 600) / rowH) + 10);
    topPad.style.height = first * rowH + "px";
    bottomPad.style.height = (M.view.length - last) * rowH + "px";
    while (pool.length < last - first) poolRow();
    pool.forEach((p, i) => {
      const r = M.view[first + i];
      if (r === undefined) { p.tr.hidden = true; p.data = null; return; }
      p.tr.hidden = false;
      fillRow(p, r);
    });
    if (pool.length && !pool[0].tr.hidden && !M.rowMeasured) {
      const h = pool[0].tr.getBoundingClientRect().height;
      if (h > 0) { M.rowMeasured = true; if (Math.abs(h - rowH) > 0.5) { rowH = h; renderList(); } }
    }
  }
  let scrollQueued = false;
  wrap.addEventListener("scroll", () => {
    if (scrollQueued) return;
    scrollQueued = true;
    requestAnimationFrame(() => { scrollQueued = false; renderList(); });
  });

  const filterInput = $("filter"), runningOnly = $("running-only");
  const refilter = () => { M.viewStale = true; renderList(); updateCounts(); };
  filterInput.addEventListener("input", refilter);
  runningOnly.addEventListener("change", refilter);

  function updateCounts() {
    const o = M.overview;
    if (o) setText($("counts"), `${o.running} running · ${M.view.length} shown of ${M.rows.size}`);
  }

  function select(id) {
    if (M.select === id) return;
    M.select = id;
    for (const p of pool) p.tr.classList.toggle("selected", p.tr.dataset.id === id);
    M.d = null;
    M.shownAt = {}; M.scoredAt = {}; M.latency = [];
    $("text").textContent = "";
    $("alerts").textContent = "";
    setText($("detail-title"), id);
    setText($("detail-info"), "loading…");
    writeHash();
    sendView();
  }

  // ------------------------------------------------------------------------------------------ overview
  function applyOverview(o) {
    M.overview = o;
    if (M.recording && o.loaded && !M.loaded) { M.loaded = true; loadTicks(); }
    if (M.recording && !o.loaded) M.loaded = false;
    const sel = $("score-key");
    const keys = o.score_keys || [];
    if (sel.options.length !== keys.length || keys.some((k, i) => sel.options[i].value !== k)) {
      sel.textContent = "";
      if (!keys.length) sel.appendChild(el("option", "", "(no scores yet)"));
      for (const k of keys) { const opt = el("option", "", k); opt.value = k; sel.appendChild(opt); }
    }
    if (!M.userKey && o.score_key && M.scoreKey !== o.score_key) { M.scoreKey = o.score_key; colourAll(); }
    if (M.scoreKey) sel.value = M.scoreKey;
    renderBroker(o);
  }
  $("score-key").addEventListener("change", (e) => { M.scoreKey = e.target.value; M.userKey = true; colourAll(); drawSeries(); });

  function renderBroker(o) {
    const box = $("broker-body");
    const b = o.broker;
    box.textContent = "";
    if (M.recording) { box.appendChild(el("span", o.note_is_problem ? "bad" : "muted", o.note || "recording: no broker")); return; }
    if (!b) { box.appendChild(el("span", "muted", "no stats yet")); return; }
    if (b.error && b.frames_per_s === undefined) { box.appendChild(el("span", "bad", b.error)); return; }
    const kv = (k, v, bad) => box.appendChild(el("span", "kv" + (bad ? " bad" : ""), `${k} ${v}`));
    kv("frames/s", fmt(b.frames_per_s));
    kv("bytes/s", human(b.bytes_per_s));
    kv("streams", b.streams);
    kv("producers", Object.keys(b.producers).length);
    kv("consumers", Object.keys(b.consumers).length);
    let dropped = 0;
    for (const c of Object.values(b.consumers)) dropped += c.dropped;
    kv("consumer drops", dropped, dropped > 0);
    for (const [k, v] of Object.entries(b.drops || {})) kv(k, v, v > 0);
    if (b.error) kv("", b.error, true);
  }

  // ------------------------------------------------------------------------------------------ detail
  function newDetail(id) {
    return { id, tokens: [], spans: new Map(), scores: new Map(), alerts: [], alertPos: new Set(), norms: new Map(),
      layerSets: {}, info: null, hover: null, lastNorm: -1, coloured: null };
  }

  function applyDetail(d) {
    if (d.id !== M.select) return;
    const text = $("text");
    if (d.reset || !M.d || M.d.id !== d.id) {
      // shownAt/scoredAt: when a position first showed; kept when the same request is sent again whole
      // (its text replacing the token ids shown while its tokenizer loaded)
      if (!M.d || M.d.id !== d.id) { M.shownAt = {}; M.scoredAt = {}; }
      M.d = newDetail(d.id);
      text.textContent = "";
      $("alerts").textContent = "";
    }
    const D = M.d;
    if (d.missing) { setText($("detail-info"), "not known to the monitor (never seen, or ended and forgotten)"); return; }
    const now = Date.now();
    const atBottom = text.scrollTop + text.clientHeight >= text.scrollHeight - 20;
    const frag = document.createDocumentFragment();
    for (const [pos, piece, tauMs, step, prompt] of d.tokens || []) {
      const span = el("span", prompt ? "tok prompt" : "tok", piece);
      span.dataset.pos = pos;
      span.dataset.step = step;
      D.spans.set(pos, span);
      D.tokens.push(pos);
      frag.appendChild(span);
      if (!(pos in M.shownAt)) M.shownAt[pos] = now;
      if (!prompt && !M.recording && !d.reset && tauMs > 0) M.latency.push(now - tauMs);  // live arrivals only
    }
    if (M.latency.length > 5000) M.latency.splice(0, 2500);
    text.appendChild(frag);
    if (atBottom && !M.recording) text.scrollTop = text.scrollHeight;
    const touched = [];
    for (const [pos] of d.tokens || []) touched.push(pos);
    for (const [pos, key, v] of d.scores || []) {
      let m = D.scores.get(key);
      if (!m) D.scores.set(key, (m = new Map()));
      m.set(pos, v);
      if (key === M.scoreKey) touched.push(pos);
    }
    if (touched.length) colourAll(touched);
    for (const [pos, analyzer, textAlert] of d.alerts || []) {
      D.alerts.push([pos, analyzer, textAlert]);
      D.alertPos.add(pos);
      const li = el("li", "", `${pos >= 0 ? "pos " + pos : "request"} · ${analyzer}${textAlert ? ": " + textAlert : ""}`);
      $("alerts").appendChild(li);
      const span = D.spans.get(pos);
      if (span) span.classList.add("alert");
    }
    for (const pos of D.alertPos) { const s = D.spans.get(pos); if (s) s.classList.add("alert"); }
    setText($("alert-count"), D.alerts.length ? `(${D.alerts.length})` : "");
    Object.assign(D.layerSets, d.layer_sets || {});
    for (const [pos, lid, vals] of d.norms || []) { D.norms.set(pos, [lid, vals]); D.lastNorm = Math.max(D.lastNorm, pos); }
    if (d.info) { D.info = d.info; renderInfo(D); }
    schedulePlots();
  }

  function renderInfo(D) {
    const i = D.info;
    setText($("detail-title"), D.id);
    const parts = [i.state, `prompt ${i.prompt_tokens}`, `generated ${i.generated}`];
    if (i.tokens_per_s !== null) parts.push(`${i.tokens_per_s} tok/s`);
    parts.push(`drops ${i.drops}`);
    if (i.lag_ms !== null) parts.push(`lag ${i.lag_ms} ms`);
    if (i.tp_size > 1) parts.push(`TP ${i.tp_size}`);
    const tags = Object.entries(i.tags || {}).map(([k, v]) => `${k}=${v}`).join(" ");
    if (tags) parts.push(tags);
    for (const [k, v] of Object.entries(i.totals || {})) parts.push(`${k} = ${v}`);
    if (i.drops) parts.push("(" + Object.entries(i.drop_reasons).map(([k, v]) => `${v} ${k}`).join(", ") + ")");
    if (i.end && i.end.error) parts.push(`error: ${i.end.error}`);
    if (i.detok_note) parts.push(i.detok_note);
    if (i.model) parts.push(i.model.split("/").pop());
    setText($("detail-info"), parts.join(" · "));
  }

  // Score colour: light yellow (low) to red (high); values outside [0, 1] are scaled to the request's range.
  function scoreRange(m) {
    let lo = Infinity, hi = -Infinity;
    for (const v of m.values()) { if (v === null) continue; if (v < lo) lo = v; if (v > hi) hi = v; }
    if (lo >= 0 && hi <= 1) return [0, 1];
    return lo < hi ? [lo, hi] : [lo - 1, lo + 1];
  }
  const colour = (x) => `hsl(${60 - 60 * x}, 90%, ${85 - 35 * x}%)`;

  // Recolours only what may have changed: the positions given (new tokens, new scores), or every scored
  // position when the key or the colour range changed (rewriting 2000 spans' styles 10 times a second is what
  // made long texts slow to update).
  function colourAll(positions) {
    const D = M.d;
    if (!D) return;
    const m = M.scoreKey ? D.scores.get(M.scoreKey) : null;
    if (!m) {
      if (D.coloured) for (const s of D.spans.values()) s.style.background = "";
      D.coloured = null;
      setText($("legend-lo"), ""); setText($("legend-hi"), "");
      return;
    }
    const [lo, hi] = scoreRange(m);
    const same = D.coloured && D.coloured[0] === M.scoreKey && D.coloured[1] === lo && D.coloured[2] === hi;
    if (!same) {
      if (D.coloured) for (const s of D.spans.values()) s.style.background = "";
      D.coloured = [M.scoreKey, lo, hi];
      positions = null;
    }
    setText($("legend-lo"), fmt(lo, 3)); setText($("legend-hi"), fmt(hi, 3));
    const now = Date.now();
    for (const pos of positions || m.keys()) {
      const v = m.get(pos), s = D.spans.get(pos);
      if (!s || v === null || v === undefined) continue;
      const x = Math.max(0, Math.min(1, (v - lo) / (hi - lo)));
      s.style.background = colour(x);
      s.dataset.score = v;
      s.title = `position ${pos} · step ${s.dataset.step} · ${M.scoreKey} = ${v}`;
      if (!(pos in M.scoredAt)) M.scoredAt[pos] = now;
    }
  }

  const textBox = $("text");
  textBox.addEventListener("mouseover", (e) => {
    const pos = e.target.dataset && e.target.dataset.pos;
    if (pos === undefined || !M.d) return;
    if (M.d.hover !== null) { const old = M.d.spans.get(M.d.hover); if (old) old.classList.remove("hover"); }
    M.d.hover = +pos;
    e.target.classList.add("hover");
    schedulePlots();
  });

  // ------------------------------------------------------------------------------------------ plots
  let plotQueued = false;
  function schedulePlots() {
    if (plotQueued) return;
    plotQueued = true;
    requestAnimationFrame(() => { plotQueued = false; drawNorms(); drawSeries(); });
  }

  function prepCanvas(c) {
    const dpr = window.devicePixelRatio || 1;
    const w = c.clientWidth || 360, h = c.clientHeight || 150;
    if (c.width !== Math.round(w * dpr) || c.height !== Math.round(h * dpr)) { c.width = Math.round(w * dpr); c.height = Math.round(h * dpr); }
    const g = c.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    g.font = "11px system-ui, sans-serif";
    return [g, w, h];
  }

  // lines: [{xs, ys, colour, dots}]; draws axes with min/max labels
  function plot(c, lines, xLabel, empty) {
    const [g, w, h] = prepCanvas(c);
    const pad = { l: 42, r: 8, t: 8, b: 22 };
    const xs = lines.flatMap((l) => l.xs), ys = lines.flatMap((l) => l.ys).filter((v) => v !== null);
    g.fillStyle = "#6b7480";
    if (!xs.length || !ys.length) { g.fillText(empty, pad.l, h / 2); return; }
    let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (y0 === y1) { y0 -= 1; y1 += 1; }
    const X = (x) => pad.l + ((x - x0) / (x1 - x0)) * (w - pad.l - pad.r);
    const Y = (y) => h - pad.b - ((y - y0) / (y1 - y0)) * (h - pad.t - pad.b);
    g.strokeStyle = "#dfe3e8";
    g.beginPath(); g.moveTo(pad.l, pad.t); g.lineTo(pad.l, h - pad.b); g.lineTo(w - pad.r, h - pad.b); g.stroke();
    g.fillText(fmt(y1, 3), 2, pad.t + 8); g.fillText(fmt(y0, 3), 2, h - pad.b);
    g.fillText(`${x0}`, pad.l, h - 6); g.fillText(`${xLabel} ${x1}`, w - pad.r - 70, h - 6);
    for (const l of lines) {
      g.strokeStyle = l.colour; g.fillStyle = l.colour; g.lineWidth = 1.5;
      g.beginPath();
      let started = false;
      l.xs.forEach((x, i) => {
        const y = l.ys[i];
        if (y === null) { started = false; return; }
        if (!started) { g.moveTo(X(x), Y(y)); started = true; } else g.lineTo(X(x), Y(y));
      });
      g.stroke();
      if (l.dots) l.xs.forEach((x, i) => { if (l.ys[i] !== null) { g.beginPath(); g.arc(X(x), Y(l.ys[i]), l.dots(i), 0, 7); g.fill(); } });
    }
  }

  function drawNorms() {
    const D = M.d, c = $("norm-plot");
    const lines = [];
    const add = (pos, colour) => {
      const n = D && D.norms.get(pos);
      if (!n) return;
      const layers = D.layerSets[n[0]] || n[1].map((_, i) => i);
      lines.push({ xs: layers, ys: n[1], colour, dots: () => 2 });
    };
    if (D) { add(D.lastNorm, "#2563eb"); if (D.hover !== null && D.hover !== D.lastNorm) add(D.hover, "#1d232b"); }
    const cap = D && D.info && D.info.norms_from && D.info.norms_from !== "frames" ? ` (${D.info.norms_from})` : "";
    setText($("norm-caption"), `hidden-state norm per layer${cap}: position ${D ? D.lastNorm : "-"} (blue)` +
      (D && D.hover !== null && D.norms.has(D.hover) ? `, ${D.hover} (black, hovered)` : ""));
    plot(c, lines, "layer", "no hidden states captured");
  }

  function drawSeries() {
    const D = M.d, c = $("series-plot");
    const m = D && M.scoreKey ? D.scores.get(M.scoreKey) : null;
    setText($("series-caption"), M.scoreKey ? `${M.scoreKey} over positions` : "score over positions");
    if (!m) { plot(c, [], "position", "no scores for this request"); return; }
    const pts = [...m.entries()].sort((a, b) => a[0] - b[0]);
    const alertPos = D.alertPos;
    plot(c, [{ xs: pts.map((p) => p[0]), ys: pts.map((p) => p[1]), colour: "#dc2626",
      dots: (i) => (alertPos.has(pts[i][0]) ? 3.5 : 1.5) }], "position", "no scores");
  }

  // ------------------------------------------------------------------------------------------ timeline (recordings)
  const slider = $("tl-slider");
  async function loadTicks() {
    const r = await fetch("api/ticks");
    M.ticks = await r.json();
    slider.max = Math.max(0, M.ticks.length - 1);
    if (M.tick === null) { slider.value = slider.max; }
    tickLabel();
  }
  function setTicks(n, tick) {
    if (n && (!M.ticks.length || M.ticks.length !== n) && M.loaded) loadTicks();
    if (tick !== null && tick !== undefined) { M.tick = tick; slider.value = tick; tickLabel(); }
  }
  function tickLabel() {
    const i = M.tick === null ? M.ticks.length - 1 : M.tick;
    const t = M.ticks[i];
    if (!t) { setText($("tl-label"), M.loaded ? "no steps" : "loading…"); return; }
    const rel = ((t[0] - M.ticks[0][0]) / 1000).toFixed(3);
    setText($("tl-label"), `step ${t[1]} · t = +${rel} s · ${i + 1}/${M.ticks.length}` + (M.tick === null ? " (end)" : ""));
  }
  function goTick(i) {
    if (!M.ticks.length) return;
    M.tick = Math.max(0, Math.min(M.ticks.length - 1, i));
    slider.value = M.tick;
    tickLabel();
    writeHash();
    sendView();
  }
  slider.addEventListener("input", () => goTick(+slider.value));
  $("tl-prev").addEventListener("click", () => goTick((M.tick === null ? M.ticks.length - 1 : M.tick) - 1));
  $("tl-next").addEventListener("click", () => goTick((M.tick === null ? M.ticks.length - 1 : M.tick) + 1));
  let playing = null;
  $("tl-play").addEventListener("click", () => {
    if (playing) { clearInterval(playing); playing = null; setText($("tl-play"), "▷ play"); return; }
    if (M.tick === null || M.tick >= M.ticks.length - 1) goTick(0);
    setText($("tl-play"), "❚❚ pause");
    playing = setInterval(() => {
      if (M.tick >= M.ticks.length - 1) { clearInterval(playing); playing = null; setText($("tl-play"), "▷ play"); return; }
      goTick(M.tick + 1);
    }, 100);
  });

  // ------------------------------------------------------------------------------------------ URL hash: #request=ID&tick=N
  function writeHash() {
    const p = new URLSearchParams();
    if (M.select) p.set("request", M.select);
    if (M.tick !== null) p.set("tick", M.tick);
    history.replaceState(null, "", "#" + p.toString());
  }
  function readHash() {
    const p = new URLSearchParams(location.hash.slice(1));
    if (p.get("request")) { M.select = p.get("request"); setText($("detail-title"), M.select); }
    const tick = parseInt(p.get("tick") ?? "", 10);  // a whole number, or no tick (the server takes no other)
    if (!Number.isNaN(tick)) M.tick = tick;
  }
  window.addEventListener("resize", schedulePlots);

  readHash();
  connect();
})();
