// Firing alerts, the process table and the status line.
// -- alerts, processes, status ------------------------------------------------------------------
import { el, fmtBytes, fmtClock, fmtRatio, gpuTitle, labelCells } from "./format.js";
import { lastTimestamp, store } from "./state.js";

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
export function renderAlerts(alerts, now) {
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
        alert.note ? el("span", { class: "note", text: alert.note }) : null,
      );
    }),
  );
}

export function renderProcesses(rows) {
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
  labelCells(document.getElementById("process-rows"));
}

const MODE_NAMES = { node: "node daemon", demo: "demo", run: "run", embedded: "embedded" };

export function renderStatus(data) {
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
