// Numbers and elements as the page shows them.
export const GiB = 2 ** 30;
const MiB = 2 ** 20;

// -- formatting -----------------------------------------------------------------------------

export function fmtBytes(bytes) {
  if (bytes === null || bytes === undefined) return "n/a";
  if (Math.abs(bytes) >= GiB) {
    return (bytes / GiB).toFixed(Math.abs(bytes) >= 100 * GiB ? 1 : 2) + " GiB";
  }
  if (Math.abs(bytes) >= MiB) return (bytes / MiB).toFixed(0) + " MiB";
  if (bytes === 0) return "0 B";
  return (bytes / 1024).toFixed(0) + " KiB";
}
export function fmtRatio(ratio) {
  return ratio === null || ratio === undefined ? "n/a" : (ratio * 100).toFixed(1) + " %";
}
export function fmtClock(seconds) {
  const d = new Date(seconds * 1000);
  const pad = (n) => String(n).padStart(2, "0");
  return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}
export function fmtDateTime(seconds) {
  const d = new Date(seconds * 1000);
  const pad = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${fmtClock(seconds)}`;
}
export function el(tag, attrs, ...children) {
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
// Each cell of a table body named by its column's heading (data-label): on a narrow screen a
// row is shown as a card of "heading value" lines (page.css), whose headings are these.
export function labelCells(tbody) {
  const headings = [...tbody.closest("table").tHead.rows[0].cells].map((th) => th.textContent);
  for (const row of tbody.rows) {
    [...row.cells].forEach((cell, i) => { cell.dataset.label = headings[i] || ""; });
  }
}
export function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}
export function gpuTitle(info) {
  if (info.index !== null && info.index !== undefined) return `GPU ${info.index}`;
  return info.device !== null && info.device !== undefined ? `cuda:${info.device}` : info.key;
}
