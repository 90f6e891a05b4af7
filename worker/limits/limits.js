// The limits page without reloads: every data-refresh-ms it fetches
// /ui/limits.json and redraws the table, with a chart of each gate's
// admitted (green) and throttled (red) tasks per second. Without
// JavaScript the server's table reloads itself instead.
"use strict";

(function () {
  const body = document.body;
  const refresh = Number(body.dataset.refreshMs) || 1500;

  function text(v) { return v === null || v === undefined ? "-" : String(v); }
  function rate(v) { return v === null || v === undefined ? "-" : v.toFixed(1); }
  function seconds(v) {
    if (v === null || v === undefined) return "-";
    const s = Math.round(v);
    if (s < 60) return s + "s";
    if (s < 3600) return Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s";
    return Math.floor(s / 3600) + "h" + String(Math.floor(s % 3600 / 60)).padStart(2, "0") + "m";
  }
  function level(g) { return g.level === null ? "-" : g.level + " of " + g.capacity; }

  function el(tag, attrs, children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    for (const c of children || []) e.append(c);
    return e;
  }

  const svgNS = "http://www.w3.org/2000/svg";
  function chart(history) {
    const w = 180, h = 36;
    const svg = document.createElementNS(svgNS, "svg");
    svg.setAttribute("width", w);
    svg.setAttribute("height", h);
    svg.setAttribute("role", "img");
    if (history.length < 2) return svg;
    const t0 = history[0].t, span = Math.max(history[history.length - 1].t - t0, 1);
    const top = Math.max(1, ...history.map(p => Math.max(p.admitted, p.throttled)));
    svg.setAttribute("aria-label", "admitted and throttled per second, peak " + top.toFixed(1));
    for (const [field, color] of [["admitted", "#1a7f37"], ["throttled", "#cf222e"]]) {
      const line = document.createElementNS(svgNS, "polyline");
      line.setAttribute("fill", "none");
      line.setAttribute("stroke", color);
      line.setAttribute("stroke-width", "1.5");
      line.setAttribute("points", history.map(p =>
        ((p.t - t0) / span * (w - 2) + 1).toFixed(1) + "," + (h - 1 - p[field] / top * (h - 2)).toFixed(1)).join(" "));
      svg.append(line);
    }
    return svg;
  }

  function keys(list) {
    if (!list || list.length === 0) return ["-"];
    const rows = [el("tr", {}, ["key", "waiting", "throttled (1m)", "can admit"].map(h => el("th", {}, [h])))];
    for (const k of list) {
      rows.push(el("tr", { "data-key": k.key }, [
        el("td", {}, [k.key]), el("td", {}, [text(k.waiting)]), el("td", {}, [String(k.throttled_last_minute)]),
        el("td", {}, [k.can_admit_now ? "yes (" + k.remaining + ")" : "no"])]));
    }
    return [el("table", { class: "keys" }, rows)];
  }

  function row(g) {
    const limit = [g.in_force];
    if (g.in_force !== g.file) limit.push(el("br"), el("small", {}, ["file: " + g.file]));
    if (g.override) limit.push(el("br"), el("small", {}, [g.override]));
    return el("tr", { "data-gate": g.gate }, [
      el("td", { "data-field": "gate" }, [g.gate]),
      el("td", { "data-field": "limit" }, limit),
      el("td", { "data-field": "level" }, [level(g)]),
      el("td", { "data-field": "pending" }, [text(g.pending)]),
      el("td", { "data-field": "waiting" }, [text(g.waiting) + (g.waiting_at_least ? "+" : "")]),
      el("td", { "data-field": "done" }, [rate(g.done_per_second)]),
      el("td", { "data-field": "through" }, [(g.through_at_least ? "\u2265 " : "") + seconds(g.through_seconds)]),
      el("td", { "data-field": "admitted" }, [rate(g.admitted_per_second)]),
      el("td", { "data-field": "throttled" }, [rate(g.throttled_per_second)]),
      el("td", { class: "chart" }, [chart(g.history)]),
      el("td", { "data-field": "keys" }, keys(g.keys)),
    ]);
  }

  function draw(v) {
    const tbody = document.querySelector("#gates > tbody");
    const rows = (v.gates || []).map(row);
    if (rows.length === 0) rows.push(el("tr", {}, [el("td", { colspan: "11" }, ["No gates: the config has no drains, quotas, fair queues or concurrency limits."])]));
    tbody.replaceChildren(...rows);
    document.getElementById("time").textContent = v.time.slice(11, 19) + " UTC";
    const err = document.getElementById("error");
    err.textContent = v.error || "";
    err.hidden = !v.error;
    body.dataset.time = v.time;
    body.dataset.rateWindow = v.rate_window_seconds;
    document.getElementById("window").textContent = v.rate_window_seconds
      ? "over the last " + v.rate_window_seconds.toFixed(1) + " s" : "from two looks 5 s apart";
    body.dataset.drawnBy = "script";
  }

  async function tick() {
    try {
      const r = await fetch("/ui/limits.json", { cache: "no-store", credentials: "same-origin" });
      if (!r.ok) throw new Error("HTTP " + r.status);
      draw(await r.json());
    } catch (e) {
      const err = document.getElementById("error");
      err.textContent = "cannot refresh: " + e.message;
      err.hidden = false;
    }
    setTimeout(tick, refresh);
  }
  tick();
})();
