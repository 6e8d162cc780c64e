"""Render bench/run_all.py's JSON as the tables of docs/performance.md.

python3 -m bench.report docs/bench-results.json > docs/performance-tables.md
"""

from __future__ import annotations

import json
import sys
from typing import Any

GOALS = {
    "allocator_us_per_device": 13.0,
    "nvml_us_per_device": 10.0,
    "tick_us_per_device": 30.0,
    "render_cached_us": 50.0,
    "scrape_idle_p99_ms": 2.0,
    "extra_rss_mb": 60.0,
}


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def sampler_table(r: dict[str, Any]) -> list[str]:
    devices = r["devices"]
    rows = [
        f"Per tick, {devices} GPUs in use. CPU is the mean over 3000 reads (the NVML source "
        "reads its process list every 10th read, as at 1 Hz with its 10 s cadence); per "
        f"device = mean / {devices}.",
        "",
        "| what | wall median (us) | wall p99 (us) | CPU mean (us) | per device (us) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    names = {
        "naive_memory_stats_and_gauges": "naive: memory_stats(i) + 6 Gauges",
        "floor_c_call": "floor: the C call `_cuda_memoryStats(i)` alone",
        "cheapest_nested_dict": "`memory_stats_as_nested_dict(i)` alone",
        "ours_torch_source": "ours: allocator source",
        "ours_nvml_source": "ours: NVML source, per tick at 1 Hz",
        "ours_nvml_memory_only": "ours: NVML source, a tick without the process list",
        "ours_nvml_with_process_list": "ours: NVML source, a tick with the process list",
        "ours_allocator_plus_nvml": "ours: allocator + NVML",
        "ours_full_tick": "ours: whole tick (+ host memory, detectors)",
        "ours_render_metrics": "ours: /metrics bytes once the tick's text exists",
        "ours_render_uncached": "ours: rendering the text (once per tick)",
        "naive_render_metrics": "naive: render its /metrics",
    }
    for key, label in names.items():
        v = r[key]
        cpu = v["cpu_mean_us"]["mean"]
        per_device = "-" if "render" in key else f"{cpu / devices:.1f}"
        rows.append(
            f"| {label} | {v['wall_us']['median']:.1f} | {v['wall_us']['p99']:.1f} | "
            f"{cpu:.1f} | {per_device} |"
        )

    def per_device(key: str) -> float:
        return float(r[key]["cpu_mean_us"]["mean"]) / devices

    rows += ["", "Goals, CPU per device and tick:", ""]
    for label, key, goal in (
        ("allocator read", "ours_torch_source", "allocator_us_per_device"),
        ("NVML read (average per tick)", "ours_nvml_source", "nvml_us_per_device"),
        ("whole tick", "ours_full_tick", "tick_us_per_device"),
    ):
        value = per_device(key)
        rows.append(
            f"- {label}: {value:.1f} us, goal <= {GOALS[goal]:.0f} us: "
            f"{verdict(value <= GOALS[goal])}"
        )
    return rows


