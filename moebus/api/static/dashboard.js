"use strict";
// The moebus cache page: polls /v1/cache and redraws. No framework, no build step, no outside fetch.
(function () {
  const params = new URLSearchParams(location.search);
  const POLL_MS = Math.max(200, Number(params.get("poll_ms")) || 1000);
  const KEY_STORE = "moebus-api-key";
  const STATS = [  // [field of /v1/cache's gpu, label]
    ["expert_slots", "expert slots"], ["expert_cache_mib", "cache MiB"], ["free_mib", "free MiB"],
    ["reserve_mib", "reserve MiB"], ["resident_experts", "resident"], ["hit_rate", "hit rate"],
    ["experts_dtype", "experts dtype"], ["attention_dtype", "attention dtype"],
    ["lm_head_dtype", "lm_head dtype"],
  ];
  const state = { polls: 0, failures: 0, last: null, round: 0 };
  window.moebusDashboard = state;  // for tests and curious operators

  const $ = (id) => document.getElementById(id);
  function el(tag, attrs, ...children) {
    const svg = ["svg", "polyline", "polygon", "line", "circle"].includes(tag);
    const node = svg ? document.createElementNS("http://www.w3.org/2000/svg", tag) : document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    for (const c of children) node.append(c);
    return node;
  }
  function fmt(v) {
    if (v === null || v === undefined) return "–";
    if (typeof v !== "number") return String(v);
    return Number.isInteger(v) ? String(v) : v.toFixed(1);
  }
  const pct = (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(1) + " %");
  const clock = (t) => new Date(t * 1000).toLocaleTimeString([], { hour12: false });

  // -- API key: from #key=… once, then kept for this tab only ---------------------------------
  // A key is what a Bearer header can carry: visible ASCII. Anything else in the address (a
  // malformed %-escape, say) or typed in the form asks for the key again instead of failing.
  const KEY_CHARS = /^[\x21-\x7e]+$/;
  function askForKey(note) {
    sessionStorage.removeItem(KEY_STORE);
    $("key-note").textContent = note;
    $("key-form").hidden = false;
    $("status").textContent = "API key needed";
    $("status").className = "badge bad";
  }
  function keyFromAddress() {
    const m = location.hash.match(/(?:^#|&)key=([^&]*)/);
    if (!m) return;
    history.replaceState(null, "", location.pathname + location.search);  // good or bad, not in the address
    let key = null;
    try {
      key = decodeURIComponent(m[1]);
    } catch (err) {  // URIError: not a percent-encoded text
    }
    if (key !== null && KEY_CHARS.test(key)) sessionStorage.setItem(KEY_STORE, key);
    else askForKey("The key in the address could not be read: type it here.");
  }
  function apiKey() {
    keyFromAddress();
    const key = sessionStorage.getItem(KEY_STORE);
    return key !== null && KEY_CHARS.test(key) ? key : null;
  }
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const key = $("key-input").value.trim();
    if (!KEY_CHARS.test(key)) {
      askForKey("That cannot be a key (visible ASCII, no spaces): type it again.");
      return;
    }
    sessionStorage.setItem(KEY_STORE, key);
    $("key-form").hidden = true;
    poll();
  });

  // -- per-GPU cards -------------------------------------------------------------------------
  function gpuCard(g) {
    const id = "gpu" + g.gpu;
    let card = $(id + "-card");
    if (card) return card;
    const stats = el("dl", { class: "stats" });
    for (const [key, label] of STATS) {
      stats.append(el("div", {}, el("dt", {}, label), el("dd", { id: id + "-" + key, class: key }, "–")));
    }
    card = el("article", { class: "card gpu", id: id + "-card", "data-gpu": String(g.gpu) },
      el("h3", {}, "GPU " + g.gpu + " ", el("span", { class: "muted small", id: id + "-layers" }),
        " ", el("span", { class: "badge", id: id + "-ready" })),
      stats,
      el("canvas", { class: "residency", id: id + "-residency", "data-resident": "0" }),
      el("div", { class: "legend small muted" }, el("span", { id: id + "-resident-text" }), " · 0 hits",
        legendBar(), el("span", { id: id + "-max-hits" })));
    $("gpus").append(card);
    return card;
  }
  function legendBar() {
    const c = el("canvas", { width: "120", height: "10" });
    const ctx = c.getContext("2d");
    for (let x = 0; x < 120; x++) { ctx.fillStyle = heat(x / 119); ctx.fillRect(x, 0, 1, 10); }
    return c;
  }
  function heat(t) {  // resident, cold (blue) -> hot (orange)
    const hue = 210 - 185 * t, light = 38 + 22 * t;
    return `hsl(${hue}, 85%, ${light}%)`;
  }
  function renderGpu(g) {
    gpuCard(g);
    const id = "gpu" + g.gpu;
    for (const [key] of STATS) $(id + "-" + key).textContent = key === "hit_rate" ? pct(g[key]) : fmt(g[key]);
    $(id + "-layers").textContent = g.layers ? `layers ${g.layers[0]}–${g.layers[1] - 1}` : "";
    $(id + "-ready").textContent = g.ready ? "ready" : "not ready";
    $(id + "-ready").className = "badge " + (g.ready ? "ok" : "bad");
    drawResidency($(id + "-residency"), g.residency, id);
  }
  function drawResidency(canvas, res, id) {
    if (!res) { $(id + "-resident-text").textContent = "no residency reported yet"; return; }
    const E = res.num_experts;
    const L = res.layers.length || Math.max(1, Math.ceil((Math.max(-1, ...res.keys) + 1) / E));
    const dpr = window.devicePixelRatio || 1;
    const cell = Math.max(1, Math.floor((canvas.clientWidth || 300) * dpr / E));
    const rowH = Math.min(4 * cell, Math.max(cell, Math.ceil(90 * dpr / L)));
    canvas.width = E * cell;
    canvas.height = L * rowH;
    canvas.style.height = (L * rowH / dpr) + "px";
    const ctx = canvas.getContext("2d");
    const gap = cell >= 4 ? 1 : 0;
    ctx.fillStyle = "#1d2833";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    ctx.fillStyle = "#26323f";
    for (let r = 0; r < L; r++) for (let e = 0; e < E; e++) ctx.fillRect(e * cell, r * rowH, cell - gap, rowH - gap);
    const maxHits = Math.max(0, ...res.hits);
    res.keys.forEach((key, i) => {
      const row = Math.floor(key / E), e = key % E;
      ctx.fillStyle = heat(maxHits > 0 ? Math.log1p(res.hits[i]) / Math.log1p(maxHits) : 0);
      ctx.fillRect(e * cell, row * rowH, cell - gap, rowH - gap);
    });
    canvas.dataset.resident = String(res.keys.length);
    canvas.dataset.cells = String(L * E);
    $(id + "-resident-text").textContent = `${res.keys.length} of ${L * E} resident (${L} layers × ${E} experts)`;
    $(id + "-max-hits").textContent = `${maxHits} hits`;
  }

  // -- history -------------------------------------------------------------------------------
  function drawSeries(svg, ts, vs, t0, t1, vMax) {
    svg.replaceChildren(el("line", { x1: 0, y1: 50, x2: 300, y2: 50 }));
    let points = [];
    const flush = () => {
      if (points.length === 1) {  // a lone interval: a dot, since a line needs two
        const [x, y] = points[0].split(",");
        svg.append(el("circle", { cx: x, cy: y, r: 2.5 }));
      } else if (points.length) svg.append(el("polyline", { points: points.join(" ") }));
      points = [];
    };
    ts.forEach((t, i) => {
      if (vs[i] === null || t < t0) { flush(); return; }
      const x = (300 * (t - t0)) / (t1 - t0), y = 98 - (96 * vs[i]) / vMax;
      points.push(x.toFixed(1) + "," + y.toFixed(1));
    });
    flush();
  }
  function lastMinute(r, now) {  // the tiles: summed over the intervals of the last 60 s
    const sum = { tokens: 0, seconds: 0, hits: 0, lookups: 0 };
    r.t_s.forEach((t, i) => {
      if (t < now - 60) return;
      sum.tokens += r.tokens[i]; sum.seconds += r.dt_s[i]; sum.hits += r.hits[i]; sum.lookups += r.lookups[i];
    });
    return sum;
  }
  function renderRates(d) {
    const r = d.rates, t1 = d.now_s || Date.now() / 1000, t0 = t1 - (d.window_s || 600);
    const tokMax = Math.max(1, ...r.tok_s);
    drawSeries($("tok-chart"), r.t_s, r.tok_s, t0, t1, tokMax);
    drawSeries($("hit-chart"), r.t_s, r.hit_rate, t0, t1, 1);
    const recent = lastMinute(r, t1);
    $("tok-s-now").textContent = recent.seconds > 0 ? (recent.tokens / recent.seconds).toFixed(1) : "–";
    $("hit-rate-now").textContent = recent.lookups > 0 ? pct(recent.hits / recent.lookups) : "–";
    const mins = Math.round((d.window_s || 600) / 60);
    for (const label of document.querySelectorAll(".axis-start")) label.textContent = `−${mins} min`;
    $("tok-s-range").textContent = `last ${mins} min · peak ${tokMax.toFixed(1)}`;
    $("hit-rate-range").textContent = `last ${mins} min · 0–100 %`;
  }
  function renderEvents(d) {
    const t1 = d.now_s || Date.now() / 1000, t0 = t1 - (d.window_s || 600);
    const svg = $("vram-timeline");
    svg.replaceChildren(el("line", { x1: 0, y1: 20, x2: 300, y2: 20 }));
    for (const ev of d.vram_events) {
      if (ev.t_s < t0) continue;
      const x = (300 * (ev.t_s - t0)) / (t1 - t0);
      const shape = ev.kind === "regrow" ? `${x - 4},30 ${x + 4},30 ${x},8` : ev.kind === "hand-back"
        ? `${x - 4},10 ${x + 4},10 ${x},32` : `${x - 3},17 ${x + 3},17 ${x + 3},23 ${x - 3},23`;
      svg.append(el("polygon", { points: shape, class: ["regrow", "hand-back"].includes(ev.kind) ? ev.kind : "other" }));
    }
    const list = $("vram-events");
    const recent = d.vram_events.slice(-10).reverse();
    if (!recent.length) return;
    list.replaceChildren(...recent.map((ev) => {
      const delta = ev.delta_mib === null ? "" : ` ${ev.delta_mib > 0 ? "+" : ""}${fmt(ev.delta_mib)} MiB`;
      const reserve = ev.reserve_mib.map((r) => (r === null ? "start-up" : fmt(r))).join(", ");
      return el("li", { class: ev.kind }, `${clock(ev.t_s)} `, el("b", {}, ev.kind + delta),
        ` · cache ${ev.expert_cache_mib.map(fmt).join(", ")} MiB · slots ${ev.expert_slots.map(fmt).join(", ")}` +
        ` · reserve ${reserve}` + (ev.error ? ` · ${ev.error}` : ""));
    }));
  }
  function renderVision(v) {
    const box = $("vision");
    if (!v) {
      $("vision-state").textContent = "none";
      box.replaceChildren(el("p", { class: "muted" }, "no vision"));
      return;
    }
    const countdown = ["idle_left_s", "idle_s_left", "stops_in_s", "idle_countdown_s"].find((k) => k in v);
    $("vision-state").textContent = String(v.state ?? "?");
    const rows = Object.entries(v).filter(([, x]) => typeof x !== "object" || x === null);
    box.replaceChildren(
      el("p", {}, "state ", el("b", { id: "vision-state-text" }, String(v.state ?? "?")),
        countdown && v[countdown] !== null ? ` · stops in ${fmt(v[countdown])} s if idle` : ""),
      el("dl", { class: "stats" }, ...rows.map(([k, x]) => el("div", {}, el("dt", {}, k), el("dd", {}, fmt(x))))));
  }

  function render(d) {
    $("model").textContent = d.model || "";
    $("requests-running").textContent = fmt(d.requests.running);
    $("requests-waiting").textContent = fmt(d.requests.waiting);
    d.gpus.forEach(renderGpu);
    renderRates(d);
    renderEvents(d);
    renderVision(d.vision);
    const status = $("status");
    status.textContent = d.ready ? "ready" : "not ready";
    status.className = "badge " + (d.ready ? "ok" : "bad");
    $("updated").textContent = clock(d.now_s || Date.now() / 1000);
  }

  async function poll() {
    clearTimeout(state.timer);
    const key = apiKey();
    const round = ++state.round;  // a key typed meanwhile starts a newer round: an older answer is stale
    try {
      const resp = await fetch("/v1/cache", { cache: "no-store", headers: key ? { Authorization: "Bearer " + key } : {} });
      if (round !== state.round) return;  // (a keyless 401 would otherwise forget the key just given)
      if (resp.status === 401) {
        if (key !== null) askForKey("The server did not take that key: type it again.");
        else askForKey($("key-note").textContent);
        return;  // polling resumes when a key is given
      }
      const body = await resp.json();
      if (!resp.ok) throw new Error((body.error && body.error.message) || resp.statusText);
      state.last = body;
      render(body);
      state.polls += 1;
      document.body.dataset.polls = String(state.polls);
    } catch (err) {
      if (round !== state.round) return;
      state.failures += 1;
      $("status").textContent = "no answer: " + err.message;
      $("status").className = "badge bad";
    }
    state.timer = setTimeout(poll, POLL_MS);
  }
  state.render = render;  // a test can show what INFO with a vision worker would look like
  $("poll-s").textContent = (POLL_MS / 1000).toString();
  poll();
})();
