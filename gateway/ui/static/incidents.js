// The incidents page: each node loss or health change that moved replicas, as a timeline. The
// gateway draws them (gateway/ui/timeline.py, the same drawing `gpumesh sim run --html` uses);
// this script only follows the event stream and, after a node's health changes or a replica
// fails, is placed, becomes ready or is ejected, asks for the drawing again (once for a burst).
"use strict";

(() => {
  const { config, data } = gm.boot();
  const holder = document.getElementById("incidents");
  const RELEVANT = /^(node\.health_changed|node\.removed|replica\.(failed|placed|ready|suspected))\./;

  function summarize() {
    const all = holder.querySelectorAll("section.incident");
    const ongoing = holder.querySelectorAll("section.incident[data-state=ongoing]").length;
    const parts = [gm.el("span", null, `${all.length} incident${all.length === 1 ? "" : "s"}`)];
    if (ongoing) parts.push(gm.badge("h-offline", `${ongoing} ongoing`));
    document.getElementById("summary").replaceChildren(...parts);
    document.getElementById("none").hidden = all.length > 0;
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
      show((await gm.getJSON("/ui/data/incidents")).html);
    } catch (err) {
      gm.banner("could not read the incidents: " + err.message);
    }
  }, 300);

  let ready = !data.error;
  if (data.error) gm.banner("the controller did not answer: " + data.error);
  summarize();
  gm.ready();
  gm.live({
    after: data.error ? null : data.head,
    heartbeats: false,
    types: config.types,
    onEvent: (envelope) => { if (RELEVANT.test(envelope.type)) refresh(); },
    onOpen: () => { if (!ready) { ready = true; refresh(); } },
  });
})();
