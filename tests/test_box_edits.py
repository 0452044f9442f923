"""Box edits as an operator makes them (issues 27.1-2, 20.3, 20.5, 20.10): one validator for the
CLI, the boxes file and the admin API; a bad or deleted boxes file never freezes the fleet or
crashes the service; `boxes set` keeps what it does not name; a box that is this router is
refused."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys

import pytest

from conftest import ROOT, RouterProcess, wait_for, write_boxes
from router.boxes import config
from router.sim import SimBox, SimFleet
from support.url_calls import chat_body, request

KEY = "hpk_box_Zm9vYmFyLWtleS1zZWNyZXQtdmFsdWUtMTIzNDU2"
WRITER = str(ROOT / "tests" / "hugpy_store_writer.py")

# (a field the operator gives, its value, what the one-line refusal says)
BAD_FIELDS = [
    ("url", "http://10.0.0.5:99999", "port must be 1-65535"),
    ("url", "http://10.0.0.5:-1", "port must be 1-65535"),
    ("url", "http://10.0.0.5:http", "port must be 1-65535"),
    ("url", "http://10.0.0.5:0", "port must be 1-65535"),
    ("url", "http://gpu box:8000", "without spaces"),
    ("url", "http://gpu\tbox:8000", "without spaces"),
    ("url", "http://bad..host:8000", "no valid host"),
    ("url", "ftp://10.0.0.5:21", "must be http:// or https://"),
    ("url", "http://admin:hunter2@10.0.0.5:8000", "user or password"),
    ("url", "http://10.0.0.5:8000/#x", "path, query or fragment"),
    ("url", "http://10.0.0.5:8000/v1", "path, query or fragment"),
    ("agent", "https://10.0.0.5:9400", "agent must be http://"),
    ("agent", "http://10.0.0.5:70000", "agent port must be 1-65535"),
    ("key", "hpk_box_x\r\nX-Injected: 1", "visible ASCII"),
    ("key", "hpk box", "visible ASCII"),
    ("pool", "lab\u202e", "printable"),
    ("pool", "x" * 300, "over 256 bytes"),
    ("store", "relative/fitevict.sqlite3", "absolute path"),
    ("store", "/etc/passwd", "not a SQLite database"),
    ("store", "/nonexistent/fitevict.sqlite3", "no such file"),
]


def boxes_cli(path, *args):
    return subprocess.run([sys.executable, "-m", "router", "boxes", "--boxes-file", str(path), *args],
                          capture_output=True, text=True, timeout=30, cwd=ROOT)


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def wrapper_store(path) -> str:
    subprocess.run([sys.executable, WRITER, str(path), "a"], input="model tiny\nquit\n", text=True,
                   check=True, capture_output=True)
    return str(path)


def test_the_cli_refuses_every_bad_field_with_one_line_and_writes_nothing(tmp_path):
    path = tmp_path / "boxes.json"
    assert boxes_cli(path, "add", "--name", "a", "--url", "http://127.0.0.1:1", "--key", KEY).returncode == 0
    before = path.read_bytes()
    for field, value, says in BAD_FIELDS:
        done = boxes_cli(path, "add", "--name", "b", "--url", value if field == "url" else "http://10.0.0.5:1",
                         *([f"--{field}", value] if field != "url" else []))
        assert done.returncode == 2, (field, value, done.stderr)
        line = one_line(done.stderr)
        assert says in line and "box b" in line, (field, value, line)
        assert "hunter2" not in line and "X-Injected" not in line  # a secret is never echoed
        assert path.read_bytes() == before
    bad_set = boxes_cli(path, "set", "a", "--agent", "http://h:99999")
    assert bad_set.returncode == 2 and "agent port" in one_line(bad_set.stderr)
    assert path.read_bytes() == before


def test_the_cli_takes_https_and_a_real_wrapper_store(tmp_path):
    path = tmp_path / "boxes.json"
    store = wrapper_store(tmp_path / "fitevict.sqlite3")
    done = boxes_cli(path, "add", "--name", "a", "--url", "https://gpu-1.lan:8443", "--store", store)
    assert done.returncode == 0, done.stderr
    assert config.load(path).find("a").store == store
    plain = tmp_path / "other.sqlite3"
    sqlite3.connect(plain).execute("CREATE TABLE t (x)").connection.close()
    done = boxes_cli(path, "set", "a", "--store", str(plain))
    assert done.returncode == 2 and "not a hugpy-wrapper store" in one_line(done.stderr)


def test_the_admin_api_refuses_every_bad_field_with_400_and_writes_nothing(start_fleet_in_process):
    router = start_fleet_in_process(SimBox("a", catalog=["tiny"]))
    before = router.boxes_path.read_bytes()
    for field, value, says in BAD_FIELDS:
        doc = {"name": "b", "url": "http://10.0.0.5:1", field: value}
        status, data = request(router.url, "POST", "/v1/boxes", json.dumps(doc).encode())
        error = json.loads(data)["error"]
        assert (status, error["code"]) == (400, "invalid_box"), (field, value, error)
        assert says in error["message"] and b"hunter2" not in data and b"X-Injected" not in data
        if field != "url":  # PUT: the same rules for a field it may change
            status, data = request(router.url, "PUT", "/v1/boxes/a", json.dumps({field: value}).encode())
            assert status == 400 and says in json.loads(data)["error"]["message"], (field, value, data)
    for doc in ({"url": "http://10.0.0.5:2"}, {"name": "z"}, {"blocked": "yes"}, {"max_inflight": "5"},
                {"max_inflight": 0}, {"kind": ["hugpy"]}):
        status, data = request(router.url, "PUT", "/v1/boxes/a", json.dumps(doc).encode())
        assert status == 400 and json.loads(data)["error"]["code"] == "invalid_box", (doc, data)
    assert router.boxes_path.read_bytes() == before
    assert request(router.url, "POST", "/v1/chat/completions", chat_body())[0] == 200  # a still serves


@pytest.mark.parametrize("entry, says", [
    ({"url": "http://127.0.0.1:99999"}, "port must be 1-65535"),
    ({"url": "http://gpu box:1"}, "without spaces"),
    ({"url": "http://127.0.0.1:1", "max_inflight": -1}, "max_inflight must be an integer 1-100000"),
    ({"url": "http://127.0.0.1:1", "max_inflight": 10**9}, "max_inflight must be an integer 1-100000"),
    ({"url": "http://127.0.0.1:1", "max_inflight": "8"}, "max_inflight must be an integer"),
    ({"url": "http://127.0.0.1:1", "max_inflight": 2.5}, "max_inflight must be an integer"),
    ({"url": "http://127.0.0.1:1", "max_inflight": True}, "max_inflight must be an integer"),
    ({"url": "http://127.0.0.1:1", "blocked": "false"}, "blocked must be true or false"),
    ({"url": "http://127.0.0.1:1", "kind": "vllm"}, "kind must be one of"),
    ({"url": "http://admin:hunter2@127.0.0.1:1"}, "user or password"),
    ({"url": "http://127.0.0.1:1/?token=hunter2"}, "path, query or fragment"),
    ({"url": "http://127.0.0.1:1", "key": "hpk_box_hunter2\r\nX-Injected: 1"}, "visible ASCII"),
])
def test_serve_on_a_corrupt_boxes_file_exits_2_naming_the_file_the_entry_and_why(tmp_path, entry, says):
    path = tmp_path / "boxes.json"
    path.write_text(json.dumps({"boxes": [{"name": "ok", "url": "http://127.0.0.1:2"}, {"name": "gpu9", **entry}]}))
    done = subprocess.run([sys.executable, "-m", "router", "serve", "--port", "auto", "--boxes-file", str(path)],
                          capture_output=True, text=True, timeout=30, cwd=ROOT,
                          env={"HUGPY_ROUTER_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2
    line = one_line(done.stderr)
    assert f"boxes file {path}, entry 2: box gpu9:" in line and says in line, line
    assert "hunter2" not in line  # a secret in a bad entry is never shown


def test_a_bad_edit_of_the_file_is_not_applied_and_the_next_good_one_is(start_fleet_in_process):
    a, b = SimBox("a", catalog=["tiny"], residents=["tiny"]), SimBox("b", catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(a)
    others = SimFleet([b])
    others.start()
    try:
        path = router.boxes_path
        good = path.read_text()
        path.write_text(json.dumps({"boxes": [*json.loads(good)["boxes"], {"name": "b", "url": "http://127.0.0.1:99999"}]}))
        refused = f"boxes file {path}, entry 2: box b: url port must be 1-65535"
        assert wait_for(lambda: refused in router.log_text(), 5)
        assert "not applied, the last good fleet (1 boxes) keeps serving" in router.log_text()
        router.signal(signal.SIGHUP)  # a unit's ExecReload: the same line, and no traceback
        assert wait_for(lambda: "(1 boxes, the file not applied) and keys" in router.log_text(), 5)
        # the fleet is the last good one, and still serves
        assert request(router.url, "POST", "/v1/chat/completions", chat_body())[0] == 200
        # later edits still apply: the watch goes on
        write_boxes(path, [a, b])
        assert wait_for(lambda: request(router.url, "POST", "/v1/chat/completions", chat_body(),
                                        {"X-Router-Box": "b"})[0] == 200, 5, 0.1)
        assert router.log_text().count(refused) == 2  # once per reload (watch, SIGHUP), not at every check
        assert "Traceback" not in router.log_text()
    finally:
        others.stop()


def test_a_deleted_boxes_file_keeps_the_last_fleet_and_warns(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(a)
    path = router.boxes_path
    path.unlink()
    assert wait_for(lambda: f"boxes file {path} is gone: the last fleet (1 boxes) keeps serving" in router.log_text(), 5)
    assert request(router.url, "POST", "/v1/chat/completions", chat_body())[0] == 200
    path.write_text(json.dumps({"boxes": []}))  # an empty fleet is written, never assumed
    assert wait_for(lambda: request(router.url, "POST", "/v1/chat/completions", chat_body())[0] == 503, 5, 0.1)


def test_boxes_set_changes_only_what_it_names_live(start_fleet_in_process):
    a = SimBox("a", key=KEY, catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(a, boxes_extra={"a": {"pool": "lab"}})
    path = router.boxes_path
    done = boxes_cli(path, "set", "a", "--max-inflight", "3")
    assert done.returncode == 0, done.stderr
    box = config.load(path).find("a")
    assert (box.max_inflight, box.key, box.pool) == (3, KEY, "lab")  # the key and pool stay

    def state_limit():
        doc = json.loads(request(router.url, "GET", "/v1/router/state")[1])
        return doc["boxes"][0]["max_inflight"]

    assert wait_for(lambda: state_limit() == 3, 5, 0.1)  # live, through the file watch
    assert boxes_cli(path, "set", "a", "--max-inflight", "none", "--pool", "").returncode == 0
    box = config.load(path).find("a")
    assert (box.max_inflight, box.pool, box.key) == (None, None, KEY)
    assert boxes_cli(path, "set", "zz", "--pool", "p").returncode == 1
    assert boxes_cli(path, "set", "a").returncode == 2  # nothing named
    # `set --key-file` changes the key; the API's PUT takes a key too, and keeps it out of answers
    key_file = path.parent / "wrapper.env"
    key_file.write_text("FITEVICT_TOKEN=hpk_box_other\n")
    assert boxes_cli(path, "set", "a", "--key-file", str(key_file)).returncode == 0
    assert config.load(path).find("a").key == "hpk_box_other"
    status, data = request(router.url, "PUT", "/v1/boxes/a", json.dumps({"key": KEY}).encode())
    assert status == 200 and KEY.encode() not in data and json.loads(data)["has_key"] is True


def test_boxes_add_over_a_name_refuses_unless_replace_and_says_when_a_key_is_dropped(tmp_path):
    path = tmp_path / "boxes.json"
    assert boxes_cli(path, "add", "--name", "a", "--url", "http://127.0.0.1:1", "--key", KEY).returncode == 0
    again = boxes_cli(path, "add", "--name", "a", "--url", "http://127.0.0.1:1", "--max-inflight", "4")
    assert again.returncode == 1
    assert "already in" in again.stderr and "boxes set a" in again.stderr and "--replace" in again.stderr
    assert config.load(path).find("a").key == KEY  # nothing changed
    replaced = boxes_cli(path, "add", "--name", "a", "--url", "http://127.0.0.1:1", "--replace")
    assert replaced.returncode == 0 and "replaced" in replaced.stdout
    assert "key was dropped" in replaced.stderr and KEY not in replaced.stderr
    assert config.load(path).find("a").key is None


def test_the_admin_api_says_when_a_replace_drops_the_key(start_fleet_in_process):
    router = start_fleet_in_process(SimBox("a", key=KEY, catalog=["tiny"]))
    status, data = request(router.url, "POST", "/v1/boxes", json.dumps({"name": "a", "url": "http://127.0.0.1:9"}).encode())
    assert status == 200 and json.loads(data)["key_dropped"] is True


def test_a_box_that_is_this_router_is_refused(start_fleet_in_process):
    router = start_fleet_in_process(SimBox("a", catalog=["tiny"]))
    port = router.url.rsplit(":", 1)[1]
    path = router.boxes_path
    before = path.read_bytes()
    for url in (router.url, f"http://localhost:{port}", f"http://[::1]:{port}"):
        status, data = request(router.url, "POST", "/v1/boxes", json.dumps({"name": "loop", "url": url}).encode())
        error = json.loads(data)["error"]
        assert (status, error["code"]) == (400, "invalid_box") and "this router's own listener" in error["message"]
    # the CLI reads the running router's listeners beside the boxes file
    done = boxes_cli(path, "add", "--name", "loop", "--url", f"http://localhost:{port}")
    assert done.returncode == 2 and "this router's own listener" in one_line(done.stderr)
    assert path.read_bytes() == before
    # another port on this machine is another server
    assert boxes_cli(path, "add", "--name", "other", "--url", "http://127.0.0.1:9").returncode == 0

    def names() -> list[str]:
        return [b["name"] for b in json.loads(request(router.url, "GET", "/v1/boxes")[1])["boxes"]]

    assert wait_for(lambda: names() == ["a", "other"], 5, 0.1)
    # an editor that writes the file by hand: the reload refuses it and the fleet stays
    doc = json.loads(path.read_text())
    doc["boxes"].append({"name": "loop", "url": router.url})
    path.write_text(json.dumps(doc))
    assert wait_for(lambda: "entry 3: box loop: url" in router.log_text(), 5)
    assert names() == ["a", "other"]


def test_a_stopped_router_leaves_no_listeners_record(tmp_path):
    path = write_boxes(tmp_path / "boxes.json", [])
    router = RouterProcess(path)
    record = tmp_path / "boxes.json.listeners"
    assert wait_for(record.exists, 5)
    assert router.stop() == 0
    assert not record.exists()


def test_a_bad_name_is_refused_before_any_message_names_the_box(tmp_path):
    """The entry's name goes into every later message: a newline in it would forge a log line."""
    doc = {"boxes": [{"name": "gpu9\nWARNING forged", "url": "http://127.0.0.1:1", "kind": "vllm"}]}
    with pytest.raises(config.ConfigError) as refused:
        config.parse(doc, tmp_path / "boxes.json")
    assert "\n" not in str(refused.value) and "must be 1-64 of letters" in str(refused.value)
