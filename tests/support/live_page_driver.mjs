// Drives the live page in headless Chromium over the DevTools protocol, for tests/http/test_page.py:
// loads it at each width, waits for the charts, takes full-page screenshots, clicks the admin
// buttons (entering the token first when given) and reports what happened as JSON on stdout,
// with every console error, exception, CSP violation and failed load the browser saw.
//
// Usage: node live_page_driver.mjs '{"chromium": ..., "url": ...}'
//
// It speaks the DevTools protocol over --remote-debugging-pipe (messages on fds 3 and 4, each
// ended by a NUL byte), so it needs nothing but Node: no WebSocket package to install.
import { spawn } from "node:child_process";
import { writeFileSync } from "node:fs";
import { join } from "node:path";

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
    "--remote-debugging-pipe",
    `--user-data-dir=${options.profile}`,
    "about:blank",
  ],
  // fd 3: what Chromium reads (our commands); fd 4: what it writes (answers and events).
  { stdio: ["ignore", "ignore", "pipe", "pipe", "pipe"] },
);
const result = { errors: [], dialogs: [], screenshots: [], widths: {}, actions: {} };

try {
  let stderr = "";
  browser.stderr.on("data", (chunk) => (stderr += chunk));
  const exited = new Promise((_, reject) =>
    browser.on("exit", (code) => reject(new Error(`chromium exited (${code}): ${stderr}`))),
  );
  let nextId = 1;
  const pending = new Map();
  const listeners = [];
  let buffered = "";
  browser.stdio[4].on("data", (chunk) => {
    buffered += chunk;
    for (let end = buffered.indexOf("\0"); end >= 0; end = buffered.indexOf("\0")) {
      const message = JSON.parse(buffered.slice(0, end));
      buffered = buffered.slice(end + 1);
      if (message.id && pending.has(message.id)) {
        const { resolve, reject } = pending.get(message.id);
        pending.delete(message.id);
        if (message.error) reject(new Error(JSON.stringify(message.error)));
        else resolve(message.result);
      } else {
        for (const listener of listeners) listener(message);
      }
    }
  });
  // A command to the browser, or to one tab (its sessionId from Target.attachToTarget).
  function command(method, params = {}, sessionId = undefined) {
    const id = nextId++;
    browser.stdio[3].write(JSON.stringify({ id, method, params, sessionId }) + "\0");
    return Promise.race([new Promise((resolve, reject) => pending.set(id, { resolve, reject })), exited]);
  }
  const targets = async () => (await command("Target.getTargets")).targetInfos;
  let page = (await targets()).find((t) => t.type === "page");
  for (; !page; page = (await targets()).find((t) => t.type === "page")) {
    deadline("the first tab");
    await sleep(100);
  }
  const { sessionId } = await command("Target.attachToTarget", { targetId: page.targetId, flatten: true });
  listeners.push((message) => {
    if (message.sessionId !== sessionId) return;
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
  });
  const send = (method, params = {}) => command(method, params, sessionId);
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
      // The ledger's bar: each segment's part and its width's share of the bar, and its words.
      ledger: card.querySelector(".ledger").hidden ? null : {
        parts: [...card.querySelectorAll(".ledger-bar .segment")].map((s) => [s.dataset.part,
          s.getBoundingClientRect().width / card.querySelector(".ledger-bar").getBoundingClientRect().width]),
        text: card.querySelector(".ledger-text").textContent },
      // What drawMarkers drew (labels and merged markers), and legend rows whose text does
      // not fit their box.
      markers: JSON.parse(card.querySelector(".chart.mem").dataset.markers || "null"),
      legendOverflow: [...card.querySelectorAll(".legend .row")]
        .filter((row) => row.scrollWidth > row.clientWidth + 1 || [...row.children].some(
          (c) => c.getBoundingClientRect().right > row.getBoundingClientRect().right + 1))
        .map((row) => row.textContent),
    })),
    pageErrors: Number(document.getElementById("page-errors").dataset.count),
    pageErrorText: document.getElementById("page-errors").textContent,
    alerts: [...document.querySelectorAll("#alert-list li")].map((li) => ({
      text: li.textContent, href: li.querySelector("a").getAttribute("href"),
      severity: li.className, name: li.querySelector(".name").textContent,
      value: li.querySelector(".value").textContent, since: li.querySelector(".since").textContent })),
    processes: document.getElementById("process-rows").children.length,
    oom: {
      hidden: document.getElementById("oom-banner").hidden,
      above: document.getElementById("oom-banner").getBoundingClientRect().top <
        document.getElementById("alerts").getBoundingClientRect().top,
      entries: [...document.querySelectorAll("#oom-list li")].map((li) => ({
        verdict: li.dataset.verdict, text: li.textContent,
        numbers: Object.fromEntries([...li.querySelectorAll(".number")].map(
          (n) => [n.dataset.reading, n.querySelector("b").textContent])),
        links: [...li.querySelectorAll("a")].map((a) => [a.textContent, a.getAttribute("href")]),
      })),
    },
    // What reaches past the window's right edge (the page would scroll sideways, or cut it
    // off), outside the tables' own scrolling boxes: at most ten, named by id or class.
    sideways: [...document.querySelectorAll("body *")]
      .filter((e) => !e.closest(".table-wrap") && e.getClientRects().length > 0 &&
        e.getBoundingClientRect().right > document.documentElement.clientWidth + 1)
      .slice(0, 10).map((e) => e.id || e.className || e.tagName),
    // Table cells (processes, snapshots) past the window's right edge: on a phone they were
    // reachable only by scrolling their box sideways, the snapshot's links off the screen.
    cutCells: [...document.querySelectorAll(".table-wrap td")]
      .filter((td) => td.getClientRects().length > 0 &&
        td.getBoundingClientRect().right > document.documentElement.clientWidth + 1)
      .slice(0, 10).map((td) => td.closest("table").className + ": " + (td.dataset.label || td.cellIndex)),
    tableRows: [...document.querySelectorAll(".table-wrap tbody tr")].length,
    adminState: document.getElementById("admin-state").textContent,
    tokenFormShown: !document.getElementById("token-form").hidden,
    snapshotRows: document.getElementById("snapshot-rows").children.length,
    result: document.getElementById("action-result").textContent,
    location: location.href,
    status: document.getElementById("status").textContent,
    noGpus: document.getElementById("no-gpus").hidden ? null : document.getElementById("no-gpus").textContent,
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
  if (options.basic_auth) {
    // The browser's own basic-auth prompt, answered as a user would type the password.
    result.authPrompts = 0;
    listeners.push((message) => {
      if (message.sessionId !== sessionId) return;
      if (message.method === "Fetch.authRequired") {
        result.authPrompts += 1;
        send("Fetch.continueWithAuth", {
          requestId: message.params.requestId,
          authChallengeResponse: { response: "ProvideCredentials", ...options.basic_auth },
        });
      } else if (message.method === "Fetch.requestPaused") {
        send("Fetch.continueRequest", { requestId: message.params.requestId });
      }
    });
    await send("Fetch.enable", { handleAuthRequests: true, patterns: [{ urlPattern: "*" }] });
  }
  for (const width of options.widths) {
    await send("Emulation.setDeviceMetricsOverride", { width, height: 1000, deviceScaleFactor: 1, mobile: false });
    await send("Page.navigate", { url: options.url });
    await waitFor(`charts at ${width} px`, ready);
    // Absent for a moment while the page (re)loads under a busy machine: wait, not throw.
    await waitFor("the admin state", `document.getElementById("admin-state")?.textContent.startsWith("Checking") === false`);
    await screenshot(`live-page-${width}.png`, width);
    result.widths[width] = await evaluate(state);
  }
  if (options.runbooks_widths) {
    // The runbooks page: whether any table is wider than its box or the window (then a
    // column is cut off, or needs scrolling sideways), at each width.
    result.runbooks = {};
    for (const width of options.runbooks_widths) {
      await send("Emulation.setDeviceMetricsOverride", { width, height: 1000, deviceScaleFactor: 1, mobile: false });
      await send("Page.navigate", { url: new URL("runbooks", options.url).href });
      await waitFor("the runbooks", `document.querySelectorAll("main table").length > 0`);
      await screenshot(`runbooks-${width}.png`, width);
      result.runbooks[width] = await evaluate(`(() => {
        const right = document.documentElement.clientWidth;
        const tables = [...document.querySelectorAll("main table")];
        const clipped = tables.filter((t) => t.scrollWidth > t.clientWidth + 1 ||
          [...t.querySelectorAll("td, th")].some((c) => c.getBoundingClientRect().right > right + 1));
        // Words of prose broken across lines (letters only: a hyphen may break a word, and
        // code and links, identifiers, may break anywhere).
        const broken = [];
        for (const cell of document.querySelectorAll("main td, main th")) {
          const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
          for (let node = walker.nextNode(); node; node = walker.nextNode()) {
            if (node.parentElement.closest("code, a")) continue;
            for (const match of node.data.matchAll(/[A-Za-z]{2,}/g)) {
              const range = document.createRange();
              range.setStart(node, match.index);
              range.setEnd(node, match.index + match[0].length);
              const lines = new Set([...range.getClientRects()].map((r) => Math.round(r.top)));
              if (lines.size > 1) broken.push(match[0]);
            }
          }
        }
        return { tables: tables.length, broken: broken.slice(0, 10),
          clipped: clipped.map((t) => t.closest("section").id + ": " + t.querySelector("th").textContent) };
      })()`);
    }
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
      const pages = (await targets()).filter((t) => t.type === "page" && t.targetId !== page.targetId);
      // By its loaded title: while it loads, a tab's title is its URL (which says "snapshots").
      const viewer = pages.find((t) => t.title.startsWith("GPU memory snapshot"));
      if (viewer) {
        // Whether its inline styles applied: a page opened from memory inherits this page's
        // Content-Security-Policy, which would block them if it did not allow them.
        const tab = await command("Target.attachToTarget", { targetId: viewer.targetId, flatten: true });
        const answer = await command("Runtime.evaluate", {
          expression: `document.styleSheets.length > 0 && [...document.styleSheets].every((s) => s.cssRules.length > 0)`,
          returnByValue: true,
        }, tab.sessionId);
        actions.viewed = { url: viewer.url, title: viewer.title, styled: answer.result.value };
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
} catch (error) {
  result.failure = String(error.stack || error);
} finally {
  browser.kill();
}
process.stdout.write(JSON.stringify(result));
