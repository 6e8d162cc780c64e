"""The admin API from the outside: CLI clients against a running demo, and a schemathesis run
of the OpenAPI schema in which no request may get a 5xx."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import require_tool
from tests.helpers import run_cli, running, trace_of_sample

TOKEN = "cli-test-token"


@pytest.fixture
def demo_env(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    env = {
        "GPUMEM_ADMIN_TOKEN_FILE": str(token_file),
        "GPUMEM_SNAPSHOT_DIR": str(tmp_path / "snaps"),
    }
    return env, token_file


@pytest.mark.slow
def test_snapshot_view_and_empty_cache_clients(demo_env, tmp_path):
    env, token_file = demo_env
    with running("demo", env=env) as url:
        out = tmp_path / "snap.pickle"
        proc = run_cli("snapshot", "--url", url, "--token-file", str(token_file), "-o", str(out))
        assert proc.returncode == 0, proc.stderr
        assert "replay" in proc.stdout
        assert pickle.loads(out.read_bytes())["segments"]
        kept = list((tmp_path / "snaps").iterdir())  # the exporter's own copies stay private
        assert kept and {f.stat().st_mode & 0o777 for f in kept} == {0o600}
        windowed = tmp_path / "window.pickle"
        proc = run_cli(
            "snapshot",
            "--url",
            url,
            "--token-file",
            str(token_file),
            "-o",
            str(windowed),
            "--record-s",
            "0.5",
        )
        assert proc.returncode == 0, proc.stderr
        assert windowed.stat().st_size > 0
        proc = run_cli("empty-cache", "--url", url, "--token-file", str(token_file), "--json")
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout)
        assert result["replay"] is True and len(result["processes"]) == 1
        assert result["processes"][0]["result"]["would_release_bytes"] > 0
        again = run_cli("empty-cache", "--url", url, "--token-file", str(token_file))
        # Within the cooldown: 429, and when to try again (its Retry-After).
        assert again.returncode == 2 and "HTTP 429" in again.stderr
        assert re.search(r"\(retry in \d+ s\)", again.stderr), again.stderr
    html = tmp_path / "snap.html"
    proc = run_cli("view", str(out), "-o", str(html))
    assert proc.returncode == 0, proc.stderr
    page = html.read_text()
    assert page.startswith("<!") and "https://" not in page


@pytest.mark.slow
def test_snapshot_id_and_latest_oom_download_what_the_exporter_keeps(demo_env, tmp_path):
    """`snapshot --id ID` and `--latest-oom` take no new snapshot: they download one the
    exporter lists (the OOM's, taken by its observer at the OOM); bad or unknown ids are one
    line each."""
    from exporter.actions.snapshots import SnapshotStore

    env, token_file = demo_env
    flags = ["--url", "", "--token-file", str(token_file)]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return run_cli("snapshot", *flags, *args)

    with running("demo", env=env) as url:
        flags[1] = url
        taken = cli("-o", str(tmp_path / "taken.pickle"), "--json")
        assert taken.returncode == 0, taken.stderr
        [api] = json.loads(taken.stdout)["written"]
        none = cli("--latest-oom", "-o", str(tmp_path / "none.pickle"))
        assert none.returncode == 2 and none.stderr.count("\n") == 1
        assert "no snapshot taken at an OOM among the 1 this exporter keeps" in none.stderr
        # What the OOM observer writes at an OOM, into the folder the exporter keeps.
        oom = {"segments": [{"device": 0, "total_size": 2 << 20, "blocks": []}], "at": "oom"}
        process = {"pid": "4242", "rank": "0", "local_rank": "0", "role": "worker"}
        store = SnapshotStore(tmp_path / "snaps", process=process)
        kept = store.write(oom, "oom", device=0, meta={"process": process})
        got = cli("--latest-oom", "-o", str(tmp_path))
        assert got.returncode == 0, got.stderr
        assert pickle.loads((tmp_path / kept.filename).read_bytes()) == oom
        assert f"snapshot {kept.id} of pid 4242 rank 0 (worker) (oom)" in got.stdout
        by_id = cli("--id", api["id"], "-o", str(tmp_path / "again.pickle"))
        assert by_id.returncode == 0, by_id.stderr
        again = (tmp_path / "again.pickle").read_bytes()
        assert again == (tmp_path / "taken.pickle").read_bytes()
        bad = cli("--id", "../../etc/passwd", "-o", str(tmp_path / "x.pickle"))
        assert bad.returncode == 2 and "not a snapshot id" in bad.stderr
        unknown = cli("--id", "20990101T000000Z-deadbeef", "-o", str(tmp_path / "x.pickle"))
        assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1
        assert "no snapshot 20990101T000000Z-deadbeef among the 2" in unknown.stderr
        both = cli("--id", api["id"], "--record-s", "1", "-o", str(tmp_path / "x.pickle"))
        assert both.returncode == 2 and "not allowed with argument" in both.stderr
        assert not (tmp_path / "x.pickle").exists()


@pytest.mark.slow
def test_view_takes_a_snapshots_url_on_the_exporter(demo_env, tmp_path):
    """`view URL` (as /snapshots and the live page list them) downloads with the admin token
    and renders offline; a URL that names no snapshot, or no token, is one line."""
    env, token_file = demo_env
    with running("demo", env=env) as url:
        taken = run_cli(
            "snapshot", "--url", url, "--token-file", str(token_file), "-o",
            str(tmp_path / "s.pickle"), "--json",
        )  # fmt: skip
        assert taken.returncode == 0, taken.stderr
        [entry] = json.loads(taken.stdout)["written"]
        html = tmp_path / "view.html"
        viewed = run_cli(
            "view", f"{url}/snapshots/{entry['id']}/view", "--token-file", str(token_file),
            "-o", str(html),
        )  # fmt: skip
        assert viewed.returncode == 0, viewed.stderr
        page = html.read_text()
        assert page.startswith("<!") and "https://" not in page and entry["id"] in page
        assert not list(tmp_path.glob("gpumem-view-*"))  # the download went with the run
        bad = run_cli("view", f"{url}/metrics", "-o", str(tmp_path / "x.html"))
        assert bad.returncode == 2 and "is not a snapshot's URL" in bad.stderr
        no_token = run_cli(
            "view", f"{url}/snapshots/{entry['id']}", "-o", str(tmp_path / "x.html"),
            env={"GPUMEM_ADMIN_TOKEN_FILE": ""},
        )  # fmt: skip
        assert no_token.returncode == 2 and no_token.stderr.count("\n") == 1
        assert "HTTP 401" in no_token.stderr and not (tmp_path / "x.html").exists()


@pytest.mark.slow
def test_client_errors_are_one_line(demo_env, tmp_path):
    env, _ = demo_env
    wrong = tmp_path / "wrong"
    wrong.write_text("nope")
    with running("demo", env=env) as url:
        proc = run_cli(
            "snapshot", "--url", url, "--token-file", str(wrong), "-o", str(tmp_path / "x")
        )
        assert proc.returncode == 2 and "HTTP 401" in proc.stderr
        assert proc.stderr.count("\n") == 1
        # No token on this side, one configured on the server's: it says what to pass.
        no_token = run_cli("empty-cache", "--url", url, env={"GPUMEM_ADMIN_TOKEN_FILE": ""})
        assert no_token.returncode == 2 and no_token.stderr.count("\n") == 1
        assert "asks for an admin token: pass --token-file" in no_token.stderr
    missing = run_cli("view", str(tmp_path / "nope.pickle"), "-o", str(tmp_path / "x.html"))
    assert missing.returncode == 2 and "nope.pickle" in missing.stderr
    not_pickle = tmp_path / "bad.pickle"
    not_pickle.write_text("hello")
    bad = run_cli("view", str(not_pickle), "-o", str(tmp_path / "x.html"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_the_cli_works_with_the_demo_without_a_token(tmp_path):
    """The demo asks for no token (its page buttons need none), and neither does the CLI;
    `snapshot` takes the same URL forms as `record`; lines for people unless --json."""
    env = {"GPUMEM_SNAPSHOT_DIR": str(tmp_path / "snaps")}
    with running("demo", env=env) as url:
        out = tmp_path / "snap.pickle"
        proc = run_cli("snapshot", "--url", url + "/metrics", "-o", str(out), env=env)
        assert proc.returncode == 0, proc.stderr
        assert pickle.loads(out.read_bytes())["segments"]
        proc = run_cli("empty-cache", "--url", url + "/", env=env)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[0] == "replay of recorded data: nothing in a real process was changed"
        assert re.match(r"pid \d+ \(server\): would release [\d.]+ [MG]iB; ", lines[1]), lines
        assert re.search(r"; recorded second [\d.]+ of the replayed trace; ", lines[1]), lines
        as_json = run_cli(
            "snapshot", "--url", url, "-o", str(tmp_path / "j.pickle"), "--json", env=env
        )
        (written,) = json.loads(as_json.stdout)["written"]
        assert Path(written["path"]).stat().st_size == written["bytes"] > 0
        history = run_cli("history", "status", "--url", url, "--json", env=env)
        assert history.returncode == 0 and json.loads(history.stdout)["replay"] is True
        # A GET action carries the selection in its query: no process of the demo has pid 1.
        other = run_cli("history", "status", "--url", url, "--pid", "1", env=env)
        assert other.returncode == 2 and "no process matches pid 1" in other.stderr, other
        bad = run_cli("reset-peak", "--url", url + "/snapshots", env=env)
        assert bad.returncode == 2 and "base or /metrics URL" in bad.stderr


@pytest.mark.slow
def test_no_request_gets_a_server_error(demo_env, tmp_path):
    # schemathesis is in the test extra: its `st` sits next to this interpreter.
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or require_tool("st")
    env, _ = demo_env
    with running("demo", env=env) as url:
        proc = subprocess.run(
            [
                st,
                "run",
                f"{url}/openapi.json",
                "--checks",
                "not_a_server_error",
                "-H",
                f"Authorization: Bearer {TOKEN}",
                "-n",
                "30",
                "--generation-deterministic",
                "--request-timeout",
                "10",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,  # schemathesis keeps a .schemathesis/ folder in its cwd
        )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    # It really exercised every operation (the admin ones authenticated) with many cases.
    tested = re.search(r"Tested: (\d+)", proc.stdout)
    cases = re.search(r"(\d+) generated, (\d+) passed", proc.stdout)
    assert tested and int(tested.group(1)) >= 13, proc.stdout[-3000:]
    assert cases and int(cases.group(1)) >= 200 and cases.group(1) == cases.group(2)


def client_env(**variables: str) -> dict[str, str]:
    """The CLI's environment: this one without GPUMEM_ADMIN_*, plus `variables`."""
    kept = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEM_ADMIN_")}
    return {**kept, **variables}


@pytest.mark.slow
def test_the_client_takes_the_token_as_the_server_does(demo_env, tmp_path):
    """--token-file, else the file named by GPUMEM_ADMIN_TOKEN_FILE, else GPUMEM_ADMIN_TOKEN:
    a file over a token, the command line over the environment."""
    env, token_file = demo_env
    wrong = tmp_path / "wrong"
    wrong.write_text("nope\n")
    with running("demo", env=env) as url:

        def stats(*args: str, **variables: str) -> subprocess.CompletedProcess:
            return run_cli("stats", "--url", url, *args, env=client_env(**variables))

        assert stats(GPUMEM_ADMIN_TOKEN_FILE=str(token_file)).returncode == 0
        assert stats(GPUMEM_ADMIN_TOKEN=TOKEN).returncode == 0
        both = stats(GPUMEM_ADMIN_TOKEN_FILE=str(token_file), GPUMEM_ADMIN_TOKEN="nope")
        assert both.returncode == 0, both.stderr  # the file wins, as on the server
        flag = stats("--token-file", str(wrong), GPUMEM_ADMIN_TOKEN_FILE=str(token_file))
        assert flag.returncode == 2 and "HTTP 401" in flag.stderr  # the command line wins


@pytest.mark.parametrize(
    ("content", "use_flag", "message"),
    [
        (None, False, "GPUMEM_ADMIN_TOKEN_FILE: cannot read admin token file {path}: No such file"),
        ("  \n", False, "GPUMEM_ADMIN_TOKEN_FILE: admin token file {path} is empty"),
        ("\n", True, "--token-file: admin token file {path} is empty"),
        (b"\xff\xfe", True, "--token-file: admin token file {path} is not text"),
    ],
)
def test_a_token_file_that_gives_no_token_is_a_one_line_error(
    content, use_flag, message, tmp_path, monkeypatch, capsys
):
    from exporter.cli import main

    path = tmp_path / "token"
    if isinstance(content, str):
        path.write_text(content)
    elif content is not None:
        path.write_bytes(content)
    for name in ("GPUMEM_ADMIN_TOKEN", "GPUMEM_ADMIN_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GPUMEM_ADMIN_TOKEN", TOKEN)  # never a silent fall back to it
    args = ["stats", "--url", "http://127.0.0.1:9"]
    if use_flag:
        args += ["--token-file", str(path)]
    else:
        monkeypatch.setenv("GPUMEM_ADMIN_TOKEN_FILE", str(path))
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message.format(path=path) in err
    assert err.count("\n") == 1 and "Traceback" not in err


def _captured(verdict: str | None):
    from tests.helpers import captured_oom_samples

    for sample in captured_oom_samples():
        last = sample.allocators[0].last_oom
        if (last.verdict if last else None) == verdict:
            return sample
    raise LookupError(verdict)


@pytest.mark.slow
def test_why_prints_each_process_oom_verdict_with_its_numbers_and_action(tmp_path):
    """`why` against a demo replaying the readings of a fragmentation OOM made on an H100."""
    trace = trace_of_sample(tmp_path / "oom.jsonl.gz", _captured("fragmentation"))
    env = {"GPUMEM_SNAPSHOT_DIR": str(tmp_path / "s")}
    with running("demo", "--trace", str(trace), env=env) as url:
        proc = run_cli("why", "--url", url)
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout
        assert "cuda:0: 1 OOM(s) (fragmentation 1)" in out
        assert "latest at " in out and ": fragmentation\n" in out
        assert "why: asked 512 MiB; 3.19 GiB free in the cache between live tensors, " in out
        assert "largest free block 160 MiB" in out
        assert "do:  set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in out
        as_json = json.loads(run_cli("why", "--url", url, "--json").stdout)
        (device,) = as_json["devices"]
        assert device["last_oom"]["verdict"] == "fragmentation"
        assert device["ooms_by_verdict"] == {"fragmentation": 1}
        (row,) = as_json["ledgers"]
        reading = _captured("fragmentation").allocators[0]
        outside = reading.non_allocator_bytes or 0
        assert sum(row["parts"].values()) == reading.gauges["reserved_bytes"] + outside


@pytest.mark.slow
def test_why_without_an_oom_and_with_oom_counts_that_have_no_verdict(tmp_path):
    from dataclasses import replace

    from exporter.units import fmt_bytes

    env = {"GPUMEM_SNAPSHOT_DIR": str(tmp_path / "s")}
    quiet = trace_of_sample(tmp_path / "quiet.jsonl.gz", _captured(None))
    with running("demo", "--trace", str(quiet), env=env) as url:
        out = run_cli("why", "--url", url).stdout
    quiet_lines = out.splitlines()
    assert quiet_lines[0] == "no out-of-memory error in any process since the exporter started"
    # Then where the memory goes: the ledger's parts, summing to the total it says.
    assert quiet_lines[1] == "where the memory goes:"
    reading = _captured(None).allocators[0]
    total = reading.gauges["reserved_bytes"] + (reading.non_allocator_bytes or 0)
    assert re.match(r"  pid \d+ cuda:0: ", quiet_lines[2]), quiet_lines[2]
    assert f": {fmt_bytes(total)} = " in quiet_lines[2]
    assert " + other_live " in quiet_lines[2] and " + cached_free " in quiet_lines[2]
    # OOMs counted by the allocator with no verdict (before the observer was armed, or a
    # trace of an older exporter) are said to have none.
    sample = _captured("cap")
    reading = replace(sample.allocators[0], last_oom=None, ooms_by_verdict={})
    reading.counters = {**reading.counters, "ooms": 3}
    older = trace_of_sample(tmp_path / "older.jsonl.gz", replace(sample, allocators=[reading]))
    with running("demo", "--trace", str(older), env=env) as url:
        out = run_cli("why", "--url", url).stdout
    assert "cuda:0: 3 OOM(s)\n  3 without a verdict" in out


@pytest.mark.slow
def test_the_demo_keeps_its_snapshots_in_a_folder_of_its_own_removed_when_it_stops(tmp_path):
    """No shared per-user folder: a private one per demo, gone after SIGTERM (how `running`
    and Kubernetes stop it)."""
    import os

    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {"TMPDIR": str(temp), "GPUMEM_SNAPSHOT_DIR": ""}
    with running("demo", env=env) as url:
        proc = run_cli("snapshot", "--url", url, "-o", str(tmp_path / "s.pickle"))
        assert proc.returncode == 0, proc.stderr
        (folder,) = [p for p in temp.iterdir() if p.name.startswith("gpumem-demo-")]
        assert folder.stat().st_mode & 0o077 == 0 and any(folder.iterdir())
        assert not [p for p in temp.iterdir() if p.name.startswith("gpumem-snapshots")]
    assert not folder.exists(), os.listdir(temp)


@pytest.mark.slow
def test_why_prints_the_oom_snapshot_as_a_url_that_opens(tmp_path):
    """Issue 65: `why` printed the snapshot as a path (`snapshot: /snapshots/ID/view`), which
    opens nowhere. It is a URL on the exporter asked, and a browser gets the viewer there."""
    import urllib.error
    import urllib.request

    with running("demo", "--speed", "10") as url:
        deadline = time.monotonic() + 30
        out = ""
        while "snapshot: " not in out and time.monotonic() < deadline:  # the OOM at 42 s
            time.sleep(0.5)
            out = run_cli("why", "--url", url).stdout
        found = re.search(r"snapshot: (\S+)", out)
        assert found is not None, out
        link = found.group(1)
        assert re.fullmatch(re.escape(url) + r"/snapshots/[^/]+/view", link), link
        # The snapshot is written after the verdict (the recording's, 4 s after its OOM).
        while True:
            try:
                with urllib.request.urlopen(link, timeout=10) as page:
                    assert page.status == 200 and page.read(2) == b"<!"
                    break
            except urllib.error.HTTPError as error:
                assert error.code == 404 and time.monotonic() < deadline, error
                time.sleep(0.2)
