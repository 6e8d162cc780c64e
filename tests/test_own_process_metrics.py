"""The process metrics every endpoint serves are client_python's ProcessCollector's: the same
families (name, type, help, order) and the same values, read more cheaply
(exporter.own_process_metrics)."""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Callable

import pytest
from prometheus_client import ProcessCollector

from exporter.own_process_metrics import OwnProcessMetrics

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _by_name(metrics):
    return {m.name: m for m in metrics}


def _open_fds(collector) -> float:
    return _by_name(collector.collect())["process_open_fds"].samples[0].value


def _moments(check, attempts: int = 5) -> bool:
    """Whether `check()` held at one of a few moments: other tests' threads in this worker
    open and close descriptors between two reads."""
    return any(check() for _ in range(attempts))


def test_the_families_and_values_are_client_pythons():
    ours = OwnProcessMetrics()
    client_pythons = ProcessCollector(registry=None)
    try:
        theirs = _by_name(client_pythons.collect())
        mine = _by_name(ours.collect())
        assert list(mine) == list(theirs)
        for name, metric in mine.items():
            assert (metric.type, metric.documentation) == (
                theirs[name].type,
                theirs[name].documentation,
            )
            assert [s.name for s in metric.samples] == [s.name for s in theirs[name].samples]
        value = {name: m.samples[0].value for name, m in mine.items()}
        expected = {name: m.samples[0].value for name, m in theirs.items()}
        # Fixed for the process's life: equal to the byte and the tick.
        for name in ("process_start_time_seconds", "process_max_fds"):
            assert value[name] == expected[name]
        # Read a moment apart: as close as what moved meanwhile.
        cpu = "process_cpu_seconds"  # a counter's name, without _total
        assert abs(value[cpu] - expected[cpu]) < 0.1
        rss, vms = "process_resident_memory_bytes", "process_virtual_memory_bytes"
        assert abs(value[rss] - expected[rss]) < 16 << 20
        assert abs(value[vms] - expected[vms]) < 64 << 20
        # Both count the descriptors of this process, the one ours keeps open among them.
        assert _moments(lambda: _open_fds(ours) == _open_fds(client_pythons))
    finally:
        ours.close()


def test_the_values_move_with_the_process():
    """Read again on every collect (the file is kept open, its text is the kernel's anew)."""
    ours = OwnProcessMetrics()
    cpu = "process_cpu_seconds"
    try:
        before = _by_name(ours.collect())
        spent = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
        while sum(resource.getrusage(resource.RUSAGE_SELF)[:2]) < spent + 0.05:
            pass  # burn CPU for 50 ms, past a clock tick
        assert _by_name(ours.collect())[cpu].samples[0].value > before[cpu].samples[0].value

        def five_more() -> bool:
            first = _open_fds(ours)
            kept = [os.open(os.devnull, os.O_RDONLY) for _ in range(5)]
            try:
                return _open_fds(ours) == first + 5
            finally:
                for fd in kept:
                    os.close(fd)

        assert _moments(five_more)
    finally:
        ours.close()


def _in_a_forked_child(report: Callable[[], float]) -> float:
    """`report()` run in a forked child of this process, its number sent back by a pipe."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        try:
            os.write(write, repr(report()).encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        return float(os.read(read, 100))
    finally:
        os.close(read)
        os.waitpid(child, 0)


def test_a_forked_child_reads_its_own_process():
    ours = OwnProcessMetrics()

    def start() -> float:
        return _by_name(ours.collect())["process_start_time_seconds"].samples[0].value

    try:
        parent_start = start()  # the parent's /proc/PID/stat opened
        child_start = _in_a_forked_child(start)
    finally:
        ours.close()
    assert child_start > parent_start  # the child's start, not its parent's


def test_a_forked_child_counts_its_own_descriptors():
    """/proc/self/fd is kept open: a forked child lists its own directory, not the one its
    parent opened (which names the parent's descriptors)."""
    ours = OwnProcessMetrics()

    def counted_less_listed() -> float:
        for _ in range(20):  # the child's own, open until it exits
            os.open(os.devnull, os.O_RDONLY)
        return _open_fds(ours) - len(os.listdir("/proc/self/fd"))

    try:
        ours.collect()  # the parent's /proc/PID/fd opened
        assert _in_a_forked_child(counted_less_listed) == 0
    finally:
        ours.close()


def test_without_proc_it_serves_nothing(tmp_path):
    """As client_python's: a machine without /proc (macOS) has no process families."""
    assert list(OwnProcessMetrics(proc=str(tmp_path / "none")).collect()) == []


@pytest.mark.parametrize(
    "accept",
    ["text/plain; version=0.0.4", "application/openmetrics-text; version=1.0.0"],
)
def test_the_rendered_families_are_the_encoders_text(accept):
    """The exposition renders these families through templates of their fixed shapes
    (families(), no prometheus_client family made): the bytes are the encoder's own, render
    after render, as the values move."""
    from prometheus_client.exposition import choose_encoder

    from exporter.exposition_templates import TemplateRenderer, _One

    encoder, _ = choose_encoder(accept)
    renderer = TemplateRenderer(encoder)
    ours = OwnProcessMetrics()
    try:
        for _ in range(3):
            families = ours.families()
            assert len(families) == 6
            expected = encoder(_One([f.to_metric() for f in families]))
            assert renderer.render(families) == expected
            sum(range(200_000))  # CPU moves between renders
    finally:
        ours.close()
