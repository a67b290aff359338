// gpumesh dashboard: what every page shares. No framework, no build step: the gateway serves
// this file as it is (gateway/ui/static). Everything is drawn with textContent, never
// innerHTML, so no name or reason from the fleet can become markup.
"use strict";

const gm = (() => {
  const collator = new Intl.Collator(undefined, { numeric: true, sensitivity: "base" });

  function boot() {
    const holder = document.getElementById("gm-data");
    return JSON.parse(holder.textContent);
  }

  // el("td", {className: "num", title: "..."}, child, "text", ...)
  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    if (props) {
      for (const [name, value] of Object.entries(props)) {
        if (value === undefined || value === null) continue;
        if (name === "dataset") Object.assign(node.dataset, value);
        else if (name in node) node[name] = value;
        else node.setAttribute(name, value);
      }
    }
    for (const child of children) {
      if (child === undefined || child === null || child === false) continue;
      node.append(child instanceof Node ? child : String(child));
    }
    return node;
  }

  function banner(text) {
    const box = document.getElementById("banner");
    if (!box) return;
    box.textContent = text || "";
    box.hidden = !text;
  }

  function setLive(state, title) {
    const badge = document.getElementById("live");
    if (!badge) return;
    badge.className = "live " + state;
    badge.textContent = { on: "live", connecting: "connecting", off: "disconnected" }[state];
    if (title) badge.title = title;
  }

  const pad = (n) => String(n).padStart(2, "0");
  function fmtTime(ns) {
    if (!ns) return "";
    const d = new Date(ns / 1e6);
    return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  }
  function fmtDateTime(ns) {
    if (!ns) return "";
    const d = new Date(ns / 1e6);
    const ms = String(d.getMilliseconds()).padStart(3, "0");
    return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ` +
      `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}.${ms}`;
  }
  const gib = (mib) => (mib / 1024).toFixed(1);

  function debounce(fn, ms) {
    let timer = null;
    return (...args) => {
      if (timer !== null) clearTimeout(timer);
      timer = setTimeout(() => { timer = null; fn(...args); }, ms);
    };
  }

  // Every EventSource of the page, through stream(url). A page left keeps its streams open
  // unless told (Chromium held a left page's stream for up to a minute, and with six of them
  // every connection it allows one host: a new tab's style sheet waited 60 s): pagehide closes
  // them all. A page the browser brings back from its cache (pageshow, persisted) is stale and
  // has no stream: load it again.
  const sources = new Set();
  function stream(url) {
    for (const old of sources) if (old.readyState === EventSource.CLOSED) sources.delete(old);
    const source = new EventSource(url);
    sources.add(source);
    return source;
  }
  function closeStreams() {
    for (const source of sources) source.close();
    sources.clear();
  }
  addEventListener("pagehide", closeStreams);
  addEventListener("pageshow", (event) => { if (event.persisted) location.reload(); });

  // The page's live feed: /ui/api/events/stream from `after`, every event type the gateway
  // knows. The browser reconnects by itself (with Last-Event-ID: the stream resumes with no
  // gap); only a refused or failed start (401, 503) closes the EventSource for good, and then
  // we open a new one once, a few seconds later, from the last position seen.
  function live({ after, heartbeats, types, onEvent, onOpen }) {
    let last = after;
    let source = null;
    let retry = null;

    function open() {
      retry = null;
      const query = new URLSearchParams();
      if (last !== null && last !== undefined) query.set("after", String(last));
      if (heartbeats) query.set("heartbeats", "1");
      source = stream("/ui/api/events/stream?" + query.toString());
      setLive("connecting");
      source.onopen = () => {
        setLive("on", "following the event log");
        banner(null);
        if (onOpen) onOpen();
      };
      const deliver = (message) => {
        const position = Number(message.lastEventId);
        if (position && last !== null && position <= last) return;
        last = position || last;
        let envelope;
        try {
          envelope = JSON.parse(message.data);
        } catch (err) {
          console.warn("gpumesh: unreadable event", position, err);
          return;
        }
        onEvent(envelope);
      };
      for (const type of types) source.addEventListener(type, deliver);
      source.addEventListener("error", (message) => {
        if (message.data) {
          // The gateway said why the stream ends; the browser resumes it by itself.
          try {
            banner("event stream: " + JSON.parse(message.data).error.message);
          } catch (err) {
            banner("event stream: " + message.data);
          }
          return;
        }
        if (source.readyState === EventSource.CLOSED) closed();
        else setLive("connecting", "reconnecting to the event stream");
      });
    }

    async function closed() {
      setLive("off", "the event stream was refused; trying again");
      let status = 0;
      try {
        status = (await fetch("/ui/api/events?limit=1", { credentials: "same-origin" })).status;
      } catch (err) {
        status = 0;
      }
      if (status === 401) {
        location.assign("/ui/login?next=" + encodeURIComponent(location.pathname + location.search));
        return;
      }
      banner(status === 503 || status === 504
        ? "the controller does not answer: live updates resume when it is back"
        : "the gateway does not answer: live updates resume when it is back");
      if (retry === null) retry = setTimeout(open, 5000);
    }

    open();
    return { position: () => last, close: () => source && source.close() };
  }

  async function getJSON(url) {
    const response = await fetch(url, { credentials: "same-origin" });
    if (response.status === 401) {
      location.assign("/ui/login?next=" + encodeURIComponent(location.pathname + location.search));
      throw new Error("signed out");
    }
    const body = await response.json();
    if (!response.ok) throw new Error((body.error && body.error.message) || response.statusText);
    return body;
  }

  // Column sorting: click a th[data-key]; again to reverse. `state` holds {key, dir}.
  function sortable(table, state, onChange) {
    const heads = table.querySelectorAll("th[data-key]");
    const mark = () => {
      for (const th of heads) {
        if (th.dataset.key === state.key) {
          th.setAttribute("aria-sort", state.dir > 0 ? "ascending" : "descending");
        } else {
          th.removeAttribute("aria-sort");
        }
      }
    };
    for (const th of heads) {
      th.tabIndex = 0;
      const choose = () => {
        if (state.key === th.dataset.key) state.dir = -state.dir;
        else { state.key = th.dataset.key; state.dir = 1; }
        mark();
        onChange();
      };
      th.addEventListener("click", choose);
      th.addEventListener("keydown", (e) => { if (e.key === "Enter") choose(); });
    }
    mark();
  }

  // Each filter term must be found in the text (case-insensitive); none: everything matches.
  function matcher(text) {
    const terms = text.toLowerCase().split(/\s+/).filter(Boolean);
    return (haystack) => terms.every((term) => haystack.includes(term));
  }

  // The page has drawn its first data: for the tests (data-ready) and for timing (the marks;
  // bench/dashboard.py reads them).
  function ready() {
    if (document.body.dataset.ready === "1") return;
    document.body.dataset.ready = "1";
    performance.mark("gm-ready");
    requestAnimationFrame(() => setTimeout(() => performance.mark("gm-painted"), 0));
  }

  function badge(kind, text, title) {
    return el("span", { className: `badge ${kind}`, title: title || undefined }, text);
  }

  return {
    boot, el, banner, setLive, fmtTime, fmtDateTime, gib, debounce, live, stream, getJSON,
    sortable, matcher, badge, ready, compare: collator.compare,
  };
})();
