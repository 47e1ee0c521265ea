"""Every bad input, run through the real command: a non-zero exit, no traceback, and a message
naming the flag, the key with its path, or the file, with what would be right.

The configuration cases check what the command prints for errors ``kvhex.config`` raises at
load time; the endpoint cases bind real sockets (a port something else holds, an address of
no interface here).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli.command import kvhex

USAGE, NOTHING = 2, 3

HOST = "[primary]\ncapacity_bytes = 4194304\n"
TIER = (
    '[[tiers]]\ntype = "fsspec"\nname = "{name}"\n'
    'options = {{ url = "{url}", capacity_bytes = {cap} }}\n'
)
RUN = "[run]\nlayers = 2\npage_bytes = 4096\ndevice_blocks = 512\n"


def tier(root: Path, name: str = "disk", cap: int = 67108864, url: str | None = None) -> str:
    return TIER.format(name=name, url=root / name if url is None else url, cap=cap)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The bad (and the good) files the cases name, and a loopback port that is taken."""
    root = tmp_path_factory.mktemp("bad-inputs")
    configs = {
        "good": HOST + tier(root) + RUN,
        "syntax": "[primary\ncapacity_bytes = 3\n",
        "unknown_key": HOST + "colour = 'red'\n" + tier(root) + RUN,
        "misspelt": HOST + tier(root) + RUN + "requestz = 3\n",
        "threshold": HOST + "store_threshold = 2\n" + tier(root) + RUN,
        "duplicate": HOST + tier(root) + tier(root, url=root / "other") + RUN,
        "not_a_list": 'tiers = "fsspec"\n' + HOST + RUN,
        "empty_url": HOST + tier(root, url="") + RUN,
        "small_tier": HOST + tier(root, cap=1000) + RUN,
        "unknown_tier": HOST + tier(root).replace('"fsspec"', '"floppy"') + RUN,
        "unknown_transfer": HOST + tier(root) + RUN + 'transfer = "floppy"\n',
        "transfer_option": HOST + tier(root) + RUN + "transfer_options = { copy_thread = 2 }\n",
        "tier_option": HOST
        + '[[tiers]]\ntype = "fsspec"\noptions = { url = "x", capacity = 5 }\n'
        + RUN,
        "host_too_small": "[primary]\ncapacity_bytes = 4096\n" + tier(root) + RUN,
        "odd_page": HOST + tier(root) + RUN.replace("4096", "4100"),
        "few_device_blocks": HOST + tier(root) + RUN.replace("512", "16"),
        "negative_requests": HOST + tier(root) + RUN + "requests = -3\n",
        "bad_sink": HOST + tier(root) + RUN + '[[sinks]]\ntype = "zmq"\n'
        'options = { endpoint = "tcp://127.0.0.1:70000" }\n',
    }
    paths = {}
    for name, text in configs.items():
        path = root / f"{name}.toml"
        path.write_text(text)
        paths[name] = str(path)
    workloads = {
        "w_json": '{"length": 100}\n{"length": \n',
        "w_long": json.dumps({"length": 100_000}) + "\n",
        "w_prefix": json.dumps({"length": 64, "prefix_group": "a", "prefix_length": 500}) + "\n",
        "w_empty": "\n\n",
        "w_key": json.dumps({"length": 64, "colour": "red"}) + "\n",
        "w_tokens": json.dumps({"tokens": [1, "two", 3]}) + "\n",
    }
    for name, text in workloads.items():
        path = root / f"{name}.jsonl"
        path.write_text(text)
        paths[name] = str(path)
    empty = root / "empty-dir"
    empty.mkdir()
    paths["empty_dir"] = str(empty)
    paths["missing"] = str(root / "missing" / "nothing.here")
    paths["missing_toml"] = str(root / "missing.toml")
    paths["a_file"] = paths["good"]
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        paths["taken"] = f"tcp://127.0.0.1:{held.getsockname()[1]}"
        paths["taken_addr"] = f"127.0.0.1:{held.getsockname()[1]}"
        yield paths


