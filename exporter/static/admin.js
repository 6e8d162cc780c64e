// The admin API from the page: snapshots and empty_cache, with the token the user gives
// (kept in sessionStorage, sent as a Bearer header, never in a URL).
import { el, fmtBytes, fmtDateTime, labelCells } from "./format.js";
export const TOKEN_KEY = "gpumem-admin-token";

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

export async function loadSnapshots() {
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

export function snapshotPath(id, suffix) {
  return `snapshots/${encodeURIComponent(id)}${suffix}`;
}

// A link that works without a token (the demo) and, with one, fetches the page or file with
// the token and opens it from memory: a plain link cannot send a header.
export function tokenLink(text, path, filename) {
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
  labelCells(document.getElementById("snapshot-rows"));
}

function replayNote(answer) {
  return answer.data && answer.data.replay ? " (demo: answered from the recording, nothing changed)" : "";
}

export async function takeSnapshot() {
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

export async function emptyCache() {
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
        ? p.result.would_release_bytes !== undefined
          ? `${describeProcess(p.process)}: would release ${fmtBytes(p.result.would_release_bytes)} (${p.result.recorded})`
          : `${describeProcess(p.process)}: released ${fmtBytes(p.result.released_bytes)}`
        : `${describeProcess(p.process)}: ${p.error}`,
    );
    if (!processes.length) lines.push(detail(answer));
    if (answer.status === 429 && answer.retryAfter) lines.push(`Try again in ${answer.retryAfter} s.`);
    showResult(`Empty cache${replayNote(answer)}:\n${lines.join("\n")}`, !(answer.data && answer.data.ok));
  } finally {
    await loadSnapshots();
  }
}
