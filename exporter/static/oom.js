// The banner at the top of the page: each process's latest out-of-memory error with its
// verdict (exporter/oom_verdict.py), the numbers that decided it, what to do, and links to the
// snapshot taken at it and to the runbook's decision table. It stays until the process exits.
import { snapshotPath, tokenLink } from "./admin.js";
import { el, fmtBytes, fmtClock } from "./format.js";

const VERDICT_TITLE = {
  fragmentation: "fragmentation: the cache had the bytes, in pieces",
  pools: "private pools hold free memory the default pool cannot use",
  cap: "the process's memory cap: the GPU had room",
  other_processes: "other processes hold the GPU",
  outside_allocator: "this process's memory outside PyTorch's allocator fills the GPU",
  exhaustion: "live tensors fill the GPU",
  unknown: "unknown: a reading was missing",
};

// The deciding readings, in the order an on-call compares them.
const NUMBERS = [
  ["requested_bytes", "asked"],
  ["free_in_holes_bytes", "free in the cache"],
  ["largest_free_block_bytes", "largest free block"],
  ["cap_room_bytes", "room under the cap"],
  ["device_free_bytes", "GPU free"],
  ["other_processes_bytes", "other processes"],
  ["private_pools_free_bytes", "free in private pools"],
  ["outside_allocator_bytes", "outside the allocator"],
];

function where(row) {
  const rank = row.rank ? ` rank ${row.rank}` : "";
  const role = row.role ? ` (${row.role})` : "";
  return `pid ${row.pid ?? "?"}${rank}${role} · cuda:${row.device}`;
}

function counts(row) {
  const parts = Object.entries(row.ooms_by_verdict || {}).map(([v, n]) => `${v} ${n}`);
  const total = row.ooms ?? parts.length;
  return `${total} OOM${total === 1 ? "" : "s"}` + (parts.length ? ` (${parts.join(", ")})` : "");
}

// An OOM the allocator counted whose verdict is not in yet: said from the moment the count
// moves, so that the banner never explains an earlier OOM as if it were this one.
function pendingEntry(row, now) {
  const ago = Math.max(0, Math.round(now - row.since));
  const more = row.count > 1 ? ` · ${row.count} OOMs awaiting their verdict` : "";
  return el(
    "li",
    { class: "oom pending", "data-verdict": "pending" },
    el(
      "div",
      { class: "head" },
      el("span", { class: "label", text: "Out of memory" }),
      el("span", { class: "verdict", text: "verdict pending" }),
      el("span", { class: "where", text: `${where(row)} · ${fmtClock(row.since)} (${ago} s ago)${more}` }),
    ),
    el("div", { class: "reason", text: "The OOM observer is taking its readings at the OOM (seconds when memory history is recorded); the verdict, its numbers and the snapshot follow here." }),
  );
}

function entry(row, now) {
  if (row.pending) return pendingEntry(row, now);
  const v = row.verdict;
  const numbers = NUMBERS.filter(([key]) => v[key] !== null && v[key] !== undefined).map(
    ([key, label]) => el("span", { class: "number", "data-reading": key }, `${label} `, el("b", { text: fmtBytes(v[key]) })),
  );
  const links = [el("a", { href: row.runbook_url, target: "_blank", rel: "noopener" }, "runbook")];
  if (v.snapshot) links.unshift(tokenLink("snapshot at the OOM", snapshotPath(v.snapshot, "/view")));
  const ago = Math.max(0, Math.round(now - v.timestamp));
  return el(
    "li",
    { class: `oom ${v.verdict}`, "data-verdict": v.verdict },
    el(
      "div",
      { class: "head" },
      el("span", { class: "label", text: "Out of memory" }),
      el("span", { class: "verdict", text: VERDICT_TITLE[v.verdict] || v.verdict }),
      el("span", { class: "where", text: `${where(row)} · ${fmtClock(v.timestamp)} (${ago} s ago) · ${counts(row)}` }),
    ),
    // In a storm: this is the burst's most complete record (numbers, snapshot); the later ones
    // lack some of it.
    v.followed ? el("div", { class: "followed", text: `The burst's most complete record: ${v.followed} more OOM${v.followed === 1 ? "" : "s"} followed it.` }) : null,
    el("div", { class: "numbers" }, ...numbers),
    el("div", { class: "reason", text: v.reason }),
    el("div", { class: "action" }, el("b", { text: "Do: " }), v.action),
    v.missing ? el("div", { class: "missing", text: `Not read: ${v.missing}` }) : null,
    el("div", { class: "links" }, ...links.flatMap((link, i) => (i ? [" · ", link] : [link]))),
  );
}

export function renderOoms(rows, now) {
  const banner = document.getElementById("oom-banner");
  banner.hidden = rows.length === 0;
  document.getElementById("oom-list").replaceChildren(...rows.map((row) => entry(row, now)));
}