CASES = [
    # -- the frame ---------------------------------------------------------------------------
    ("no-command", [], USAGE, ["COMMAND"]),
    ("unknown-command", ["frobnicate"], USAGE, ["invalid choice: 'frobnicate'"]),
    ("log-format", ["--log-format", "xml", "tiers"], USAGE, ["--log-format", "'xml'"]),
    # -- kvhex run: flags --------------------------------------------------------------------
    ("requests-0", ["run", "--requests", "0"], USAGE, ["--requests", "must be above 0"]),
    ("requests-text", ["run", "--requests", "many"], USAGE, ["--requests", "not a number"]),
    ("duration-neg", ["run", "--duration", "-1"], USAGE, ["--duration", "above 0"]),
    ("duration-nan", ["run", "--duration", "nan"], USAGE, ["--duration", "finite"]),
    ("duration-inf", ["run", "--duration", "inf"], USAGE, ["--duration", "finite"]),
    ("tier-capacity", ["run", "--tier-capacity", "lots"], USAGE, ["--tier-capacity", "512MiB"]),
    (
        "metrics-addr-port",
        ["run", "--metrics-addr", "9400"],
        USAGE,
        ["--metrics-addr", "'9400' is not HOST:PORT"],
    ),
    (
        "metrics-addr-host",
        ["run", "--metrics-addr", "metrics.example:9400"],
        USAGE,
        ["--metrics-addr", "is not an IP address"],
    ),
    (
        "metrics-addr-in-use",
        ["run", "--config", "{good}", "--metrics-addr", "{taken_addr}"],
        USAGE,
        ["--metrics-addr {taken_addr}", "cannot listen there"],
    ),
    ("metrics-hold-alone", ["run", "--metrics-hold", "5"], USAGE, ["--metrics-hold", "none is"]),
    ("tier-capacity-inf", ["run", "--tier-capacity", "1e400"], USAGE, ["--tier-capacity"]),
    ("host-capacity-0", ["run", "--host-capacity", "0"], USAGE, ["--host-capacity", "than 0"]),
    ("device", ["run", "--device", "gpu"], USAGE, ["--device", "'gpu'", "'cuda'"]),
    ("transfer-name", ["run", "--transfer", "Torch"], USAGE, ["--transfer", "entry-point name"]),
    (
        "transfer-unknown",
        ["run", "--config", "{good}", "--transfer", "floppy"],
        USAGE,
        ["$.run.transfer (from --transfer floppy)", "'floppy'", "available: memory, torch"],
    ),
    ("unknown-flag", ["run", "--frobnicate"], USAGE, ["--frobnicate"]),
    ("empty-tier", ["run", "--tier", " "], USAGE, ["--tier", "must not be empty"]),
    (
        "s3-endpoint-alone",
        ["run", "--s3-endpoint", "http://127.0.0.1:9000"],
        USAGE,
        ["--s3-endpoint", "no s3:// tier", "--tier s3://BUCKET/PREFIX"],
    ),
    (
        "s3-endpoint-file-tier",
        ["run", "--tier", "{empty_dir}", "--s3-endpoint", "http://127.0.0.1:9000"],
        USAGE,
        ["--s3-endpoint", "no s3:// tier"],
    ),
    (
        "tier-capacity-alone",
        ["run", "--tier-capacity", "1GiB"],
        USAGE,
        ["--tier-capacity", "add --tier URL"],
    ),
    (
        "replay-alone",
        ["run", "--events-replay", "tcp://127.0.0.1:5558"],
        USAGE,
        ["--events-replay", "no --events is a ZMQ endpoint"],
    ),
    # -- kvhex run: endpoints ----------------------------------------------------------------
    ("port-range", ["run", "--events", "tcp://127.0.0.1:99999"], USAGE, ["--events", "1-65535"]),
    ("port-text", ["run", "--events", "tcp://127.0.0.1:http"], USAGE, ["--events", "'http'"]),
    ("no-port", ["run", "--events", "tcp://127.0.0.1"], USAGE, ["--events", "tcp://HOST:PORT"]),
    (
        "protocol",
        ["run", "--events", "udp://127.0.0.1:5557"],
        USAGE,
        ["--events udp://127.0.0.1:5557", "transport 'udp'", "tcp://HOST:PORT"],
    ),
    ("inproc", ["run", "--events", "inproc://kv"], USAGE, ["--events", "only this process"]),
    (
        "replay-protocol",
        ["run", "--events", "tcp://127.0.0.1:*", "--events-replay", "epgm://x:1"],
        USAGE,
        ["--events-replay", "transport 'epgm'"],
    ),
    (
        "port-in-use",
        ["run", "--events", "{taken}"],
        USAGE,
        ["from --events {taken}", "address already in use", "pick a free port"],
    ),
    (
        "replay-port-in-use",
        ["run", "--events", "tcp://127.0.0.1:*", "--events-replay", "{taken}"],
        USAGE,
        ["replay_endpoint", "--events-replay {taken}", "address already in use"],
    ),
    (
        "foreign-address",
        ["run", "--events", "tcp://192.0.2.1:5557"],
        USAGE,
        ["--events tcp://192.0.2.1:5557", "no interface of this machine has that address"],
    ),
    (
        "events-file-dir",
        ["run", "--events", "{missing}"],
        USAGE,
        ["--events {missing}", "cannot write it", "No such file"],
    ),
    # -- kvhex run: configuration files ------------------------------------------------------
    (
        "config-missing",
        ["run", "--config", "{missing_toml}"],
        USAGE,
        ["{missing_toml}", "cannot read"],
    ),
    ("config-syntax", ["run", "--config", "{syntax}"], USAGE, ["{syntax}", "not valid TOML"]),
    (
        "config-unknown-key",
        ["run", "--config", "{unknown_key}"],
        USAGE,
        ["{unknown_key}", "$.primary.colour", "unknown key"],
    ),
    (
        "config-misspelt",
        ["run", "--config", "{misspelt}"],
        USAGE,
        ["$.run.requestz", "did you mean 'requests'"],
    ),
    (
        "config-threshold",
        ["run", "--config", "{threshold}"],
        USAGE,
        ["$.primary.store_threshold", "store_threshold >= 2", "secondary tiers"],
    ),
    (
        "config-duplicate",
        ["run", "--config", "{duplicate}"],
        USAGE,
        ["$.tiers[1].name", "'disk'", "already used by $.tiers[0]"],
    ),
    (
        "config-not-a-list",
        ["run", "--config", "{not_a_list}"],
        USAGE,
        ["$.tiers", "expected a list"],
    ),
    (
        "config-empty-url",
        ["run", "--config", "{empty_url}"],
        USAGE,
        ["$.tiers[0].options.url", "must not be empty"],
    ),
    (
        "config-small-tier",
        ["run", "--config", "{small_tier}"],
        USAGE,
        ["$.tiers[0].options.capacity_bytes", "hold no block"],
    ),
    (
        "config-unknown-tier",
        ["run", "--config", "{unknown_tier}"],
        USAGE,
        ["$.tiers[0].type", "'floppy'", "available: "],
    ),
    (
        "config-unknown-transfer",
        ["run", "--config", "{unknown_transfer}"],
        USAGE,
        ["$.run.transfer", "unknown transfer 'floppy'; available: memory, torch"],
    ),
    (
        "config-transfer-option",
        ["run", "--config", "{transfer_option}"],
        USAGE,
        ["$.run.transfer_options.copy_thread", "unexpected keyword argument"],
    ),
    (
        "config-tier-option",
        ["run", "--config", "{tier_option}"],
        USAGE,
        ["$.tiers[0].options.capacity:", "$.tiers[0].options.capacity_bytes", "missing"],
    ),
    (
        "config-host-too-small",
        ["run", "--config", "{host_too_small}"],
        USAGE,
        ["$.primary.capacity_bytes", "hold no chunk"],
    ),
    (
        "config-odd-page",
        ["run", "--config", "{odd_page}"],
        USAGE,
        ["$.run.page_bytes", "multiple of 8"],
    ),
    (
        "config-few-device-blocks",
        ["run", "--config", "{few_device_blocks}"],
        USAGE,
        ["$.run.device_blocks", "[run].device_blocks = 16", "raise [run].device_blocks"],
    ),
    (
        "config-negative-requests",
        ["run", "--config", "{negative_requests}"],
        USAGE,
        ["$.run.requests", "-3"],
    ),
    (
        "config-bad-sink",
        ["run", "--config", "{bad_sink}"],
        USAGE,
        ["$.sinks[0]", "tcp://127.0.0.1:70000", "out of range"],
    ),
    # -- kvhex run: workload files -----------------------------------------------------------
    ("workload-missing", ["run", "--workload", "{missing}"], USAGE, ["{missing}", "cannot read"]),
    (
        "workload-json",
        ["run", "--workload", "{w_json}"],
        USAGE,
        ["{w_json}", "line 2", "not valid JSON"],
    ),
    (
        "workload-too-long",
        ["run", "--config", "{good}", "--workload", "{w_long}"],
        USAGE,
        ["{w_long}", "line 1.length", "[run].device_blocks = 512", "at least"],
    ),
    (
        "workload-prefix",
        ["run", "--workload", "{w_prefix}"],
        USAGE,
        ["line 1.prefix_length", "longer than the prompt", "at most 64"],
    ),
    ("workload-empty", ["run", "--workload", "{w_empty}"], USAGE, ["{w_empty}", "no request"]),
    (
        "workload-key",
        ["run", "--workload", "{w_key}"],
        USAGE,
        ["line 1.colour", "unknown key", "known keys"],
    ),
    ("workload-tokens", ["run", "--workload", "{w_tokens}"], USAGE, ["line 1.tokens"]),
    # -- kvhex bench -------------------------------------------------------------------------
    ("bench-timeout-neg", ["bench", "--timeout", "-1"], USAGE, ["--timeout", "above 0"]),
    ("bench-timeout-0", ["bench", "--timeout", "0"], USAGE, ["--timeout", "above 0"]),
    ("bench-only", ["bench", "--only", "nope"], USAGE, ["--only", "'nope'", "primary_tier"]),
    (
        "bench-dir",
        ["bench", "--bench-dir", "{empty_dir}"],
        USAGE,
        ["{empty_dir}"],
    ),
    # -- kvhex events ------------------------------------------------------------------------
    ("events-no-endpoint", ["events"], USAGE, ["ENDPOINT"]),
    ("events-count", ["events", "tcp://127.0.0.1:1", "--count", "0"], USAGE, ["--count"]),
    ("events-seq", ["events", "tcp://127.0.0.1:1", "--from-seq", "-1"], USAGE, ["--from-seq"]),
    (
        "events-nothing",
        ["events", "{missing}"],
        USAGE,
        ["ENDPOINT {missing}", "neither a ZMQ endpoint", "no such file"],
    ),
    (
        "events-dir",
        ["events", "{empty_dir}"],
        USAGE,
        ["ENDPOINT {empty_dir}", "a directory"],
    ),
    ("events-port", ["events", "tcp://127.0.0.1:0"], USAGE, ["ENDPOINT", "out of range"]),
    ("events-star", ["events", "tcp://127.0.0.1:*"], USAGE, ["ENDPOINT", "cannot connect"]),
    ("events-protocol", ["events", "udp://127.0.0.1:1"], USAGE, ["ENDPOINT", "'udp'"]),
    (
        "events-replay-protocol",
        ["events", "tcp://127.0.0.1:1", "--replay", "udp://x:1"],
        USAGE,
        ["--replay udp://x:1", "'udp'"],
    ),
    (
        "events-from-seq-alone",
        ["events", "tcp://127.0.0.1:1", "--from-seq", "4"],
        USAGE,
        ["--from-seq", "--replay, which is not given"],
    ),
    (
        "events-file-flags",
        ["events", "{good}", "--replay", "tcp://127.0.0.1:1"],
        USAGE,
        ["--replay", "read as a JSONL FILE"],
    ),
    (
        "events-bind-in-use",
        ["events", "{taken}", "--bind", "--duration", "1"],
        USAGE,
        ["ENDPOINT {taken}", "address already in use"],
    ),
    # -- kvhex fsck and tiers ----------------------------------------------------------------
    ("fsck-missing", ["fsck", "{missing}"], USAGE, ["ROOT {missing}", "no such directory"]),
    ("fsck-file", ["fsck", "{a_file}"], USAGE, ["ROOT {a_file}", "not a directory"]),
    ("fsck-empty", ["fsck", "{empty_dir}"], NOTHING, ["{empty_dir} holds no kvhex tier"]),
    ("tiers-group", ["tiers", "--group", "x"], USAGE, ["--group", "'x'"]),
]


@pytest.mark.parametrize(("name", "args", "status", "words"), CASES, ids=[c[0] for c in CASES])
def test_a_bad_input_is_a_clear_error(
    files: dict[str, str], name: str, args: list[str], status: int, words: list[str]
) -> None:
    done = kvhex(*(a.format(**files) for a in args), timeout=180)
    said = done.stderr
    assert done.returncode == status, f"{name}: {done.returncode}\n{said}\n{done.stdout}"
    assert "Traceback" not in said + done.stdout
    for word in words:
        assert word.format(**files) in said, f"{name}: {word!r} not in:\n{said}"
    if status == USAGE and args and args[0] in ("run", "fsck", "events"):
        assert done.stdout == ""  # nothing ran, so nothing is reported
