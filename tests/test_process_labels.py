"""Series of a process named by its rank and role keep their identity across restarts; the pid
goes where it is needed to tell processes apart (exporter.process_labels)."""

from __future__ import annotations

from exporter.process_labels import ProcessLabels


def worker(pid: int, rank: str, role: str = "worker") -> dict[str, object]:
    return {"pid": str(pid), "rank": rank, "local_rank": rank, "role": role}


def test_a_process_with_a_rank_or_a_role_of_its_own_goes_without_its_pid() -> None:
    processes = ProcessLabels([worker(11, "0"), worker(12, "1"), worker(10, "", "api")])
    assert processes.labels(worker(11, "0"))["pid"] == ""
    assert processes.labels({"pid": 10, "role": "api", "rank": ""})["pid"] == ""
    assert processes.labels({"alert": "GpuMemOutOfMemory", "device": "0"}) == {
        "alert": "GpuMemOutOfMemory",
        "device": "0",
    }


def test_processes_that_share_their_labels_or_have_none_keep_their_pids() -> None:
    processes = ProcessLabels(
        [worker(11, "", "litserve"), worker(12, "", "litserve"), {"pid": "13"}, worker(14, "0")]
    )
    assert [processes.labels({"pid": p})["pid"] for p in ("11", "12", "13", "14")] == [
        "11",
        "12",
        "13",
        "",
    ]


def test_a_process_is_counted_once_however_many_readings_name_it() -> None:
    """An allocator and a host-memory reading of one worker are not two workers of a rank."""
    processes = ProcessLabels([worker(11, "0"), {"pid": 11, "role": "worker", "rank": "0"}])
    assert processes.labels(worker(11, "0"))["pid"] == ""
    assert list(processes.processes) == ["11"]


def test_an_endpoint_of_one_process_keeps_every_pid() -> None:
    """Outside `run` a series without a pid is the serving process's own (the multiprocess
    bridge labels it so): a pid there is never dropped."""
    processes = ProcessLabels([worker(11, "0"), {"pid": 600, "role": "python"}], every_pid=True)
    assert processes.labels(worker(11, "0"))["pid"] == "11"
    assert processes.labels({"pid": 600})["pid"] == 600


def test_a_process_keeps_its_series_when_another_of_its_role_joins_and_leaves() -> None:
    """Issue 65: one server alone on a helper went without its pid; when a second of its role
    joined both took their pids, and lost them again when it left: a process joining or
    leaving changed another's series. Each keeps its first decision while it is served."""
    decided: dict[str, tuple[tuple[str, str], bool]] = {}
    alone = ProcessLabels([worker(10, "", "server")], decided=decided)
    assert not alone.keeps_pid(10)
    joined = ProcessLabels([worker(10, "", "server"), worker(20, "", "server")], decided=decided)
    assert not joined.keeps_pid(10)  # as it was
    assert joined.keeps_pid(20)  # the newcomer is told apart by its pid: no collision
    left = ProcessLabels([worker(20, "", "server")], decided=decided)
    assert left.keeps_pid(20)  # as it was
    assert decided == {"20": (("", "server"), True)}  # the one gone is forgotten
    # Two that come together keep their pids, as before.
    both = ProcessLabels([worker(31, "0"), worker(32, "0")], decided={})
    assert both.keeps_pid(31) and both.keeps_pid(32)