def scrape_table(s: dict[str, Any]) -> list[str]:
    rows = [
        f"{s['devices_worth']} GPUs' worth of series ({s['series']} series, "
        f"{s['exposition_bytes'] / 1024:.0f} KiB). Ours: the exporter's server. Naive: "
        "prometheus_client's `start_http_server` over the same registry (renders every "
        "scrape; HTTP/1.0, so a new connection each time). Latency with "
        "`Accept-Encoding: gzip`, as Prometheus asks.",
        "",
        "| server | kept-alive idle p50 / p99 (ms) | new connection idle p50 / p99 (ms) | "
        "kept-alive under load p50 / p99 (ms) | CPU per scrape (us) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, v in s["servers"].items():
        cells = [
            f"{v[k]['p50']:.2f} / {v[k]['p99']:.2f}"
            for k in ("idle_kept_alive_ms", "idle_new_connection_ms", "under_load_kept_alive_ms")
        ]
        rows.append(f"| {name} | {' | '.join(cells)} | {v['cpu_per_scrape_us']:.0f} |")
    render = s["render_us"]
    rows += [
        "",
        f"Render, 8 GPUs' worth: the cached bytes {render['cached_bytes']:.1f} us per scrape "
        f"(goal <= {GOALS['render_cached_us']:.0f} us: "
        f"{verdict(render['cached_bytes'] <= GOALS['render_cached_us'])}); rendering the text "
        f"{render['prometheus_client_text']:.0f} us, now once per tick.",
    ]
    prom = s.get("prometheus", {})
    if "ours" in prom:
        rows += [
            "",
            "A real Prometheus scraping both every second while the decoder loop runs, its "
            "own `scrape_duration_seconds` (which includes its parsing and storing): "
            + "; ".join(
                f"{name} p50 {v['p50']:.1f} ms, max {v['max']:.1f} ms ({v['n']} scrapes)"
                for name, v in prom.items()
            )
            + ".",
        ]
    ours = s["servers"]["ours"]
    keep, new = ours["idle_kept_alive_ms"], ours["idle_new_connection_ms"]
    rows += [
        "",
        f"Goals: kept-alive not slower than a new connection ({keep['p50']:.2f} vs "
        f"{new['p50']:.2f} ms: {verdict(keep['p50'] <= new['p50'])}); idle p99 <= "
        f"{GOALS['scrape_idle_p99_ms']:.0f} ms ({keep['p99']:.2f} ms: "
        f"{verdict(keep['p99'] <= GOALS['scrape_idle_p99_ms'])}).",
    ]
    return rows


def _ci(v: dict[str, float], unit: str = "", sign: str = "+") -> str:
    return f"{v['mean']:{sign}.2f}{unit} [{v['ci95_low']:{sign}.2f}, {v['ci95_high']:{sign}.2f}]"


def serving_table(r: dict[str, Any]) -> list[str]:
    rows = [
        f"{r['blocks']} blocks of paired runs, each run {r['steps_per_run']} decode steps at "
        f"batch {r['batch']} (median {r['run_s']['median']:.2f} s), the configurations of a "
        "block in random order; /metrics scraped every second over a kept-alive connection "
        "while the exporter runs. Mean [95% CI] over the blocks.",
        "",
        "| exporter | run time change vs the block's off run | exporter threads' CPU "
        "(ms per s) | serving thread's GIL wait (ms per s) | scrape p50 / p99 (ms) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, c in r["configs"].items():
        slow = c.get("slowdown_pct")
        scrape = c["scrape_ms"]
        rows.append(
            f"| {name} | {_ci(slow, '%') if slow else 'baseline'} | "
            f"{c['exporter_thread_cpu_ms_per_s']['mean']:.2f} | "
            f"{_ci(c['gil_wait_ms_per_s'], sign='')} | "
            + (f"{scrape['p50']:.1f} / {scrape['p99']:.1f} |" if scrape["n"] else "- |")
        )
    return rows


def stall_table(r: dict[str, Any]) -> list[str]:
    rows = [
        "| action | history mode | live blocks | action (ms) | serving stall (ms) |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for key, blocks in (("snapshot_10k_blocks", "10k"), ("snapshot_50k_blocks", "50k")):
        for mode, v in r[key].items():
            if "error" in v:
                rows.append(f"| snapshot | {mode} | {blocks} | error: {v['error']} | |")
                continue
            rows.append(
                f"| snapshot | {mode} | {blocks} | {v['action_s'] * 1e3:.1f} | "
                f"{v['stall_ms']:.1f} |"
            )
    ec = r["empty_cache"]
    rows.append(
        f"| empty_cache | - | idle GPU | {ec['idle']['action_s'] * 1e3:.1f} | "
        f"{ec['idle']['stall_ms']:.1f} |"
    )
    rows.append(
        f"| empty_cache | - | {ec['queued_work_s']:.1f} s of GPU work queued | "
        f"{ec['with_2s_queued']['action_s'] * 1e3:.0f} | "
        f"{ec['with_2s_queued']['stall_ms']:.0f} |"
    )
    rows += [
        "",
        "Cost of recording history, per alloc+free pair:",
        "",
        "| history mode | us per pair |",
        "| --- | ---: |",
    ]
    for mode, v in r["alloc_free_pair"].items():
        rows.append(f"| {mode} | {v['pair_us']:.2f} |")
    return rows


def layout_table(r: dict[str, Any]) -> list[str]:
    rows = [
        "Stall of the serving thread per layout reading (segments-only snapshot + walk), "
        "by live blocks and history mode (p50, p99 and max over the readings):",
        "",
        "| live blocks | history | reading p50 (ms) | stall p50 (ms) | stall p99 (ms) | "
        "stall max (ms) |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for key, v in r["readings"].items():
        count, history = key.split("/", 1)
        if "error" in v:
            rows.append(f"| {count} | {history} | error: {v['error']} | | | |")
            continue
        rows.append(
            f"| {v['blocks']} | {history} | {v['read_ms']['p50']:.1f} | "
            f"{v['stall_ms']['p50']:.1f} | {v['stall_ms']['p99']:.1f} | "
            f"{v['stall_ms']['max']:.1f} |"
        )
    m = r.get("minute")
    if m:
        off, on = m["off"], m["default_reader"]
        rows += [
            "",
            f"Decoder steps, {m.get('seconds', 60):.0f} s per arm (off first), {m['blocks']} "
            f"blocks (just under the guard), reader every {m['interval_s']:.0f} s:",
            "",
            "| arm | steps | step p50 (ms) | step p99 (ms) | step max (ms) | readings | "
            "reading p50 (ms) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, arm in (("off", off), ("default reader", on)):
            read = arm["read_ms"].get("p50")
            rows.append(
                f"| {name} | {arm['step_ms']['n']} | {arm['step_ms']['p50']:.2f} | "
                f"{arm['step_ms']['p99']:.2f} | {arm['step_ms']['max']:.2f} | "
                f"{arm['readings']} | {'-' if read is None else f'{read:.1f}'} |"
            )
        rows += ["", f"Added p99: {m['added_p99_ms']:.2f} ms (goal < 1 ms)."]
    return rows


def render(results: dict[str, Any]) -> str:
    machine = results["footprint"]["machine"]
    out = [
        f"Machine: {machine.get('gpus')}, driver {machine.get('driver')}, torch "
        f"{machine.get('torch')} (CUDA {machine.get('cuda')}), Python "
        f"{machine.get('python')}, {machine.get('cpus')} CPUs. Run started "
        f"{results['started']}: `{results['command']}`.",
        "",
    ]
    out += ["### Sampler cost", "", *sampler_table(results["sampler_cost"]), ""]
    out += ["### Serving impact", "", *serving_table(results["serving_impact"]), ""]
    out += ["### /metrics as Prometheus scrapes it", "", *scrape_table(results["scrape_latency"])]
    out += [""]
    f = results["footprint"]
    extra_mb = f["extra_rss_bytes"] / 1e6
    out += [
        "### Footprint",
        "",
        "| what | value | goal |",
        "| --- | ---: | --- |",
        f"| extra resident memory (import, start, 30 s at 10 Hz with scrapes) | "
        f"{extra_mb:.1f} MB | < {GOALS['extra_rss_mb']:.0f} MB: "
        f"{verdict(extra_mb < GOALS['extra_rss_mb'])} |",
        f"| extra GPU memory (NVML, this process) | {f['extra_gpu_bytes']} bytes | 0: "
        f"{verdict(f['extra_gpu_bytes'] == 0)} |",
        f"| extra torch reserved | {f['extra_reserved_bytes']} bytes | 0 |",
        f"| GPUs holding a context of this process | {f['gpus_with_this_process']} of "
        f"{f['gpus_visible']} (uses only cuda:0) | 1 |",
        "",
    ]
    out += ["### Stalls", "", *stall_table(results["stalls"]), ""]
    if "layout_stall" in results:
        out += ["### Allocator layout reading", "", *layout_table(results["layout_stall"]), ""]
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(render(json.load(f)))
