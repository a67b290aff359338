// The clusters page: each cluster's spec revision and its replicas (epoch, state, node, where
// they answer, why they were placed there). A cluster or replica event in the stream has the
// page ask /ui/data/clusters again (once for a burst of them): the controller's own summary
// (ready of desired, rolled out) stays the one truth.
"use strict";

(() => {
  const { config, data } = gm.boot();
  const el = gm.el;
  const holder = document.getElementById("clusters");
  let clusters = [];
  let match = gm.matcher("");
  let ready = false;

  function draw() {
    // A redraw keeps open the specs someone opened.
    const opened = new Set([...holder.querySelectorAll("section.cluster details[open]")]
      .map((d) => d.closest("section").dataset.name));
    holder.replaceChildren();
    let replicas = 0;
    let readyCount = 0;
    for (const c of clusters) {
      replicas += c.desired;
      readyCount += c.ready;
      holder.append(drawCluster(c, opened.has(c.name)));
    }
    if (clusters.length === 0) {
      holder.append(el("p", { className: "muted" }, "No clusters yet: gpumesh cluster create -f spec.toml"));
    }
    document.getElementById("summary").replaceChildren(
      el("span", null, `${clusters.length} clusters, ${readyCount} of ${replicas} replicas ready`));
    applyFilter();
    drawCharts();
  }

  // -- charts: this gateway's last 15 minutes per cluster (gateway/ui/history.py), pushed
  // over /ui/data/metrics/stream as each 10 s sample is taken; drawn as inline SVG here.
  const SVG = "http://www.w3.org/2000/svg";
  let metrics = { interval_s: 0, keep_s: 0, samples: [] };
  let metricsState = "waiting";  // waiting | on | none (this gateway keeps no metrics)

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function niceTop(peak) {
    if (!(peak > 0)) return 1;
    const power = Math.pow(10, Math.floor(Math.log10(peak)));
    for (const f of [1, 2, 2.5, 5, 10]) if (f * power >= peak) return f * power;
    return 10 * power;
  }

  function short(v) {
    if (v >= 1000) return `${+(v / 1000).toPrecision(3)}k`;
    return `${+v.toPrecision(3)}`;
  }

  // series: [{name, colour, points: [[t_ns, y or null]]}]; a null breaks the line.
  function ago(seconds) {
    return seconds >= 120 ? `-${+(seconds / 60).toFixed(1)} min` : `-${+seconds.toFixed(1)} s`;
  }

  function lineChart({ title, unit, series, lo, hi }) {
    const W = 320, H = 130, L = 44, R = 8, T = 20, B = 20;
    const peak = Math.max(0, ...series.flatMap((s) => s.points.map((p) => p[1] ?? 0)));
    const top = niceTop(peak);
    const px = (t) => (L + (W - L - R) * (t - lo) / (hi - lo)).toFixed(1);
    const py = (v) => (H - B - (H - T - B) * v / top).toFixed(1);
    const chart = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "chart", role: "img", "aria-label": title });
    chart.append(svg("text", { x: L, y: 12, class: "chart-title" }, title));
    for (const k of [0, 1, 2]) {
      const v = top * k / 2;
      chart.append(svg("line", { x1: L, x2: W - R, y1: py(v), y2: py(v), class: "grid-line" }));
      chart.append(svg("text", { x: L - 4, y: +py(v) + 3, class: "tick", "text-anchor": "end" }, short(v) + unit));
    }
    const span = (hi - lo) / 1e9;
    for (const [k, text] of [[0, ago(span)], [1, ago(span * 2 / 3)], [2, ago(span / 3)], [3, "now"]]) {
      chart.append(svg("text", { x: px(lo + k * (hi - lo) / 3), y: H - 5, class: "tick",
        "text-anchor": k === 0 ? "start" : k === 3 ? "end" : "middle" }, text));
    }
    let legend = W - R;
    for (const s of [...series].reverse()) {
      let d = "";
      let up = true;
      for (const [t, v] of s.points) {
        if (v === null || v === undefined || t < lo) { up = true; continue; }
        d += `${up ? "M" : "L"}${px(t)},${py(v)} `;
        up = false;
      }
      if (d) {
        const path = svg("path", { d: d.trim(), class: "series", stroke: s.colour, "data-series": s.name });
        path.append(svg("title", null, s.name));
        chart.append(path);
      }
      chart.append(svg("text", { x: legend, y: 12, fill: s.colour, "text-anchor": "end", class: "tick" }, s.name));
      legend -= 10 + 6 * s.name.length;
    }
    return chart;
  }

  function drawCharts() {
    const holders = holder.querySelectorAll("div.charts");
    const samples = metrics.samples;
    for (const box of holders) {
      if (metricsState === "none") {
        box.replaceChildren(el("p", { className: "muted" }, "This gateway keeps no metrics history."));
        continue;
      }
      if (samples.length === 0) {
        box.replaceChildren(el("p", { className: "muted" },
          `Charts: the first sample of this gateway's traffic comes ${metrics.interval_s || 10} s after it starts.`));
        continue;
      }
      const name = box.dataset.cluster;
      const hi = samples[samples.length - 1].at_ns;
      const lo = hi - (metrics.keep_s || 900) * 1e9;
      const of = (i) => samples.map((s) => [s.at_ns, s.clusters[name] ? s.clusters[name][i] : (i < 3 ? 0 : null)]);
      const latency = samples.map((s) => s.clusters[name] ? s.clusters[name][4] : null);
      const ms = Math.max(0, ...latency.filter((v) => v !== null)) < 1;
      const scaled = (i) => of(i).map(([t, v]) => [t, v === null ? null : (ms ? v * 1000 : v)]);
      box.replaceChildren(
        lineChart({ title: "requests / s", unit: "", lo, hi,
          series: [{ name: "requests", colour: "#2454c5", points: of(0) }] }),
        lineChart({ title: "latency", unit: ms ? " ms" : " s", lo, hi,
          series: [{ name: "p50", colour: "#1a7f37", points: scaled(3) },
            { name: "p99", colour: "#9a6700", points: scaled(4) }] }),
        lineChart({ title: "errors / s", unit: "", lo, hi,
          series: [{ name: "5xx", colour: "#c62828", points: of(1) },
            { name: "retries", colour: "#8250df", points: of(2) }] }));
      // For the tests: how many samples it drew, and the highest rate among them.
      box.dataset.samples = String(samples.length);
      box.dataset.peak = String(Math.max(0, ...of(0).map((p) => p[1] || 0)));
    }
  }

  function followMetrics() {
    const source = gm.stream("/ui/data/metrics/stream");
    source.addEventListener("snapshot", (message) => {
      metrics = JSON.parse(message.data);
      metricsState = metrics.interval_s ? "on" : "none";
      if (metricsState === "none") source.close();
      drawCharts();
    });
    source.addEventListener("sample", (message) => {
      metrics.samples.push(JSON.parse(message.data));
      const keep = Math.round((metrics.keep_s || 900) / (metrics.interval_s || 10));
      if (metrics.samples.length > keep) metrics.samples.splice(0, metrics.samples.length - keep);
      drawCharts();
    });
  }

  function drawCluster(c, specOpen) {
    const complete = c.ready === c.desired;
    // rolled_out stays 0 until a revision's rollout ends (cluster.rolled_out.v1): the first
    // revision of a cluster never rolls out over another, so only a later one is "rolling out".
    const rollingOut = c.revision > 1 && c.rolled_out < c.revision;
    const head = el("header", null,
      el("h2", null, el("a", { href: "/ui/events?cluster=" + encodeURIComponent(c.name) }, c.name)),
      gm.badge(complete ? "s-ready" : "s-starting", `${c.ready} / ${c.desired} ready`,
        "ready replicas of the desired count"),
      el("span", { title: "the spec's revision (cluster apply, rollback)" }, `revision ${c.revision}`),
      rollingOut
        ? el("span", { className: "warm" },
          c.rolled_out ? `rolling out (revision ${c.rolled_out} fully rolled out)` : "rolling out")
        : null,
      c.spec && c.spec.model ? el("span", { className: "muted" }, `model ${c.spec.model}`) : null,
      c.unschedulable ? el("span", { className: "error", title: c.unschedulable }, `unschedulable: ${c.unschedulable}`) : null);
    const body = el("tbody");
    for (const r of c.replicas) {
      const row = el("tr", { className: r.status === "stopped" ? "offline" : "" },
        el("td", null, el("a", { href: "/ui/events?replica=" + encodeURIComponent(r.replica_id) }, r.replica_id)),
        el("td", { className: "num" }, r.epoch),
        el("td", { className: r.revision < c.revision ? "num warm" : "num",
          title: r.revision < c.revision ? "an earlier revision than the spec's" : "" }, r.revision),
        el("td", null, gm.badge("s-" + r.status, r.status)),
        el("td", null, r.node_id ? el("a", { href: "/ui/events?node=" + encodeURIComponent(r.node_id) }, r.node_id) : "–"),
        el("td", { className: "mono" }, r.address || ""),
        el("td", { className: "why" }, r.why || ""),
        el("td", { className: "error" }, r.failure || ""));
      row._search = [c.name, r.replica_id, r.node_id, r.status, r.failure].join(" ").toLowerCase();
      body.append(row);
    }
    const table = el("table", { className: "grid" },
      el("thead", null, el("tr", null,
        el("th", null, "Replica"), el("th", { className: "num" }, "Epoch"),
        el("th", { className: "num", title: "the spec revision it runs" }, "Rev"),
        el("th", null, "State"), el("th", null, "Node"), el("th", null, "Address"),
        el("th", null, "Placement"), el("th", null, "Failure"))),
      body);
    const spec = el("details", { open: specOpen },
      el("summary", null, `spec, revision ${c.revision}`),
      el("pre", null, JSON.stringify(c.spec, null, 2)));
    const charts = el("div", { className: "charts", dataset: { cluster: c.name } });
    const section = el("section", { className: "cluster", dataset: { name: c.name } }, head, charts, table, spec);
    section._search = c.name.toLowerCase();
    return section;
  }

  function applyFilter() {
    for (const section of holder.querySelectorAll("section.cluster")) {
      const whole = match(section._search);
      let any = false;
      for (const row of section.querySelectorAll("tbody tr")) {
        row.hidden = !(whole || match(row._search));
        any = any || !row.hidden;
      }
      section.hidden = !(whole || any);
    }
  }

  const refresh = gm.debounce(async () => {
    try {
      start(await gm.getJSON("/ui/data/clusters"));
    } catch (err) {
      gm.banner("could not read the clusters: " + err.message);
    }
  }, 200);

  const filter = document.getElementById("filter");
  filter.addEventListener("input", gm.debounce(() => {
    match = gm.matcher(filter.value);
    applyFilter();
  }, 120));

  function start(snapshot) {
    clusters = snapshot.clusters;
    ready = true;
    draw();
    gm.ready();
  }

  if (data.error) gm.banner("the controller did not answer: " + data.error);
  else start(data);
  followMetrics();
  gm.live({
    after: data.error ? null : data.head,
    heartbeats: false,
    types: config.types,
    onEvent: (envelope) => {
      if (envelope.type.startsWith("cluster.") || envelope.type.startsWith("replica.")) refresh();
    },
    onOpen: () => { if (!ready) refresh(); },
  });
})();
