// Drives the live page in headless Chromium over the DevTools protocol, for tests/test_page.py:
// loads it at each width, waits for the charts, takes full-page screenshots, clicks the admin
// buttons (entering the token first when given) and reports what happened as JSON on stdout,
// with every console error, exception, CSP violation and failed load the browser saw.
//
// Usage: node live_page_driver.mjs '{"chromium": ..., "url": ...}'
import { spawn } from "node:child_process";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { createRequire } from "node:module";

// A WebSocket client that works on every Node the CI may install (Debian's Node 18 has no
// global WebSocket): the `ws` package from tests/js (npm ci installs it).
const WebSocket = createRequire(new URL("./js/package.json", import.meta.url))("ws");

const options = JSON.parse(process.argv[2]);
const timeoutMs = options.timeout_ms ?? 60000;
const started = Date.now();

function deadline(what) {
  if (Date.now() - started > timeoutMs) throw new Error(`timed out: ${what}`);
}
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

const browser = spawn(
  options.chromium,
  [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
    "--remote-debugging-port=0",
    `--user-data-dir=${options.profile}`,
    "about:blank",
  ],
  { stdio: ["ignore", "ignore", "pipe"] },
);
const result = { errors: [], dialogs: [], screenshots: [], widths: {}, actions: {} };

