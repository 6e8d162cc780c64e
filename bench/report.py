"""Render bench/run_all.py's JSON as the tables of docs/performance.md.

python3 -m bench.report docs/bench-results.json > docs/performance-tables.md
"""

from __future__ import annotations

import json
import sys
from typing import Any

GOALS = {
    "tick_us_per_device": 25.0,
    "loss_1hz_pct": 0.5,
    "loss_10hz_pct": 1.0,
    "scrape_p99_ms": 10.0,
    "extra_rss_mb": 60.0,
}


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def sampler_table(r: dict[str, Any]) -> list[str]:
    devices = r["devices"]
    rows = [
        f"Per tick, {devices} GPUs in use; per device = median / {devices}.",
        "",
        "| what | wall median (us) | wall p99 (us) | CPU median (us) | per device (us) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    names = {
        "naive_memory_stats_and_gauges": "naive: memory_stats(i) + 6 Gauges",
        "cheapest_nested_dict": "floor: memory_stats_as_nested_dict(i) alone",
        "ours_torch_source": "ours: allocator source",
        "ours_nvml_source": "ours: NVML source (memory v2 + process list)",
        "ours_allocator_plus_nvml": "ours: allocator + NVML",
        "ours_full_tick": "ours: whole tick (+ host memory, detectors)",
        "ours_render_metrics": "ours: render /metrics (per scrape)",
        "naive_render_metrics": "naive: render its /metrics",
    }
    for key, label in names.items():
        v = r[key]
        per_device = "-" if "render" in key else f"{v['cpu_us']['median'] / devices:.1f}"
        rows.append(
            f"| {label} | {v['wall_us']['median']:.1f} | {v['wall_us']['p99']:.1f} | "
            f"{v['cpu_us']['median']:.1f} | {per_device} |"
        )
    per_device = r["ours_allocator_plus_nvml"]["cpu_us"]["median"] / devices
    rows += [
        "",
        f"Goal: at most {GOALS['tick_us_per_device']:.0f} us CPU per device per tick "
        f"for allocator + NVML: {per_device:.1f} us, "
        f"{verdict(per_device <= GOALS['tick_us_per_device'])}.",
    ]
    return rows


def serving_table(r: dict[str, Any]) -> list[str]:
    rows = [
        f"{r['repeats']} interleaved runs of {r['seconds_per_run']:.0f} s per configuration;"
        " /metrics scraped every second from another process while the exporter runs.",
        "",
        "| exporter | tokens/s median | min - max | step p50 (ms) | step p99 (ms) | "
        "scrape median / p99 (ms) | throughput change |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, c in r["configs"].items():
        t = c["tokens_per_s"]
        scrape = c["scrape_ms"]
        scrape_text = f"{scrape['median']:.1f} / {scrape['p99']:.1f}" if scrape["n"] else "-"
        loss = c.get("throughput_loss_pct")
        loss_text = "baseline" if loss is None else f"{-loss:+.2f}%"
        rows.append(
            f"| {name} | {t['median']:.0f} | {t['min']:.0f} - {t['max']:.0f} | "
            f"{c['step_p50_ms']['median']:.3f} | {c['step_p99_ms']['median']:.3f} | "
            f"{scrape_text} | {loss_text} |"
        )
    off = r["configs"]["off"]["tokens_per_s"]
    spread = (off["max"] - off["min"]) / off["median"] * 100
    rows += ["", f"Run-to-run spread of the baseline alone: {spread:.1f}% (max - min over median)."]
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
    s = results["scrape_latency"]
    out += [
        "### /metrics latency",
        "",
        f"{s['devices_worth']} GPUs' worth of series ({s['series']} series, "
        f"{s['exposition_bytes'] / 1024:.0f} KiB), scraped every 100 ms from another "
        "process while a Python-bound decoder loop runs in the host process.",
        "",
        "| condition | median (ms) | p99 (ms) | max (ms) |",
        "| --- | ---: | ---: | ---: |",
        f"| idle | {s['scrape_idle_ms']['median']:.2f} | {s['scrape_idle_ms']['p99']:.2f} | "
        f"{s['scrape_idle_ms']['max']:.2f} |",
        f"| under load | {s['scrape_under_load_ms']['median']:.2f} | "
        f"{s['scrape_under_load_ms']['p99']:.2f} | {s['scrape_under_load_ms']['max']:.2f} |",
        "",
        f"Goal p99 under {GOALS['scrape_p99_ms']:.0f} ms under load: "
        f"{verdict(s['scrape_under_load_ms']['p99'] < GOALS['scrape_p99_ms'])}.",
        "",
    ]
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
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(render(json.load(f)))
