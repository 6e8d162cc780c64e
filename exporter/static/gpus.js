// One card per GPU: the window of samples kept in `store`, drawn with uPlot (memory stacked,
// ratios, the cap, retry and OOM markers), with a header of the latest facts.
// -- series ---------------------------------------------------------------------------------
import { GiB, cssVar, el, fmtBytes, fmtClock, fmtRatio, gpuTitle } from "./format.js";
import { hasAllocator, store } from "./state.js";

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
// The memory ledger's own parts; the server's named components take the palette in turn.
const LEDGER_COLORS = {
  private_pools: "#2a9d8f",
  other_live: "#3465d0",
  cached_free: "#f2a33a",
  outside_allocator: "#9a6acb",
  other_named: "#7d8590",
};
const COMPONENT_COLORS = ["#1d3557", "#e76f51", "#588157", "#b5838d", "#6d597a", "#bc6c25"];
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
// label's width and less than BURST_GAP_S apart (one burst, as the OOM banner counts them;
// further apart they stay two markers, however close in pixels) merge into one marker
// carrying their total, its span shaded in a strip along
// the plot's edge (OOMs at the top, retries at the bottom), not over the series: shading over
// them turned the allocated blue into the non-allocator purple. So an OOM storm reads as
// "OOM ×40", not as a solid red bar; labels never overlap each other nor leave the plot.
// What was drawn is left in data-markers for the browser tests.
const BURST_GAP_S = 30;

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
        const at = store.t[event.i];
        if (last && x - last.x1 < spacing && at - last.t1 <= BURST_GAP_S) {
          last.x1 = x;
          last.t1 = at;
          last.count += event.count;
        } else {
          groups.push({ x0: x, x1: x, t1: at, count: event.count });
        }
      }
      let labelEnd = -Infinity;
      for (const group of groups) {
        ctx.strokeStyle = ctx.fillStyle = marker.color;
        let band = null;
        if (group.x1 > group.x0) {
          const strip = 4 * pad;
          const y = marker.kind === "OOM" ? top : top + height - strip;
          ctx.globalAlpha = 0.35;
          ctx.fillRect(group.x0, y, group.x1 - group.x0, strip);
          ctx.globalAlpha = 1;
          band = [y / ratio, (y + strip) / ratio];
        }
        ctx.lineWidth = (marker.kind === "OOM" ? 2 : 1.5) * ratio;
        ctx.setLineDash(marker.kind === "OOM" ? [] : [4 * ratio, 3 * ratio]);
        ctx.beginPath();
        ctx.moveTo(group.x1, top);
        ctx.lineTo(group.x1, top + height);
        ctx.stroke();
        drawn.markers.push({ kind: marker.kind, x0: group.x0 / ratio, x1: group.x1 / ratio, count: group.count, band });
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
  const ledgerBar = el("div", { class: "ledger-bar", role: "img" });
  const ledgerText = el("div", { class: "ledger-text" });
  const ledger = el("div", { class: "ledger" }, ledgerBar, ledgerText);
  ledger.hidden = true;
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
    facts, ledger, memChart, memLegend, memNote, ratioChart, ratioLegend, ratioNote,
  );
  card.dataset.key = entry.info.key;
  const view = {
    card, title, ids, facts, ledger, ledgerBar, ledgerText, zoom,
    memChart, memLegend, memNote, ratioChart, ratioLegend, ratioNote,
    mem: null, ratio: null, mode: null, cursor: null, wholeGpu: null, wholeShown: true,
    destroy() {
      if (this.mem) this.mem.destroy();
      if (this.ratio) this.ratio.destroy();
      card.remove();
    },
  };
  zoom.addEventListener("click", () => {
    view.wholeGpu = !view.wholeShown;
    applyZoom(entry);
  });
  entry.view = view;
  return card;
}

