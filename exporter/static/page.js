// The live page: polls api/window (only the samples it has not seen: ?since=), draws each GPU
// with uPlot, lists firing alerts, processes and snapshots, and calls the admin API with the
// token the user gives. An ES module, loaded before uPlot (which is not a module): errors.js is
// imported first so that every error on the page, uPlot's included, is recorded.
import { recordError } from "./errors.js";
import { TOKEN_KEY, emptyCache, loadSnapshots, takeSnapshot } from "./admin.js";
import { renderGpus, resizeCharts } from "./gpus.js";
import { renderOoms } from "./oom.js";
import { lastTimestamp, merge, store } from "./state.js";
import { renderAlerts, renderProcesses, renderStatus } from "./status.js";

const MAX_POLL_BACKOFF_MS = 5000;

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
        renderOoms(data.ooms || [], data.now);
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
