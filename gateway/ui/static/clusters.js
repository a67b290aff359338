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
    const section = el("section", { className: "cluster", dataset: { name: c.name } }, head, table, spec);
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
