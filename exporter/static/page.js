// The live page: polls api/window (only the samples it has not seen: ?since=), draws each GPU
// with uPlot, lists firing alerts, processes and snapshots, and calls the admin API with the
// token the user gives (kept in sessionStorage, sent as a Bearer header, never in a URL).
// Loaded before uPlot so that every error on the page, uPlot's included, is recorded in
// #page-errors (shown to the user, and read back by the browser tests).
"use strict";

(function () {
  const GiB = 2 ** 30;
  const MiB = 2 ** 20;
  const TOKEN_KEY = "gpumem-admin-token";
  const MAX_POLL_BACKOFF_MS = 5000;

  // -- errors ---------------------------------------------------------------------------------

  function recordError(message) {
    const box = document.getElementById("page-errors");
    if (!box) return;
    const count = Number(box.dataset.count || "0") + 1;
    box.dataset.count = String(count);
    box.hidden = false;
    const line = document.createElement("div");
    line.textContent = "Page error: " + message;
    box.appendChild(line);
  }
  window.addEventListener("error", (event) => {
    recordError(`${event.message} (${event.filename || "?"}:${event.lineno || 0})`);
  });
  window.addEventListener("unhandledrejection", (event) => {
    recordError(`unhandled rejection: ${event.reason}`);
  });
  document.addEventListener("securitypolicyviolation", (event) => {
    recordError(`blocked by the page's CSP: ${event.violatedDirective} ${event.blockedURI}`);
  });

  // -- formatting -----------------------------------------------------------------------------

  function fmtBytes(bytes) {
    if (bytes === null || bytes === undefined) return "n/a";
    if (Math.abs(bytes) >= GiB) {
      return (bytes / GiB).toFixed(Math.abs(bytes) >= 100 * GiB ? 1 : 2) + " GiB";
    }
    if (Math.abs(bytes) >= MiB) return (bytes / MiB).toFixed(0) + " MiB";
    if (bytes === 0) return "0 B";
    return (bytes / 1024).toFixed(0) + " KiB";
  }
  function fmtRatio(ratio) {
    return ratio === null || ratio === undefined ? "n/a" : (ratio * 100).toFixed(1) + " %";
  }
  function fmtClock(seconds) {
    const d = new Date(seconds * 1000);
    const pad = (n) => String(n).padStart(2, "0");
    return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  }
  function fmtDateTime(seconds) {
    const d = new Date(seconds * 1000);
    const pad = (n) => String(n).padStart(2, "0");
    return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${fmtClock(seconds)}`;
  }
  function fmtAge(seconds) {
    if (seconds < 90) return seconds.toFixed(1) + " s";
    if (seconds < 5400) return (seconds / 60).toFixed(0) + " min";
    return (seconds / 3600).toFixed(1) + " h";
  }
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (name === "class") node.className = value;
      else if (name === "text") node.textContent = value;
      else node.setAttribute(name, value);
    }
    for (const child of children) {
      if (child !== null && child !== undefined) {
        node.append(child instanceof Node ? child : String(child));
      }
    }
    return node;
  }
  function cssVar(name) {
    return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  }
  function gpuTitle(info) {
    if (info.index !== null && info.index !== undefined) return `GPU ${info.index}`;
    return info.device !== null && info.device !== undefined ? `cuda:${info.device}` : info.key;
  }

  // -- series ---------------------------------------------------------------------------------

  // Bottom of the stack first. Opaque colours: the areas are drawn top of the stack first,
  // each filled down to zero, so that each one covers the part of the next that is not its.
  const ALLOCATOR_STACK = [
    { field: "allocated_bytes", label: "allocated", color: "#3465d0" },
    { field: "cached_free_bytes", label: "cached free", color: "#f2a33a" },
    { field: "non_allocator_bytes", label: "non-allocator", color: "#9a6acb" },
    { field: "other_bytes", label: "other", color: "#a3abb5" },
    { field: "free_bytes", label: "free", color: "#cdebd2", stroke: "#47a05a" },
  ];
  const ALLOCATOR_NOTE =
    "allocated: live tensors · cached free: reserved by PyTorch, not allocated · " +
    "non-allocator: CUDA context, NCCL, other libraries · other: other processes, driver " +
    "reserve · free: NVML · cap: the most PyTorch may reserve (a per-process memory fraction), " +
    "where one is set. Markers: allocation retries (dashed, counted at the bottom), OOMs " +
    "(solid, counted at the top); close ones merge into one, shaded over the time they span.";
  const NODE_STACK = [
    { field: "used_bytes", label: "used", color: "#4f79b7" },
    { field: "free_bytes", label: "free", color: "#cdebd2", stroke: "#47a05a" },
  ];
  const NODE_NOTE = "NVML only: no PyTorch allocator reports for this GPU here.";
  const RATIOS = [
    { field: "fragmentation_ratio", label: "fragmentation", color: "#d43c30" },
    { field: "cached_free_ratio", label: "cached free ratio", color: "#e08a12" },
  ];
  const RATIO_NOTE =
    "fragmentation: inactive split / reserved (n/a with expandable segments or " +
    "cudaMallocAsync) · cached free ratio: (reserved − allocated) / reserved. Worst process.";
  const CAP_COLOR = "#6a3d9a";
  const CAP = { field: "memory_limit_bytes", label: "cap", color: CAP_COLOR };
  const MARKERS = [
    { field: "alloc_retries", kind: "retry", label: "alloc retries", color: "#e07b00" },
    { field: "ooms", kind: "OOM", label: "OOMs", color: "#c1121f" },
  ];

  // -- state ----------------------------------------------------------------------------------

  const store = {
    t: [], // sample timestamps, oldest first
    gpus: new Map(), // key -> {info, cols: {field: [...]}, view}
    capacity: 600,
    interval: 1,
  };

  function lastTimestamp() {
    return store.t.length ? store.t[store.t.length - 1] : null;
  }

  function merge(data) {
    store.capacity = data.capacity;
    store.interval = data.interval_s;
    const before = store.t.length;
    const added = data.timestamps.length;
    store.t.push(...data.timestamps);
    const seen = new Set();
    for (const gpu of data.gpus) {
      seen.add(gpu.key);
      let entry = store.gpus.get(gpu.key);
      if (!entry) {
        entry = { info: gpu, cols: {}, view: null };
        for (const field of Object.keys(gpu.series)) entry.cols[field] = new Array(before).fill(null);
        store.gpus.set(gpu.key, entry);
      }
      entry.info = { key: gpu.key, index: gpu.index, device: gpu.device, name: gpu.name };
      for (const [field, values] of Object.entries(gpu.series)) {
        (entry.cols[field] ||= new Array(before).fill(null)).push(...values);
      }
    }
    for (const [key, entry] of store.gpus) {
      if (seen.has(key)) continue;
      for (const values of Object.values(entry.cols)) values.push(...new Array(added).fill(null));
    }
    const excess = store.t.length - store.capacity;
    if (excess > 0) {
      store.t.splice(0, excess);
      for (const entry of store.gpus.values()) {
        for (const values of Object.values(entry.cols)) values.splice(0, excess);
      }
    }
    for (const [key, entry] of store.gpus) {
      // A GPU that left the window (its process exited, NVML lost it) leaves the page too.
      if (!Object.values(entry.cols).some((values) => values.some((v) => v !== null))) {
        if (entry.view) entry.view.destroy();
        store.gpus.delete(key);
      }
    }
  }

  function hasAllocator(entry) {
    return entry.cols.allocated_bytes.some((v) => v !== null);
  }

  // -- GPU cards --------------------------------------------------------------------------------

  function latestIndex() {
    return store.t.length - 1;
  }

  // The stack as uPlot data, top of the stack first, in GiB; null where the GPU has no reading.
  function stackData(entry, stack) {
    const n = store.t.length;
    const sums = stack.map(() => new Array(n).fill(null));
    for (let i = 0; i < n; i++) {
      let total = 0;
      let any = false;
      stack.forEach((layer, k) => {
        const v = entry.cols[layer.field][i];
        if (v !== null) {
          total += v;
          any = true;
        }
        sums[k][i] = total / GiB;
      });
      if (!any) for (const column of sums) column[i] = null;
    }
    return [store.t, ...sums.reverse()];
  }

  // Where a counter rose: {i: sample index, count: by how much}.
  function markerEvents(entry, field) {
    const values = entry.cols[field];
    const events = [];
    let previous = null;
    for (let i = 0; i < values.length; i++) {
      const v = values[i];
      if (v === null) continue;
      if (previous !== null && v > previous) events.push({ i, count: v - previous });
      previous = v;
    }
    return events;
  }

  function axisColors() {
    return { text: cssVar("--muted") || "#5d6878", grid: cssVar("--line") || "#d9dee5" };
  }

  function axis(colors, extra) {
    return {
      stroke: colors.text,
      grid: { stroke: colors.grid, width: 1 },
      ticks: { stroke: colors.grid, width: 1 },
      ...extra,
    };
  }

  // Ticks on whole seconds: the labels have no fractions of a second.
  const TIME_AXIS = {
    space: 70,
    incrs: [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200],
    values: (u, splits) => splits.map(fmtClock),
  };

  // Tick labels with as many decimals as the step between ticks needs (0.25 GiB, 20 GiB).
  function gibTicks(u, splits) {
    const step = splits.length > 1 ? Math.abs(splits[1] - splits[0]) : 1;
    const decimals = Math.min(3, Math.max(0, -Math.floor(Math.log10(step || 1))));
    return splits.map((v) => v.toFixed(decimals));
  }

  function countDrawn(u) {
    // How many series have a point in view: the browser tests read it back.
    let drawn = 0;
    for (let s = 1; s < u.data.length; s++) {
      if (u.series[s].show !== false && u.data[s].some((v) => v !== null && v !== undefined)) drawn += 1;
    }
    u.root.parentElement.dataset.seriesDrawn = String(drawn);
  }

  // The cap (dashed, where a process has one) and the counter markers. Events closer than a
  // label's width merge into one marker carrying their total, shaded over the time it spans,
  // so that an OOM storm reads as "OOM ×40", not as a solid red bar; labels never overlap
  // each other (OOMs at the top, retries at the bottom) nor leave the plot. What was drawn is
  // left in data-markers for the browser tests.
  function drawMarkers(entry) {
    return (u) => {
      const ctx = u.ctx;
      const { left, top, width, height } = u.bbox;
      const ratio = window.devicePixelRatio || 1;
      const drawn = { labels: [], markers: [] };
      ctx.save();
      drawCap(u, entry, ratio);
      ctx.font = `bold ${Math.round(11 * ratio)}px system-ui, sans-serif`;
      ctx.textAlign = "left"; // uPlot leaves the alignment of its last axis label
      const pad = 3 * ratio;
      const background = cssVar("--card") || "#ffffff";
      for (const marker of MARKERS) {
        const labelY = marker.kind === "OOM" ? top + 2 * pad : top + height - 6 * pad;
        const spacing = ctx.measureText(`${marker.kind} ×9999`).width + 3 * pad;
        const groups = [];
        for (const event of markerEvents(entry, marker.field)) {
          const x = Math.round(u.valToPos(store.t[event.i], "x", true));
          if (x < left || x > left + width) continue;
          const last = groups[groups.length - 1];
          if (last && x - last.x1 < spacing) {
            last.x1 = x;
            last.count += event.count;
          } else {
            groups.push({ x0: x, x1: x, count: event.count });
          }
        }
        let labelEnd = -Infinity;
        for (const group of groups) {
          ctx.strokeStyle = ctx.fillStyle = marker.color;
          if (group.x1 > group.x0) {
            ctx.globalAlpha = 0.18;
            ctx.fillRect(group.x0, top, group.x1 - group.x0, height);
            ctx.globalAlpha = 1;
          }
          ctx.lineWidth = (marker.kind === "OOM" ? 2 : 1.5) * ratio;
          ctx.setLineDash(marker.kind === "OOM" ? [] : [4 * ratio, 3 * ratio]);
          ctx.beginPath();
          ctx.moveTo(group.x1, top);
          ctx.lineTo(group.x1, top + height);
          ctx.stroke();
          drawn.markers.push({ kind: marker.kind, x0: group.x0 / ratio, x1: group.x1 / ratio, count: group.count });
          const text = group.count > 1 ? `${marker.kind} ×${group.count}` : marker.kind;
          const textWidth = ctx.measureText(text).width;
          // Right of the marker; left of it where the plot ends first.
          let x = group.x1 + pad;
          if (x + textWidth + pad > left + width) x = group.x0 - pad - textWidth;
          if (x - pad < left || x - pad < labelEnd) continue; // no room: the legend has the count
          ctx.fillStyle = background;
          ctx.globalAlpha = 0.85;
          ctx.fillRect(x - pad, labelY - 2 * pad, textWidth + 2 * pad, 14 * ratio);
          ctx.globalAlpha = 1;
          ctx.fillStyle = marker.color;
          ctx.textBaseline = "top";
          ctx.fillText(text, x, labelY - pad);
          labelEnd = x + textWidth + pad;
          drawn.labels.push({
            kind: marker.kind, text, x0: (x - pad) / ratio, x1: labelEnd / ratio,
            y0: (labelY - 2 * pad) / ratio, y1: (labelY - 2 * pad + 14 * ratio) / ratio,
            plot: [left / ratio, top / ratio, (left + width) / ratio, (top + height) / ratio],
          });
        }
      }
      ctx.restore();
      u.root.parentElement.dataset.markers = JSON.stringify(drawn);
    };
  }

  function drawCap(u, entry, ratio) {
    const caps = entry.cols.memory_limit_bytes;
    if (!caps || entry.view.mode !== "allocator") return;
    const ctx = u.ctx;
    const { left, top, width, height } = u.bbox;
    ctx.strokeStyle = CAP_COLOR;
    ctx.lineWidth = 2 * ratio;
    ctx.setLineDash([8 * ratio, 4 * ratio]);
    ctx.beginPath();
    let drawing = false;
    for (let i = 0; i < caps.length; i++) {
      if (caps[i] === null) {
        drawing = false;
        continue;
      }
      const x = Math.min(Math.max(u.valToPos(store.t[i], "x", true), left), left + width);
      const y = u.valToPos(caps[i] / GiB, "y", true);
      if (y < top || y > top + height) {
        drawing = false;
        continue;
      }
      if (drawing) ctx.lineTo(x, y);
      else ctx.moveTo(x, y);
      drawing = true;
    }
    ctx.stroke();
    ctx.setLineDash([]);
  }

  function legendRows(container, layers, kind) {
    const rows = new Map();
    for (const layer of layers) {
      const swatch = el("span", { class: "swatch " + kind });
      swatch.style.background = layer.color;
      if (layer.stroke) swatch.style.borderColor = layer.stroke;
      const value = el("span", { class: "value" });
      container.append(el("div", { class: "row" }, swatch, el("span", { text: layer.label }), value));
      rows.set(layer.field, value);
    }
    return rows;
  }

  function createCard(entry) {
    const title = el("h3", {});
    const ids = el("div", { class: "ids" });
    const facts = el("div", { class: "facts" });
    const zoom = el("button", { type: "button", class: "zoom" });
    const memChart = el("div", { class: "chart mem" });
    const memLegend = el("div", { class: "legend" });
    const memNote = el("p", { class: "note" });
    const ratioChart = el("div", { class: "chart ratio" });
    const ratioLegend = el("div", { class: "legend" });
    const ratioNote = el("p", { class: "note", text: RATIO_NOTE });
    const card = el(
      "article",
      { class: "gpu" },
      el("div", { class: "head" }, el("div", {}, title, ids), zoom),
      facts, memChart, memLegend, memNote, ratioChart, ratioLegend, ratioNote,
    );
    card.dataset.key = entry.info.key;
    const view = {
      card, title, ids, facts, zoom, memChart, memLegend, memNote, ratioChart, ratioLegend, ratioNote,
      mem: null, ratio: null, mode: null, cursor: null, wholeGpu: null,
      destroy() {
        if (this.mem) this.mem.destroy();
        if (this.ratio) this.ratio.destroy();
        card.remove();
      },
    };
    zoom.addEventListener("click", () => {
      view.wholeGpu = !view.wholeGpu;
      applyZoom(entry);
    });
    entry.view = view;
    return card;
  }

  // "Whole GPU" shows free memory up to the GPU's total; "in use" leaves free out, so that a
  // few GiB in use on a 141 GiB GPU are not a sliver at the bottom.
  function applyZoom(entry) {
    const view = entry.view;
    if (view.wholeGpu === null) {
      const i = latestIndex();
      const free = valueAt(entry, "free_bytes", i);
      const total = valueAt(entry, "total_bytes", i);
      const inUse = free !== null && total ? (total - free) / total : null;
      // Zoomed in by default only where that shows more: the allocator's layers, using some
      // but less than half of the GPU. NVML alone (used, free) reads best whole.
      view.wholeGpu = !(view.mode === "allocator" && inUse !== null && inUse > 0.02 && inUse < 0.5);
    }
    const freeSeries = view.mem.series.findIndex((s) => s.label === "free");
    if (freeSeries > 0) view.mem.setSeries(freeSeries, { show: view.wholeGpu });
    view.zoom.hidden = freeSeries < 0;
    view.zoom.textContent = view.wholeGpu ? "show memory in use" : "show the whole GPU";
    view.mem.redraw();
  }

  function chartWidth(view) {
    return Math.max(240, Math.floor(view.memChart.clientWidth || view.card.clientWidth - 26));
  }

  function buildCharts(entry) {
    const view = entry.view;
    const mode = hasAllocator(entry) ? "allocator" : "node";
    if (view.mode === mode) return;
    if (view.mem) view.mem.destroy();
    if (view.ratio) view.ratio.destroy();
    view.mem = view.ratio = null;
    view.mode = mode;
    const colors = axisColors();
    const stack = mode === "allocator" ? ALLOCATOR_STACK : NODE_STACK;
    view.stack = stack;
    const topFirst = stack.slice().reverse();
    const setCursor = (u) => {
      view.cursor = u.cursor.idx;
      updateLegend(entry);
    };
    const yRange = (u, min, max) => {
      const cap = capMax(entry);
      const top = view.wholeGpu ? Math.max(yMax(entry), max || 0) : Math.max(max || 0, cap);
      return [0, top > 0 ? top * (view.wholeGpu ? 1 : 1.05) : 1];
    };
    view.mem = new uPlot(
      {
        width: chartWidth(view),
        height: 230,
        legend: { show: false },
        cursor: { drag: { x: false, y: false }, points: { show: false } },
        scales: { x: { time: true }, y: { range: yRange } },
        axes: [
          axis(colors, TIME_AXIS),
          axis(colors, { label: "GiB", labelSize: 18, size: 56, values: gibTicks }),
        ],
        series: [
          {},
          ...topFirst.map((layer) => ({
            label: layer.label,
            stroke: layer.stroke || layer.color,
            fill: layer.color,
            width: 1,
            points: { show: false },
          })),
        ],
        hooks: { draw: [drawMarkers(entry), countDrawn], setCursor: [setCursor] },
      },
      stackData(entry, stack),
      view.memChart,
    );
    view.memLegend.replaceChildren();
    view.memRows = legendRows(view.memLegend, topFirst, "area");
    if (mode === "allocator") {
      if (entry.cols.memory_limit_bytes && entry.cols.memory_limit_bytes.some((v) => v !== null)) {
        for (const [field, value] of legendRows(view.memLegend, [CAP], "cap")) view.memRows.set(field, value);
      }
      for (const [field, value] of legendRows(view.memLegend, MARKERS, "marker")) view.memRows.set(field, value);
    }
    view.when = el("div", { class: "when" });
    view.memLegend.append(view.when);
    view.memNote.textContent = mode === "allocator" ? ALLOCATOR_NOTE : NODE_NOTE;
    view.ratioChart.hidden = view.ratioLegend.hidden = view.ratioNote.hidden = mode !== "allocator";
    applyZoom(entry);
    if (mode === "allocator") {
      view.ratio = new uPlot(
        {
          width: chartWidth(view),
          height: 120,
          legend: { show: false },
          cursor: { drag: { x: false, y: false }, points: { show: false } },
          scales: { x: { time: true }, y: { range: [0, 1] } },
          axes: [
            axis(colors, TIME_AXIS),
            axis(colors, {
              size: 56,
              space: 25,
              values: (u, splits) => splits.map((v) => (v * 100).toFixed(0) + "%"),
            }),
          ],
          series: [
            {},
            ...RATIOS.map((r) => ({ label: r.label, stroke: r.color, width: 2, points: { show: false } })),
          ],
          hooks: { draw: [countDrawn], setCursor: [setCursor] },
        },
        ratioData(entry),
        view.ratioChart,
      );
      view.ratioLegend.replaceChildren();
      view.ratioRows = legendRows(view.ratioLegend, RATIOS, "line");
    }
  }

  function yMax(entry) {
    const totals = entry.cols.total_bytes.filter((v) => v !== null);
    return totals.length ? Math.max(...totals) / GiB : 0;
  }

  // The highest cap in view, in GiB (0 without one): the zoomed chart shows how close it is.
  function capMax(entry) {
    const caps = (entry.cols.memory_limit_bytes || []).filter((v) => v !== null);
    return caps.length ? Math.max(...caps) / GiB : 0;
  }

  function ratioData(entry) {
    return [store.t, ...RATIOS.map((r) => entry.cols[r.field])];
  }

  function valueAt(entry, field, i) {
    const values = entry.cols[field];
    return values && i >= 0 && i < values.length ? values[i] : null;
  }

  function updateLegend(entry) {
    const view = entry.view;
    if (!view || !view.memRows) return;
    const hovering = view.cursor !== null && view.cursor !== undefined;
    const i = hovering ? view.cursor : latestIndex();
    for (const layer of view.stack) view.memRows.get(layer.field).textContent = fmtBytes(valueAt(entry, layer.field, i));
    if (view.mode === "allocator") {
      for (const marker of MARKERS) {
        const total = valueAt(entry, marker.field, latestIndex());
        const inView = markerEvents(entry, marker.field).reduce((sum, e) => sum + e.count, 0);
        view.memRows.get(marker.field).textContent =
          total === null ? "n/a" : `${inView} in view · ${total} in all`;
      }
      const cap = view.memRows.get(CAP.field);
      if (cap) cap.textContent = fmtBytes(valueAt(entry, CAP.field, i));
    }
    if (view.ratioRows) {
      for (const r of RATIOS) view.ratioRows.get(r.field).textContent = fmtRatio(valueAt(entry, r.field, i));
    }
    view.when.textContent = i >= 0 ? (hovering ? "at " : "latest, ") + fmtClock(store.t[i]) : "";
  }

  function fact(label, value, alarm, title) {
    const node = el("span", { class: "fact" + (alarm ? " alarm" : "") }, label + " ", el("b", { text: value }));
    if (title) node.title = title;
    return node;
  }

  function updateHeader(entry) {
    const view = entry.view;
    const info = entry.info;
    view.title.textContent = `${gpuTitle(info)} · ${info.name || "unnamed GPU"}`;
    const idParts = [info.key];
    if (info.device !== null && info.device !== undefined && info.index !== null) idParts.push(`cuda:${info.device}`);
    view.ids.textContent = idParts.join(" · ");
    const i = latestIndex();
    const v = (field) => valueAt(entry, field, i);
    const facts = [];
    if (view.mode === "allocator") {
      const allocated = v("allocated_bytes");
      const reserved = allocated === null ? null : allocated + (v("cached_free_bytes") || 0);
      facts.push(fact("allocated", fmtBytes(allocated)));
      facts.push(fact("reserved", fmtBytes(reserved)));
      const frag = v("fragmentation_ratio");
      facts.push(
        fact(
          "fragmentation",
          fmtRatio(frag),
          frag !== null && frag > 0.3,
          frag === null ? "not defined by this allocator (expandable segments, cudaMallocAsync)" : "",
        ),
      );
      facts.push(fact("cached free", fmtRatio(v("cached_free_ratio"))));
      const counter = (field) => (v(field) === null ? "n/a" : String(v(field)));
      facts.push(fact("retries", counter("alloc_retries"), markerEvents(entry, "alloc_retries").length > 0));
      facts.push(fact("OOMs", counter("ooms"), markerEvents(entry, "ooms").length > 0));
    } else {
      facts.push(fact("used", fmtBytes(v("used_bytes"))));
    }
    const total = v("total_bytes");
    const free = v("free_bytes");
    if (total !== null) {
      facts.push(fact("free", `${fmtBytes(free)} of ${fmtBytes(total)}`, free !== null && free < 0.05 * total));
    }
    view.facts.replaceChildren(...facts);
  }

  function renderGpus() {
    const list = document.getElementById("gpu-list");
    document.getElementById("no-gpus").hidden = store.gpus.size > 0;
    const entries = [...store.gpus.values()].sort((a, b) => order(a.info) - order(b.info));
    for (const entry of entries) {
      if (!entry.view) list.append(createCard(entry));
      buildCharts(entry);
      const view = entry.view;
      view.mem.setData(stackData(entry, view.stack));
      if (view.ratio) view.ratio.setData(ratioData(entry));
      updateHeader(entry);
      updateLegend(entry);
      view.card.dataset.points = String(store.t.length);
    }
  }

  function order(info) {
    if (info.index !== null && info.index !== undefined) return info.index;
    return 1000 + (info.device || 0);
  }

  function resizeCharts() {
    for (const entry of store.gpus.values()) {
      const view = entry.view;
      if (!view || !view.mem) continue;
      const width = chartWidth(view);
      if (view.mem.width !== width) view.mem.setSize({ width, height: view.mem.height });
      if (view.ratio && view.ratio.width !== width) view.ratio.setSize({ width, height: view.ratio.height });
    }
  }

  // -- alerts, processes, status ------------------------------------------------------------------

  function gpuLabel(key) {
    const entry = store.gpus.get(key);
    return entry ? gpuTitle(entry.info) : key;
  }

  function fmtAlertValue(alert) {
    const value = alert.value;
    switch (alert.value_unit) {
      case "ratio":
        return fmtRatio(value);
      case "bytes":
        return fmtBytes(value);
      case "bytes_per_s":
        return fmtBytes(value) + "/s";
      default:
        return String(Math.round(value));
    }
  }

  function fmtAge(seconds) {
    if (seconds < 90) return `${Math.max(0, Math.round(seconds))} s`;
    if (seconds < 5400) return `${Math.round(seconds / 60)} min`;
    return `${(seconds / 3600).toFixed(1)} h`;
  }

  // Critical first, then the longest firing (the server's order); each with its severity,
  // since when it fires, its value and its runbook.
  function renderAlerts(alerts, now) {
    const list = document.getElementById("alert-list");
    document.getElementById("no-alerts").hidden = alerts.length > 0;
    document.getElementById("alert-count").textContent = alerts.length ? `(${alerts.length})` : "";
    list.replaceChildren(
      ...alerts.map((alert) => {
        const labels = { ...alert.labels };
        const where = [];
        if (labels.gpu_uuid && store.gpus.has(labels.gpu_uuid)) {
          where.push(gpuLabel(labels.gpu_uuid));
          delete labels.gpu_uuid;
        }
        const pairs = Object.entries(labels)
          .filter(([, value]) => value !== "")
          .map(([name, value]) => `${name}=${value}`);
        const link = el("a", { href: alert.runbook_url, target: "_blank", rel: "noopener" }, "runbook");
        const since = alert.since
          ? `since ${fmtClock(alert.since)} (${fmtAge(now - alert.since)})`
          : "";
        return el(
          "li",
          { class: alert.severity === "critical" ? "critical" : "warning" },
          el("span", { class: "severity", text: alert.severity }),
          el("span", { class: "name", text: alert.alert }),
          el("span", { class: "value", text: `${alert.value_label} ${fmtAlertValue(alert)}` }),
          el("span", { class: "since", text: since }),
          el("span", { class: "where", text: [...where, pairs.join(" ")].filter(Boolean).join(" · ") }),
          link,
        );
      }),
    );
  }

  function renderProcesses(rows) {
    const section = document.getElementById("processes");
    section.hidden = rows.length === 0;
    const cell = (text, numeric) => el("td", numeric ? { class: "num" } : {}, text);
    document.getElementById("process-rows").replaceChildren(
      ...rows.map((row) =>
        el(
          "tr",
          {},
          cell(String(row.pid)),
          cell(row.role),
          cell(row.rank),
          cell(row.gpus.map(gpuLabel).join(", ")),
          cell(fmtBytes(row.gpu_used_bytes), true),
          cell(fmtBytes(row.allocated_bytes), true),
          cell(fmtBytes(row.reserved_bytes), true),
          cell(fmtBytes(row.host_resident_bytes), true),
          cell(fmtBytes(row.host_resident_peak_bytes), true),
          cell(fmtBytes(row.host_swap_bytes), true),
        ),
      ),
    );
  }

  const MODE_NAMES = { node: "node daemon", demo: "demo", run: "run", embedded: "embedded" };

  function renderStatus(data) {
    const labels = Object.entries(data.labels).map(([k, v]) => `${k}=${v}`);
    document.getElementById("mode").textContent = [MODE_NAMES[data.mode] || data.mode, ...labels].join(" · ");
    const status = document.getElementById("status");
    const age = data.sample_age_s;
    const stale = age !== null && age > data.stale_after_s;
    status.classList.toggle("stale", stale || age === null);
    const down = Object.entries(data.sources_up).filter(([, up]) => !up).map(([name]) => name);
    let text = age === null ? "no sample yet" : `${stale ? "STALE: " : ""}sample ${fmtAge(age)} old`;
    text += ` · every ${data.interval_s} s`;
    if (down.length) text += ` · source down: ${down.join(", ")}`;
    status.textContent = text;
    const host = data.host;
    document.getElementById("host").textContent = host
      ? `host: ${fmtBytes(host.available_bytes)} available of ${fmtBytes(host.total_bytes)}` +
        (host.swap_total_bytes ? ` · swap ${fmtBytes(host.swap_used_bytes)} used` : "")
      : "";
    document.getElementById("replay-note").hidden = !data.replay;
    document.getElementById("version").textContent = `gpumem-exporter ${data.version}`;
    const span = data.capacity * data.interval_s;
    document.getElementById("window-span").textContent =
      `last ${fmtAge(Math.min(span, store.t.length ? lastTimestamp() - store.t[0] + data.interval_s : 0))}` +
      ` (up to ${fmtAge(span)}), one point per ${data.interval_s} s`;
  }

  // -- polling --------------------------------------------------------------------------------

  async function poll() {
    let delay = Math.max(1000, store.interval * 1000);
    let data = null;
    const since = lastTimestamp();
    try {
      const response = await fetch(since === null ? "api/window" : `api/window?since=${since}`, { cache: "no-store" });
      if (!response.ok) throw new Error(`api/window answered HTTP ${response.status}`);
      data = await response.json();
      document.getElementById("connection").hidden = true;
    } catch (error) {
      const banner = document.getElementById("connection");
      banner.textContent = `Cannot reach the exporter (${error.message}); retrying.`;
      banner.hidden = false;
      delay = MAX_POLL_BACKOFF_MS;
    }
    if (data !== null) {
      if (since !== null && data.timestamps.length === 0 && data.sample_age_s !== null && data.now - data.sample_age_s < since - 1) {
        // The exporter restarted with an older clock: start the window afresh.
        for (const entry of store.gpus.values()) if (entry.view) entry.view.destroy();
        store.gpus.clear();
        store.t = [];
        delay = 0;
      } else {
        try {
          merge(data);
          renderGpus();
          renderAlerts(data.alerts, data.now);
          renderProcesses(data.processes);
          renderStatus(data);
        } catch (error) {
          // Shown, and polling goes on: one part failing must not freeze the rest.
          recordError(error && error.stack ? error.stack : String(error));
        }
      }
    }
    setTimeout(poll, delay);
  }

  // -- admin: snapshots and actions -----------------------------------------------------------

  function storedToken() {
    try {
      return sessionStorage.getItem(TOKEN_KEY);
    } catch {
      return null; // storage off: the token is asked for again
    }
  }

  async function adminCall(method, path, body) {
    const headers = {};
    const token = storedToken();
    if (token) headers.Authorization = `Bearer ${token}`;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const response = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      cache: "no-store",
    });
    let data = null;
    try {
      data = await response.json();
    } catch {
      data = null;
    }
    return { status: response.status, data, retryAfter: response.headers.get("Retry-After") };
  }

  function detail(answer) {
    const text = answer.data && answer.data.detail;
    return typeof text === "string" ? text : `HTTP ${answer.status}`;
  }

  function setButtons(enabled) {
    document.getElementById("take-snapshot").disabled = !enabled;
    document.getElementById("empty-cache").disabled = !enabled;
  }

  function adminState(text) {
    document.getElementById("admin-state").textContent = text;
  }

  function showResult(text, failed, link) {
    const box = document.getElementById("action-result");
    box.hidden = false;
    box.classList.toggle("failed", Boolean(failed));
    box.replaceChildren(text);
    if (link) box.append(" ", link);
  }

  async function loadSnapshots() {
    const answer = await adminCall("GET", "snapshots");
    const tokenForm = document.getElementById("token-form");
    document.getElementById("forget-token").hidden = !storedToken();
    if (answer.status === 200) {
      tokenForm.hidden = true;
      setButtons(true);
      adminState(
        answer.data.replay
          ? "Demo: actions answer from the recording and change nothing."
          : "Admin actions are on. Empty cache waits for the GPU work queued in each process.",
      );
      renderSnapshots(answer.data.snapshots);
      return;
    }
    setButtons(false);
    renderSnapshots([]);
    if (answer.status === 401) {
      tokenForm.hidden = false;
      adminState(
        storedToken()
          ? "The exporter refused that token: enter the admin token again."
          : "Snapshots and actions need this exporter's admin token.",
      );
      if (storedToken()) sessionStorage.removeItem(TOKEN_KEY);
    } else {
      tokenForm.hidden = true;
      adminState(answer.status === 403 ? detail(answer) : `Snapshots: ${detail(answer)}`);
    }
  }

  function snapshotPath(id, suffix) {
    return `snapshots/${encodeURIComponent(id)}${suffix}`;
  }

  // A link that works without a token (the demo) and, with one, fetches the page or file with
  // the token and opens it from memory: a plain link cannot send a header.
  function tokenLink(text, path, filename) {
    const link = el("a", { href: path, target: "_blank", rel: "noopener" }, text);
    if (filename) link.setAttribute("download", filename);
    link.addEventListener("click", (event) => {
      if (!storedToken()) return;
      event.preventDefault();
      const opened = filename ? null : window.open("", "_blank");
      fetch(path, { headers: { Authorization: `Bearer ${storedToken()}` }, cache: "no-store" })
        .then((response) => {
          if (!response.ok) throw new Error(`HTTP ${response.status}`);
          return response.blob();
        })
        .then((blob) => {
          const url = URL.createObjectURL(blob);
          if (opened) {
            opened.location = url;
          } else {
            const save = el("a", { href: url, download: filename });
            document.body.append(save);
            save.click();
            save.remove();
          }
          setTimeout(() => URL.revokeObjectURL(url), 60000);
        })
        .catch((error) => {
          if (opened) opened.close();
          showResult(`${text} ${path}: ${error.message}`, true);
        });
    });
    return link;
  }

  function describeProcess(process) {
    if (!process) return "";
    const rank = process.rank ? ` rank ${process.rank}` : "";
    const role = process.role ? ` (${process.role})` : "";
    return `pid ${process.pid}${rank}${role}`;
  }

  function renderSnapshots(snapshots) {
    const table = document.querySelector("table.snapshots");
    table.hidden = snapshots.length === 0;
    document.getElementById("snapshot-rows").replaceChildren(
      ...snapshots.map((s) => {
        const links = el("td", {});
        if (s.status === "ready") {
          links.append(
            tokenLink("view", snapshotPath(s.id, "/view")),
            " · ",
            tokenLink("download", snapshotPath(s.id, ""), s.filename || `${s.id}.pickle`),
          );
        }
        return el(
          "tr",
          {},
          el("td", {}, fmtDateTime(s.created)),
          el("td", {}, s.id),
          el("td", {}, s.trigger),
          el("td", {}, describeProcess(s.meta && s.meta.process)),
          el("td", { class: "num" }, fmtBytes(s.size_bytes)),
          el("td", {}, s.status),
          links,
        );
      }),
    );
  }

  function replayNote(answer) {
    return answer.data && answer.data.replay ? " (demo: answered from the recording, nothing changed)" : "";
  }

  async function takeSnapshot() {
    setButtons(false);
    try {
      const answer = await adminCall("POST", "snapshot", {});
      if (answer.status === 401) return loadSnapshots();
      const processes = (answer.data && answer.data.processes) || [];
      const taken = processes.filter((p) => p.ok && p.result);
      if (taken.length) {
        const first = taken[0].result;
        const where = taken.map((p) => describeProcess(p.process)).join(", ");
        let text = `Snapshot ${first.id} taken in ${where}${replayNote(answer)}.`;
        if (!answer.data.ok) text += ` Failed elsewhere: ${detail(answer)}`;
        const view = first.status === "ready" ? tokenLink("view it", snapshotPath(first.id, "/view")) : null;
        showResult(text, !answer.data.ok, view);
      } else {
        showResult(`Snapshot failed: ${detail(answer)}`, true);
      }
    } finally {
      await loadSnapshots();
    }
  }

  async function emptyCache() {
    const question =
      "Empty the PyTorch cache in every process of this server?\n\n" +
      "Each process waits for its queued GPU work and blocks its allocations meanwhile " +
      "(seconds under load); the freed memory goes back to the driver.";
    if (!window.confirm(question)) return;
    setButtons(false);
    try {
      const answer = await adminCall("POST", "empty-cache", {});
      if (answer.status === 401) return loadSnapshots();
      const processes = (answer.data && answer.data.processes) || [];
      const lines = processes.map((p) =>
        p.ok
          ? `${describeProcess(p.process)}: released ${fmtBytes(p.result.released_bytes)}`
          : `${describeProcess(p.process)}: ${p.error}`,
      );
      if (!processes.length) lines.push(detail(answer));
      if (answer.status === 429 && answer.retryAfter) lines.push(`Try again in ${answer.retryAfter} s.`);
      showResult(`Empty cache${replayNote(answer)}:\n${lines.join("\n")}`, !(answer.data && answer.data.ok));
    } finally {
      await loadSnapshots();
    }
  }

  function start() {
    if (typeof uPlot !== "function") {
      recordError("the chart library (static/uplot/uPlot.iife.min.js) did not load");
      return;
    }
    document.getElementById("take-snapshot").addEventListener("click", () => takeSnapshot());
    document.getElementById("empty-cache").addEventListener("click", () => emptyCache());
    document.getElementById("refresh-snapshots").addEventListener("click", () => loadSnapshots());
    document.getElementById("forget-token").addEventListener("click", () => {
      sessionStorage.removeItem(TOKEN_KEY);
      loadSnapshots();
    });
    document.getElementById("token-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const input = document.getElementById("token-input");
      const token = input.value.trim();
      input.value = "";
      if (token) sessionStorage.setItem(TOKEN_KEY, token);
      loadSnapshots();
    });
    new ResizeObserver(resizeCharts).observe(document.getElementById("gpu-list"));
    poll();
    loadSnapshots();
  }

  document.addEventListener("DOMContentLoaded", start);
})();