// "Whole GPU" shows free memory up to the GPU's total; "in use" leaves free out, so that a
// few GiB in use on a 141 GiB GPU are not a sliver at the bottom.
function applyZoom(entry) {
  const view = entry.view;
  let whole = view.wholeGpu;
  if (whole === null) {
    const inUse = peakInUse(entry);
    // Zoomed in by default only where that shows more: the allocator's layers, using some
    // but less than half of the GPU at their peak in view. NVML alone (used, free) reads
    // best whole. The peak, not the latest sample: a page opened as the server restarts
    // (its GPU nearly empty for a moment) once fixed the whole GPU for a 22 GiB process.
    whole = !(view.mode === "allocator" && inUse !== null && inUse > 0.02 && inUse < 0.5);
    // Decided for good once the GPU's numbers are in: a first sample without NVML's (not
    // read yet, a busy server) once fixed the whole GPU for as long as the page was open.
    if (inUse !== null || view.mode !== "allocator") view.wholeGpu = whole;
  }
  view.wholeShown = whole;
  const freeSeries = view.mem.series.findIndex((s) => s.label === "free");
  if (freeSeries > 0) view.mem.setSeries(freeSeries, { show: whole });
  view.zoom.hidden = freeSeries < 0;
  view.zoom.textContent = whole ? "show memory in use" : "show the whole GPU";
  view.mem.redraw();
}

// The highest share of the GPU in use over the samples in view; null without NVML's numbers.
function peakInUse(entry) {
  let peak = null;
  for (let i = 0; i < store.t.length; i++) {
    const free = valueAt(entry, "free_bytes", i);
    const total = valueAt(entry, "total_bytes", i);
    if (free !== null && free !== undefined && total) peak = Math.max(peak ?? 0, (total - free) / total);
  }
  return peak;
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
    const top = view.wholeShown ? Math.max(yMax(entry), max || 0) : Math.max(max || 0, cap);
    return [0, top > 0 ? top * (view.wholeShown ? 1 : 1.05) : 1];
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

// Where this GPU's memory goes now (the latest sample's ledger, docs/metrics.md): one bar,
// a segment per part as wide as its share, the parts named below it with their bytes.
function updateLedger(entry) {
  const view = entry.view;
  const parts = (store.ledgers[entry.info.key] || []).filter(([, bytes]) => bytes > 0);
  const total = parts.reduce((sum, [, bytes]) => sum + bytes, 0);
  view.ledger.hidden = total <= 0;
  if (total <= 0) return;
  let named = 0;
  const colour = (part) => LEDGER_COLORS[part] || COMPONENT_COLORS[named++ % COMPONENT_COLORS.length];
  const segments = [];
  const words = [];
  for (const [part, bytes] of parts) {
    const fill = colour(part);
    const segment = el("span", { class: "segment", title: `${part} ${fmtBytes(bytes)}` });
    segment.style.width = `${(100 * bytes) / total}%`;
    segment.style.background = fill;
    segment.dataset.part = part;
    segments.push(segment);
    const swatch = el("i", { class: "swatch" });
    swatch.style.background = fill;
    words.push(el("span", { class: "part" }, swatch, `${part} `, el("b", { text: fmtBytes(bytes) })));
  }
  view.ledgerBar.replaceChildren(...segments);
  view.ledgerBar.setAttribute("aria-label", `memory ledger: ${fmtBytes(total)}`);
  view.ledgerText.replaceChildren(el("span", { class: "part" }, "ledger ", el("b", { text: fmtBytes(total) }), " ="), ...words);
}

export function renderGpus() {
  const list = document.getElementById("gpu-list");
  const none = document.getElementById("no-gpus");
  none.hidden = store.gpus.size > 0;
  const reasons = Object.entries(store.why).map(([source, why]) => `${source}: ${why}`);
  // The reason the log gives, on the page too (textContent: never markup).
  none.textContent = reasons.length ? `No GPU reading yet (${reasons.join("; ")}).` : "No GPU reading yet.";
  const entries = [...store.gpus.values()].sort((a, b) => order(a.info) - order(b.info));
  for (const entry of entries) {
    if (!entry.view) list.append(createCard(entry));
    buildCharts(entry);
    const view = entry.view;
    view.mem.setData(stackData(entry, view.stack));
    // Not decided while no sample had NVML's numbers: decided on the first render that has.
    if (view.wholeGpu === null && peakInUse(entry) !== null) applyZoom(entry);
    if (view.ratio) view.ratio.setData(ratioData(entry));
    updateHeader(entry);
    updateLedger(entry);
    updateLegend(entry);
    view.card.dataset.points = String(store.t.length);
  }
}

function order(info) {
  if (info.index !== null && info.index !== undefined) return info.index;
  return 1000 + (info.device || 0);
}

export function resizeCharts() {
  for (const entry of store.gpus.values()) {
    const view = entry.view;
    if (!view || !view.mem) continue;
    const width = chartWidth(view);
    if (view.mem.width !== width) view.mem.setSize({ width, height: view.mem.height });
    if (view.ratio && view.ratio.width !== width) view.ratio.setSize({ width, height: view.ratio.height });
  }
}
