// The incidents page: each node loss or health change that moved replicas, as a timeline. The
// gateway draws them (gateway/ui/timeline.py, the same drawing `gpumesh sim run --html` uses);
// this script only follows the event stream and, after a node's health changes or a replica
// fails, is placed, becomes ready or is ejected, asks for the drawing again (once for a burst).
// The first page shows the incidents that began in the last stretch of the log; "older
// incidents" opens the page of those that began before it (?before=POSITION), which is not
// live: what it shows is over, or is drawn on as far as the gateway followed it.
"use strict";

(() => {
  const { config, data } = gm.boot();
  const holder = document.getElementById("incidents");
  const RELEVANT = /^(node\.health_changed|node\.removed|replica\.(failed|placed|ready|suspected))\./;
  const older = data.before !== undefined && data.before !== null;

  function summarize() {
    const all = holder.querySelectorAll("section.incident");
    const ongoing = holder.querySelectorAll("section.incident[data-state=ongoing]").length;
    const parts = [gm.el("span", null, `${all.length} incident${all.length === 1 ? "" : "s"}`)];
    if (ongoing) parts.push(gm.badge("h-offline", `${ongoing} ongoing`));
    document.getElementById("summary").replaceChildren(...parts);
    document.getElementById("none").hidden = all.length > 0;
  }

  // Where this page lies in the log, and the links to the newest and the next older page.
  function paging(page) {
    const what = "each node loss or health change that moved replicas, newest first";
    const since = gm.fmtDateTime(page.from_ns);
    const until = gm.fmtDateTime(page.to_ns);
    document.getElementById("stretch").textContent = older
      ? `${what}: those begun before position ${page.before}` +
        (since ? `, in the log from ${since} to ${until}` : "") + "; not live"
      : what + (since ? `: those begun in the log since ${since}` : "");
    const links = [];
    if (older) links.push(gm.el("a", { id: "newest", href: "/ui/incidents" }, "newest incidents"));
    if (page.older > 0) {
      const href = `/ui/incidents?before=${encodeURIComponent(String(page.older))}`;
      if (links.length) links.push(" · ");
      links.push(gm.el("a", { id: "older", href }, "older incidents"));
    }
    const box = document.getElementById("paging");
    box.replaceChildren(...links);
    box.hidden = links.length === 0;
  }

  // The drawing is the gateway's own markup, every name and reason in it escaped there
  // (html.escape), and the page's CSP runs no inline script: parsed, then adopted whole.
  function show(markup) {
    const opened = new Set([...holder.querySelectorAll("section.incident details[open]")]
      .map((d) => d.closest("section").dataset.id));
    const parsed = new DOMParser().parseFromString(`<div>${markup}</div>`, "text/html");
    const fresh = [...parsed.body.firstElementChild.children].map((n) => document.adoptNode(n));
    for (const section of fresh) {
      const details = section.querySelector("details");
      if (details && opened.has(section.dataset.id)) details.open = true;
    }
    holder.replaceChildren(...fresh);
    summarize();
  }

  const refresh = gm.debounce(async () => {
    try {
      const page = await gm.getJSON("/ui/data/incidents");
      show(page.html);
      paging(page);
    } catch (err) {
      gm.banner("could not read the incidents: " + err.message);
    }
  }, 300);

  if (data.error) gm.banner("the controller did not answer: " + data.error);
  else paging(data);
  summarize();
  if (older) {
    // An older page does not follow the stream: its incidents began before the first page's.
    const badge = document.getElementById("live");
    badge.className = "live";
    badge.textContent = "not live";
    badge.title = "older incidents: this page does not follow the event log";
    gm.ready();
    return;
  }
  let ready = !data.error;
  gm.ready();
  gm.live({
    after: data.error ? null : data.head,
    heartbeats: false,
    types: config.types,
    onEvent: (envelope) => { if (RELEVANT.test(envelope.type)) refresh(); },
    onOpen: () => { if (!ready) { ready = true; refresh(); } },
  });
})();
