// The events page: the log (heartbeats left out), newest first, filtered by type, node,
// cluster and replica, with the live tail from the event stream. A click shows an event
// whole: its position, stream and version, ids and payload.
"use strict";

(() => {
  const { config, data } = gm.boot();
  const el = gm.el;
  const KEEP = 5000; // events held in the page; older ones come back with "older events"
  const SHOWN = 1000; // rows drawn at most, newest first
  const OLDER = 500;

  let events = []; // oldest first
  let start = 0; // every event in (start, first held] is held; 0: the log's beginning
  const placements = new Map(); // "replica@epoch" -> node, to give replica events their node
  const seen = { node: new Set(), cluster: new Set(), replica: new Set() };
  let pending = 0; // arrived while the tail was off
  let selected = null;

  const tbody = document.querySelector("#events tbody");
  const inputs = {
    type: document.getElementById("f-type"),
    node: document.getElementById("f-node"),
    cluster: document.getElementById("f-cluster"),
    replica: document.getElementById("f-replica"),
  };
  const tail = document.getElementById("tail");
  const olderButton = document.getElementById("older");

  // -- what an event is about --------------------------------------------------------------

  function learn(envelope) {
    const p = envelope.payload || {};
    if (envelope.type === "replica.placed.v1") placements.set(`${p.replica_id}@${p.epoch}`, p.node_id);
    const f = facets(envelope);
    for (const name of ["node", "cluster", "replica"]) if (f[name]) seen[name].add(f[name]);
  }

  function facets(envelope) {
    const p = envelope.payload || {};
    const slash = envelope.stream.indexOf("/");
    const kind = envelope.stream.slice(0, slash);
    const id = envelope.stream.slice(slash + 1);
    const replica = p.replica_id || (kind === "replica" ? id : "");
    let node = p.node_id || (kind === "node" || kind === "heartbeat" ? id : "");
    if (!node && replica) node = placements.get(`${replica}@${p.epoch}`) || "";
    let cluster = p.cluster || (kind === "cluster" ? id : "");
    // Replica ids are "<cluster>-<ordinal>" (actors/cluster_actor.py).
    if (!cluster && replica) cluster = replica.replace(/-\d+$/, "");
    return { node, cluster, replica };
  }

  function filters() {
    return {
      type: inputs.type.value,
      node: inputs.node.value.trim(),
      cluster: inputs.cluster.value.trim(),
      replica: inputs.replica.value.trim(),
    };
  }

  function matches(envelope, f) {
    if (f.type && !(f.type.endsWith(".") ? envelope.type.startsWith(f.type) : envelope.type === f.type)) {
      return false;
    }
    if (!f.node && !f.cluster && !f.replica) return true;
    const about = facets(envelope);
    return (!f.node || about.node === f.node) &&
      (!f.cluster || about.cluster === f.cluster) &&
      (!f.replica || about.replica === f.replica);
  }

  function summary(envelope) {
    const p = envelope.payload || {};
    const skip = new Set(["type", "node_id", "replica_id", "cluster"]);
    const parts = [];
    for (const [name, value] of Object.entries(p)) {
      if (skip.has(name)) continue;
      parts.push(`${name}=${typeof value === "object" ? JSON.stringify(value) : value}`);
    }
    const text = parts.join("  ");
    return text.length > 240 ? text.slice(0, 239) + "…" : text;
  }

  // -- drawing -----------------------------------------------------------------------------

  function drawRow(envelope) {
    const row = el("tr", { dataset: { position: String(envelope.position) } },
      el("td", { className: "num mono" }, envelope.position),
      el("td", { className: "mono", title: gm.fmtDateTime(envelope.recorded_at) }, gm.fmtTime(envelope.recorded_at)),
      el("td", null, envelope.type),
      el("td", { className: "mono" }, envelope.stream),
      el("td", { className: "detail-cell", title: summary(envelope) }, summary(envelope)));
    if (selected === envelope.position) row.classList.add("selected");
    row._envelope = envelope;
    return row;
  }

  function draw() {
    const f = filters();
    const rows = [];
    let found = 0;
    for (let i = events.length - 1; i >= 0; i -= 1) {
      if (!matches(events[i], f)) continue;
      found += 1;
      if (rows.length < SHOWN) rows.push(drawRow(events[i]));
    }
    tbody.replaceChildren(...rows);
    note(found);
  }

  function note(found) {
    const shown = Math.min(found, SHOWN);
    let text = `${found} of ${events.length} events`;
    if (shown < found) text += ` (the newest ${shown} drawn: narrow the filter)`;
    if (pending) text += `; ${pending} new (live tail off)`;
    document.getElementById("shown").textContent = text;
    olderButton.hidden = start <= 0;
    document.getElementById("older-note").textContent =
      start <= 0 ? "the log's beginning" : `held from position ${start + 1}`;
  }

  function lists() {
    for (const name of ["node", "cluster", "replica"]) {
      const list = document.getElementById("seen-" + name);
      const values = [...seen[name]].sort(gm.compare);
      if (list.options.length === values.length) continue;
      list.replaceChildren(...values.map((v) => el("option", { value: v })));
    }
  }

  function show(envelope) {
    selected = envelope.position;
    for (const row of tbody.querySelectorAll("tr.selected")) row.classList.remove("selected");
    const row = tbody.querySelector(`tr[data-position="${envelope.position}"]`);
    if (row) row.classList.add("selected");
    const panel = document.getElementById("detail");
    panel.hidden = false;
    document.getElementById("d-position").textContent = envelope.position;
    const about = facets(envelope);
    const meta = [
      ["position", envelope.position],
      ["type", envelope.type],
      ["stream", `${envelope.stream} (version ${envelope.version})`],
      ["recorded at", `${gm.fmtDateTime(envelope.recorded_at)} (${envelope.recorded_at} ns)`],
      ["event id", envelope.event_id],
      ["correlation", envelope.correlation_id || "–"],
      ["causation", envelope.causation_id || "–"],
      ["node", about.node || "–"],
      ["cluster", about.cluster || "–"],
      ["replica", about.replica || "–"],
    ];
    document.getElementById("d-meta").replaceChildren(
      ...meta.flatMap(([name, value]) => [el("dt", null, name), el("dd", null, value)]));
    document.getElementById("d-payload").textContent = JSON.stringify(envelope.payload, null, 2);
    document.getElementById("d-envelope").textContent = JSON.stringify(envelope, null, 2);
    history.replaceState(null, "", location.pathname + location.search + "#" + envelope.position);
  }

  // -- events arriving ---------------------------------------------------------------------

  function add(envelope) {
    learn(envelope);
    events.push(envelope);
    if (events.length > KEEP) {
      const dropped = events.splice(0, events.length - KEEP);
      start = dropped[dropped.length - 1].position;
    }
    if (!tail.checked) {
      pending += 1;
      countLater();
      return;
    }
    if (matches(envelope, filters())) {
      tbody.prepend(drawRow(envelope));
      while (tbody.rows.length > SHOWN) tbody.lastElementChild.remove();
    }
    lists();
    countLater();
  }

  // Counting every match again is linear in the events held: done once for a burst.
  const countLater = gm.debounce(() => {
    const f = filters();
    let found = 0;
    for (const e of events) if (matches(e, f)) found += 1;
    note(found);
  }, 250);

  async function older() {
    olderButton.disabled = true;
    try {
      const page = await gm.getJSON(`/ui/data/events?to=${start}&limit=${OLDER}`);
      for (const e of page.events) learn(e);
      events = page.events.concat(events);
      start = page.start;
      lists();
      draw();
    } catch (err) {
      gm.banner("could not read older events: " + err.message);
    } finally {
      olderButton.disabled = false;
    }
  }

  // -- wiring ------------------------------------------------------------------------------

  const groups = [...new Set(config.types.map((t) => t.split(".")[0] + "."))];
  inputs.type.append(
    ...groups.map((g) => el("option", { value: g }, `${g}*`)),
    ...config.types.filter((t) => t !== "node.heartbeat.v1").map((t) => el("option", { value: t }, t)));

  const query = new URLSearchParams(location.search);
  for (const [name, input] of Object.entries(inputs)) {
    const value = query.get(name);
    if (value) input.value = value;
  }

  function filtered() {
    const params = new URLSearchParams();
    for (const [name, value] of Object.entries(filters())) if (value) params.set(name, value);
    const search = params.toString();
    history.replaceState(null, "", location.pathname + (search ? "?" + search : ""));
    draw();
  }
  inputs.type.addEventListener("change", filtered);
  for (const name of ["node", "cluster", "replica"]) {
    inputs[name].addEventListener("input", gm.debounce(filtered, 150));
  }
  tail.addEventListener("change", () => {
    if (tail.checked) {
      pending = 0;
      lists();
      draw();
    }
  });
  tbody.addEventListener("click", (e) => {
    const row = e.target.closest("tr");
    if (row && row._envelope) show(row._envelope);
  });
  olderButton.addEventListener("click", older);

  function begin(snapshot) {
    for (const c of snapshot.clusters || []) {
      for (const r of c.replicas) placements.set(`${r.replica_id}@${r.epoch}`, r.node_id);
    }
    events = snapshot.events.slice();
    start = snapshot.start;
    for (const e of events) learn(e);
    lists();
    draw();
    const wanted = Number(location.hash.slice(1));
    const chosen = wanted && events.find((e) => e.position === wanted);
    if (chosen) show(chosen);
    gm.ready();
  }

  if (data.error) {
    gm.banner("the controller did not answer: " + data.error);
    begin({ events: [], start: 0 });
  } else {
    begin(data);
  }
  gm.live({
    after: data.error ? null : data.head,
    heartbeats: false,
    types: config.types,
    onEvent: add,
  });
})();
