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
