// The window of samples the page holds: timestamps, and per GPU its series (columns), merged
// from each answer of api/window and cut to the exporter's capacity.
export const store = {
  t: [], // sample timestamps, oldest first
  gpus: new Map(), // key -> {info, cols: {field: [...]}, view}
  capacity: 600,
  interval: 1,
  why: {}, // source -> why it gives nothing (api/window's sources_why)
  ledgers: {}, // GPU key -> [[part, bytes], ...] of the latest sample (api/window's ledgers)
};

export function lastTimestamp() {
  return store.t.length ? store.t[store.t.length - 1] : null;
}

export function merge(data) {
  store.why = data.sources_why || {};
  store.ledgers = data.ledgers || {};
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

export function hasAllocator(entry) {
  return entry.cols.allocated_bytes.some((v) => v !== null);
}

