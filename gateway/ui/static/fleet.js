// The fleet page: one row per node, kept current by the event stream (heartbeats included:
// they carry the GPU readings). Events change the page's own copy of each node; the rows they
// touched are drawn again a few times a second at most, and the others are left alone, so a
// thousand nodes heartbeating stay cheap to show.
"use strict";

(() => {
  const { config, data } = gm.boot();
  const el = gm.el;
  const HEALTH_RANK = { offline: 0, unhealthy: 1, degraded: 2, suspect: 3, healthy: 4 };
  const FLUSH_MS = 250; // rows drawn again at most this often
  const RESORT_MS = 1000; // a live sort key (temperature, ...) reorders at most this often

  const nodes = new Map(); // node_id -> the node as node.list gives it, then as events change it
  let replicasByNode = new Map(); // node_id -> [{replica_id, cluster, epoch, status}]
  const rows = new Map(); // node_id -> <tr>
  const dirty = new Set();
  const sort = { key: "node", dir: 1 };
  let match = gm.matcher("");
  let flushTimer = null;
  let lastSort = 0;
  let ready = false;
  const waiting = []; // events that came before the first data

  const table = document.getElementById("nodes");
  const tbody = table.tBodies[0];

  // -- the model ---------------------------------------------------------------------------

  function loadSnapshot(snapshot) {
    nodes.clear();
    for (const node of snapshot.nodes) nodes.set(node.node_id, node);
    replicasByNode = byNode(snapshot.clusters);
    tbody.replaceChildren();
    rows.clear();
    watcher.disconnect();
    seen.clear();
    stale.clear();
    for (const id of nodes.keys()) rows.set(id, drawRow(id));
    resort(true);
    summarise();
  }

  function byNode(clusters) {
    const found = new Map();
    for (const cluster of clusters) {
      for (const r of cluster.replicas) {
        if (!r.node_id || r.status === "stopped") continue;
        if (!found.has(r.node_id)) found.set(r.node_id, []);
        found.get(r.node_id).push({ ...r, cluster: cluster.name });
      }
    }
    for (const list of found.values()) list.sort((a, b) => gm.compare(a.replica_id, b.replica_id));
    return found;
  }

  const refreshReplicas = gm.debounce(async () => {
    try {
      const snapshot = await gm.getJSON("/ui/data/clusters");
      const before = replicasByNode;
      replicasByNode = byNode(snapshot.clusters);
      for (const id of new Set([...before.keys(), ...replicasByNode.keys()])) {
        if (JSON.stringify(before.get(id)) !== JSON.stringify(replicasByNode.get(id))) touch(id);
      }
    } catch (err) {
      gm.banner("could not read the clusters: " + err.message);
    }
  }, 300);

  function apply(envelope) {
    if (!ready) {
      waiting.push(envelope);
      return;
    }
    const p = envelope.payload || {};
    const type = envelope.type;
    if (type.startsWith("replica.") || type.startsWith("cluster.")) {
      refreshReplicas();
      return;
    }
    if (!type.startsWith("node.")) return;
    const id = p.node_id;
    let node = nodes.get(id);
    switch (type) {
      case "node.registered.v1":
        node = Object.assign(node || {
          node_id: id, health: "healthy", health_reason: "registered", health_detail: "",
          drained: false, cordoned_until_ns: 0, cordon_reason: "", last_heartbeat_at: 0,
          metrics: [], running: [],
        }, {
          hostname: p.hostname || "", address: p.address || "", region: p.region || "",
          zone: p.zone || "", labels: p.labels || {}, gpus: p.gpus || [],
        });
        nodes.set(id, node);
        break;
      case "node.heartbeat.v1":
        if (!node) return;
        node.metrics = p.gpus || [];
        node.last_heartbeat_at = envelope.recorded_at;
        node.running = p.running || [];
        node.probe_error = p.probe_error || "";
        break;
      case "node.health_changed.v1":
        if (!node) return;
        node.health = p.state;
        node.health_reason = p.reason;
        node.health_detail = p.detail || "";
        break;
      case "node.drained.v1":
      case "node.undrained.v1":
        if (!node) return;
        node.drained = type === "node.drained.v1";
        break;
      case "node.cordoned.v1":
        if (!node) return;
        node.cordoned_until_ns = p.until_ns || -1;
        node.cordon_reason = p.reason || "";
        break;
      case "node.uncordoned.v1":
        if (!node) return;
        node.cordoned_until_ns = 0;
        node.cordon_reason = "";
        break;
      case "node.removed.v1":
        nodes.delete(id);
        break;
      default:
        return;
    }
    touch(id);
  }

  function touch(id) {
    dirty.add(id);
    if (flushTimer === null) flushTimer = setTimeout(flush, FLUSH_MS);
  }

  // Rows out of sight wait: a heartbeat for a node scrolled away marks its row stale, and the
  // row is filled again when it comes into view. A thousand nodes heartbeating then cost the
  // page the few dozen rows on the screen, not the thousand.
  const seen = new Set(); // ids of the rows in (or near) the viewport
  const stale = new Set();
  const watcher = new IntersectionObserver((entries) => {
    for (const entry of entries) {
      const id = entry.target.dataset.id;
      if (!entry.isIntersecting) {
        seen.delete(id);
        continue;
      }
      seen.add(id);
      if (stale.delete(id) && nodes.has(id)) fill(entry.target, nodes.get(id));
    }
  }, { rootMargin: "400px 0px" });

  function flush() {
    flushTimer = null;
    let added = false;
    for (const id of dirty) {
      const row = rows.get(id);
      const node = nodes.get(id);
      if (!node) {
        if (row) {
          watcher.unobserve(row);
          row.remove();
        }
        rows.delete(id);
        seen.delete(id);
        stale.delete(id);
        continue;
      }
      if (!row) {
        rows.set(id, drawRow(id));
        added = true;
        continue;
      }
      // What filtering and sorting read is kept current for every row; the cells only for
      // the rows in view.
      row._search = searchText(node);
      row._stats = stats(node);
      const hidden = !match(row._search);
      if (row.hidden !== hidden) row.hidden = hidden;
      if (seen.has(id)) fill(row, node);
      else stale.add(id);
    }
    dirty.clear();
    resort(added);
    summarise();
  }

  // -- drawing -----------------------------------------------------------------------------

  function cordoned(node) {
    const until = node.cordoned_until_ns || 0;
    return until === -1 || until > Date.now() * 1e6;
  }

  function gpuLines(node) {
    const readings = new Map((node.metrics || []).map((m) => [m.index, m]));
    return (node.gpus || []).map((gpu) => ({ gpu, m: readings.get(gpu.index) }));
  }

  function stats(node) {
    const metrics = node.metrics || [];
    let used = 0;
    let total = 0;
    let hottest = -1;
    let util = 0;
    for (const m of metrics) {
      used += m.memory_used_mib || 0;
      total += m.memory_total_mib || 0;
      hottest = Math.max(hottest, m.temperature_c || 0);
      util += m.utilization_pct || 0;
    }
    return {
      vram: total ? used / total : -1,
      temp: metrics.length ? hottest : -1,
      util: metrics.length ? util / metrics.length : -1,
    };
  }

  function searchText(node) {
    const replicas = (replicasByNode.get(node.node_id) || []).map((r) => `${r.replica_id} ${r.cluster}`);
    const labels = Object.entries(node.labels || {}).map(([k, v]) => `${k}=${v}`);
    const models = (node.gpus || []).map((g) => g.model);
    return [
      node.node_id, node.hostname, node.health, node.health_reason, node.region, node.zone,
      ...models, ...replicas, ...labels, node.drained ? "drained" : "", cordoned(node) ? "cordoned" : "",
    ].join(" ").toLowerCase();
  }

  // One row: nine cells, each a text or a few small elements; one line per GPU in the GPU
  // columns (text with newlines, shown as lines by the style sheet).
  function drawRow(id) {
    const row = el("tr", { dataset: { id } });
    for (let i = 0; i < 9; i += 1) row.append(el("td", { className: CELL_CLASSES[i] }));
    row._sig = new Array(9).fill(null);
    fill(row, nodes.get(id));
    row._search = searchText(nodes.get(id));
    row._stats = stats(nodes.get(id));
    row.hidden = !match(row._search);
    watcher.observe(row);
    return row;
  }
  const CELL_CLASSES = ["", "", "", "lines", "num lines", "num lines", "num lines", "", "mono"];

  // Each cell is drawn again only when what it shows changed (its signature).
  function fill(row, node) {
    const id = node.node_id;
    const lines = gpuLines(node);
    const cells = row.cells;
    const sig = row._sig;
    const set = (i, signature, draw) => {
      if (sig[i] === signature) return;
      sig[i] = signature;
      draw(cells[i]);
    };
    const offline = node.health === "offline";
    if (row.classList.contains("offline") !== offline) row.classList.toggle("offline", offline);

    set(0, `${id}|${node.hostname}`, (td) => td.replaceChildren(
      el("a", { href: "/ui/events?node=" + encodeURIComponent(id) }, id),
      node.hostname && node.hostname !== id ? el("div", { className: "muted" }, node.hostname) : ""));
    const why = [node.health_reason, node.health_detail].filter(Boolean).join(": ");
    const isCordoned = cordoned(node);
    set(1, `${node.health}|${why}|${node.drained}|${isCordoned}|${node.probe_error || ""}`, (td) => {
      td.replaceChildren(gm.badge("h-" + node.health, node.health, why));
      if (node.drained) td.append(el("span", { className: "badge tag" }, "drained"));
      if (isCordoned) td.append(el("span", { className: "badge tag", title: node.cordon_reason || "" }, "cordoned"));
      if (node.probe_error) td.append(el("div", { className: "error", title: node.probe_error }, "probe error"));
    });
    set(2, `${node.region}|${node.zone}`, (td) => td.replaceChildren(node.region || "",
      node.zone ? el("div", { className: "muted" }, node.zone) : ""));
    const text = (i, value) => set(i, value, (td) => { td.textContent = value; });
    text(3, lines.map(({ gpu }) => `${gpu.index}: ${gpu.model}`).join("\n"));
    text(4, lines.map(({ gpu, m }) => {
      const total = (m && m.memory_total_mib) || gpu.vram_mib || 0;
      if (!m) return `– / ${gm.gib(total)} GiB`;
      const used = m.memory_used_mib || 0;
      const share = total ? Math.round((100 * used) / total) : 0;
      return `${gm.gib(used)} / ${gm.gib(total)} GiB (${share}%)`;
    }).join("\n"));
    const hottest = row._stats ? row._stats.temp : stats(node).temp;
    const heat = hottest >= 85 ? "num lines hot" : hottest >= 75 ? "num lines warm" : "num lines";
    if (cells[5].className !== heat) cells[5].className = heat;
    text(5, lines.map(({ m }) => (m ? `${(m.temperature_c || 0).toFixed(0)} °C` : "–")).join("\n"));
    text(6, lines.map(({ m }) => (m ? `${(m.utilization_pct || 0).toFixed(0)} %` : "–")).join("\n"));
    const replicas = replicasByNode.get(id) || [];
    set(7, replicas.map((r) => `${r.replica_id}:${r.status}:${r.epoch}`).join(" "), (td) =>
      td.replaceChildren(...replicas.map((r) => el("a", {
        className: "chip s-" + r.status,
        href: "/ui/events?replica=" + encodeURIComponent(r.replica_id),
        title: `${r.cluster}, epoch ${r.epoch}: ${r.status}`,
      }, r.replica_id))));
    set(8, String(node.last_heartbeat_at || 0), (td) => {
      td.textContent = node.last_heartbeat_at ? gm.fmtTime(node.last_heartbeat_at) : "–";
      td.title = gm.fmtDateTime(node.last_heartbeat_at);
    });
  }

  function key(id) {
    const node = nodes.get(id);
    const row = rows.get(id);
    switch (sort.key) {
      case "health": return HEALTH_RANK[node.health] ?? 5;
      case "region": return `${node.region || ""} ${node.zone || ""}`;
      case "gpus": return `${(node.gpus || []).length} ${(node.gpus || []).map((g) => g.model).join(",")}`;
      case "vram": return row._stats.vram;
      case "temp": return row._stats.temp;
      case "util": return row._stats.util;
      case "replicas": return (replicasByNode.get(id) || []).length;
      case "heartbeat": return node.last_heartbeat_at || 0;
      default: return id;
    }
  }

  function resort(force) {
    const now = Date.now();
    const live = !["node", "region", "gpus"].includes(sort.key);
    if (!force && !(live && now - lastSort >= RESORT_MS)) return;
    lastSort = now;
    const keys = new Map([...rows.keys()].map((id) => [id, key(id)]));
    const ids = [...rows.keys()].sort((a, b) => {
      const ka = keys.get(a);
      const kb = keys.get(b);
      const order = typeof ka === "number" && typeof kb === "number" ? ka - kb : gm.compare(String(ka), String(kb));
      return sort.dir * (order || gm.compare(a, b));
    });
    const order = document.createDocumentFragment();
    for (const id of ids) order.append(rows.get(id));
    tbody.append(order);
  }

  function summarise() {
    const counts = {};
    let gpus = 0;
    for (const node of nodes.values()) {
      counts[node.health] = (counts[node.health] || 0) + 1;
      gpus += (node.gpus || []).length;
    }
    const summary = document.getElementById("summary");
    summary.replaceChildren(
      el("span", null, `${nodes.size} nodes, ${gpus} GPUs:`),
      ...Object.keys(counts).sort((a, b) => (HEALTH_RANK[a] ?? 5) - (HEALTH_RANK[b] ?? 5))
        .map((h) => gm.badge("h-" + h, `${counts[h]} ${h}`)));
    let shown = 0;
    for (const row of rows.values()) if (!row.hidden) shown += 1;
    document.getElementById("shown").textContent =
      shown === rows.size ? "" : `showing ${shown} of ${rows.size}`;
  }

  // -- wiring ------------------------------------------------------------------------------

  const filter = document.getElementById("filter");
  const initial = new URLSearchParams(location.search).get("q");
  if (initial) filter.value = initial;
  match = gm.matcher(filter.value);
  filter.addEventListener("input", gm.debounce(() => {
    match = gm.matcher(filter.value);
    for (const row of rows.values()) row.hidden = !match(row._search);
    summarise();
  }, 120));
  gm.sortable(table, sort, () => resort(true));

  function start(snapshot) {
    loadSnapshot(snapshot);
    ready = true;
    for (const envelope of waiting.splice(0)) apply(envelope);
    gm.ready();
  }

  const failed = data.error;
  if (failed) gm.banner("the controller did not answer: " + failed);
  else start(data);
  gm.live({
    after: failed ? null : data.head,
    heartbeats: true,
    types: config.types,
    onEvent: apply,
    onOpen: () => {
      if (ready) return;
      gm.getJSON("/ui/data/fleet").then(start, (err) => gm.banner("could not read the fleet: " + err.message));
    },
  });
})();
