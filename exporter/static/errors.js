// Every error on the page, uPlot's included, is recorded in #page-errors: shown to the user,
// and read back by the browser tests. Imported first by page.js, so it listens before
// anything else runs.
// -- errors ---------------------------------------------------------------------------------

export function recordError(message) {
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