try {
  const port = await new Promise((resolve, reject) => {
    let text = "";
    browser.stderr.on("data", (chunk) => {
      text += chunk;
      const match = text.match(/DevTools listening on ws:\/\/[^:]+:(\d+)\//);
      if (match) resolve(match[1]);
    });
    browser.on("exit", (code) => reject(new Error(`chromium exited (${code}): ${text}`)));
  });
  const targets = await (await fetch(`http://127.0.0.1:${port}/json/list`)).json();
  const page = targets.find((t) => t.type === "page");
  const socket = new WebSocket(page.webSocketDebuggerUrl);
  await new Promise((resolve, reject) => {
    socket.onopen = resolve;
    socket.onerror = reject;
  });
  let nextId = 1;
  const pending = new Map();
  socket.onmessage = (event) => {
    const message = JSON.parse(event.data);
    if (message.id && pending.has(message.id)) {
      const { resolve, reject } = pending.get(message.id);
      pending.delete(message.id);
      if (message.error) reject(new Error(JSON.stringify(message.error)));
      else resolve(message.result);
      return;
    }
    const p = message.params;
    if (message.method === "Runtime.exceptionThrown") {
      result.errors.push(`exception: ${p.exceptionDetails.exception?.description ?? p.exceptionDetails.text}`);
    } else if (message.method === "Runtime.consoleAPICalled" && ["error", "assert"].includes(p.type)) {
      result.errors.push(`console.${p.type}: ${p.args.map((a) => a.value ?? a.description).join(" ")}`);
    } else if (message.method === "Log.entryAdded" && p.entry.level === "error") {
      result.errors.push(`log: ${p.entry.text} ${p.entry.url ?? ""}`);
    } else if (message.method === "Page.javascriptDialogOpening") {
      result.dialogs.push(p.message);
      send("Page.handleJavaScriptDialog", { accept: true });
    }
  };
  function send(method, params = {}) {
    const id = nextId++;
    socket.send(JSON.stringify({ id, method, params }));
    return new Promise((resolve, reject) => pending.set(id, { resolve, reject }));
  }
  async function evaluate(expression) {
    // userGesture: a click from here opens a tab as a user's click would (no popup blocking).
    const answer = await send("Runtime.evaluate", {
      expression, returnByValue: true, awaitPromise: true, userGesture: true,
    });
    if (answer.exceptionDetails) throw new Error(`${expression}: ${answer.exceptionDetails.text}`);
    return answer.result.value;
  }
  async function waitFor(what, expression) {
    for (;;) {
      const value = await evaluate(expression);
      if (value) return value;
      deadline(what);
      await sleep(200);
    }
  }
  async function screenshot(name, width) {
    await send("Emulation.setDeviceMetricsOverride", { width, height: 800, deviceScaleFactor: 1, mobile: false });
    await sleep(300); // the page's height at this width, not at the last one
    const metrics = await send("Page.getLayoutMetrics");
    const height = Math.ceil(metrics.cssContentSize.height);
    await send("Emulation.setDeviceMetricsOverride", { width, height, deviceScaleFactor: 1, mobile: false });
    await sleep(300); // let the resize observer redraw the charts at the new size
    const shot = await send("Page.captureScreenshot", { format: "png" });
    const path = join(options.out_dir, name);
    writeFileSync(path, Buffer.from(shot.data, "base64"));
    result.screenshots.push(path);
  }
  // What the page shows: per GPU card its points and the series each chart drew.
  const state = `(() => ({
    cards: [...document.querySelectorAll(".gpu")].map((card) => ({
      title: card.querySelector("h3").textContent,
      facts: card.querySelector(".facts").textContent,
      points: Number(card.dataset.points || 0),
      drawn: [...card.querySelectorAll(".chart")].filter((c) => !c.hidden).map((c) => Number(c.dataset.seriesDrawn || 0)),
      legend: card.querySelector(".legend").textContent,
    })),
    pageErrors: Number(document.getElementById("page-errors").dataset.count),
    pageErrorText: document.getElementById("page-errors").textContent,
    alerts: [...document.querySelectorAll("#alert-list li")].map((li) => ({
      text: li.textContent, href: li.querySelector("a").getAttribute("href") })),
    processes: document.getElementById("process-rows").children.length,
    adminState: document.getElementById("admin-state").textContent,
    tokenFormShown: !document.getElementById("token-form").hidden,
    snapshotRows: document.getElementById("snapshot-rows").children.length,
    result: document.getElementById("action-result").textContent,
    location: location.href,
    status: document.getElementById("status").textContent,
  }))()`;
  const ready = `(() => {
    const cards = [...document.querySelectorAll(".gpu")];
    return cards.length >= ${options.min_gpus ?? 1} && cards.every((card) =>
      Number(card.dataset.points || 0) >= ${options.min_points ?? 2} &&
      [...card.querySelectorAll(".chart")].every((c) => c.hidden || Number(c.dataset.seriesDrawn) > 0));
  })()`;

  await send("Page.enable");
  await send("Runtime.enable");
  await send("Log.enable");
  for (const width of options.widths) {
    await send("Emulation.setDeviceMetricsOverride", { width, height: 1000, deviceScaleFactor: 1, mobile: false });
    await send("Page.navigate", { url: options.url });
    await waitFor(`charts at ${width} px`, ready);
    await waitFor("the admin state", `!document.getElementById("admin-state").textContent.startsWith("Checking")`);
    await screenshot(`live-page-${width}.png`, width);
    result.widths[width] = await evaluate(state);
  }
  if (options.actions) {
    const actions = result.actions;
    if (options.token) {
      await waitFor("the token form", `!document.getElementById("token-form").hidden`);
      actions.beforeToken = await evaluate(state);
      await evaluate(`(() => { document.getElementById("token-input").value = ${JSON.stringify(options.token)};
        document.getElementById("token-form").requestSubmit(); return true; })()`);
    }
    await waitFor("buttons enabled", `!document.getElementById("take-snapshot").disabled`);
    await evaluate(`document.getElementById("take-snapshot").click(), true`);
    await waitFor("a snapshot", `document.getElementById("action-result").textContent.includes("Snapshot") &&
      document.getElementById("snapshot-rows").children.length > 0 && !document.getElementById("take-snapshot").disabled`);
    actions.snapshot = await evaluate(state);
    actions.viewHref = await evaluate(`document.querySelector("#snapshot-rows a").getAttribute("href")`);
    // Open the snapshot's view as a user would; it opens in a new tab (from memory, when the
    // page had to fetch it with the token). Wait for that tab to have the viewer's title.
    await evaluate(`document.querySelector("#snapshot-rows a").click(), true`);
    for (;;) {
      const pages = (await (await fetch(`http://127.0.0.1:${port}/json/list`)).json()).filter(
        (t) => t.type === "page" && t.id !== page.id,
      );
      // By its loaded title: while it loads, a tab's title is its URL (which says "snapshots").
      const viewer = pages.find((t) => t.title.startsWith("GPU memory snapshot"));
      if (viewer) {
        // Whether its inline styles applied: a page opened from memory inherits this page's
        // Content-Security-Policy, which would block them if it did not allow them.
        const tab = new WebSocket(viewer.webSocketDebuggerUrl);
        await new Promise((resolve, reject) => {
          tab.onopen = resolve;
          tab.onerror = reject;
        });
        const styled = await new Promise((resolve) => {
          tab.onmessage = (event) => resolve(JSON.parse(event.data).result.result.value);
          tab.send(JSON.stringify({ id: 1, method: "Runtime.evaluate", params: {
            expression: `document.styleSheets.length > 0 && [...document.styleSheets].every((s) => s.cssRules.length > 0)`,
            returnByValue: true } }));
        });
        tab.close();
        actions.viewed = { url: viewer.url, title: viewer.title, styled };
        break;
      }
      deadline(`the snapshot view tab (tabs: ${JSON.stringify(pages.map((t) => [t.url, t.title]))})`);
      await sleep(200);
    }
    await evaluate(`document.getElementById("empty-cache").click(), true`);
    await waitFor("empty cache", `document.getElementById("action-result").textContent.includes("Empty cache") &&
      !document.getElementById("empty-cache").disabled`);
    actions.emptyCache = await evaluate(state);
    actions.sessionToken = await evaluate(`sessionStorage.getItem("gpumem-admin-token")`);
    await screenshot(`live-page-actions-${options.widths[0]}.png`, options.widths[0]);
  }
  socket.close();
} catch (error) {
  result.failure = String(error.stack || error);
} finally {
  browser.kill();
}
process.stdout.write(JSON.stringify(result));
