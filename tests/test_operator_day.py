"""The operator's day (issue 27 items 4, 5, 6, 8): the route log and the key mode at hand, a
test fleet without copying URLs, a dashboard and an installer that explain themselves."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from router.sim import SimBox

from conftest import ROOT, wait_for
from support.installed import EXE, home_env
from support.url_calls import CANARY, chat_body, request


def _router_cli(*args: str, home, timeout: float = 30) -> subprocess.CompletedProcess:
    env = {**os.environ, "HUGPY_ROUTER_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "router", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)


def _calls(router, count: int) -> None:
    for n in range(count):
        assert request(router.url, "POST", "/v1/chat/completions", chat_body(f"{CANARY}-{n}"))[0] == 200


def _rows_written(router, count: int) -> list[dict]:
    def rows():
        status, data = request(router.url, "GET", "/v1/telemetry?limit=5000")
        doc = json.loads(data)
        return doc["rows"] if len(doc["rows"]) >= count else None
    return wait_for(rows, 5)


def test_telemetry_tail_returns_the_newest_rows_oldest_first(start_fleet_in_process):
    router = start_fleet_in_process(SimBox("a", catalog=["tiny"], residents=["tiny"]))
    _calls(router, 7)
    every = _rows_written(router, 7)
    status, data = request(router.url, "GET", "/v1/telemetry?tail=3")
    doc = json.loads(data)
    assert status == 200
    assert [row["id"] for row in doc["rows"]] == [row["id"] for row in every[-3:]]
    assert doc["next"] == every[-1]["id"] and doc["more"] is False
    # `limit` alone keeps 0.0.4's meaning: the oldest first.
    assert [row["id"] for row in json.loads(request(router.url, "GET", "/v1/telemetry?limit=2")[1])["rows"]] \
        == [row["id"] for row in every[:2]]
    for bad in ("tail=0", "tail=x", "tail=5001"):
        status, data = request(router.url, "GET", f"/v1/telemetry?{bad}")
        assert status == 400 and json.loads(data)["error"]["code"] == "bad_query", bad


def test_router_log_prints_the_newest_calls_never_a_body(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(a)
    _calls(router, 5)
    assert request(router.url, "POST", "/v1/chat/completions", chat_body().replace(b"tiny", b"nope"))[0] == 503
    every = _rows_written(router, 6)
    home = router.boxes_path.parent / "home"
    done = _router_cli("log", "--tail", "2", home=home)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2
    served, refused = (line.split("\t") for line in lines)
    assert served[1] == every[-2]["request_id"] and served[2:6] == ["openai", "tiny", "a", "done 200"]
    assert served[6].startswith("wait -") and "first " in served[6] and "total " in served[6]
    assert refused[1] == every[-1]["request_id"] and refused[5] == "refused 503"
    as_json = _router_cli("log", "--tail", "3", "--json", home=home)
    docs = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert [doc["request_id"] for doc in docs] == [row["request_id"] for row in every[-3:]]
    assert CANARY not in done.stdout + as_json.stdout


def test_router_log_follow_prints_new_calls_as_they_come(start_fleet_in_process):
    router = start_fleet_in_process(SimBox("a", catalog=["tiny"], residents=["tiny"]))
    _calls(router, 1)
    _rows_written(router, 1)
    env = {**os.environ, "HUGPY_ROUTER_HOME": str(router.boxes_path.parent / "home")}
    proc = subprocess.Popen([sys.executable, "-m", "router", "log", "--follow", "--tail", "1"],
                            stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        first = proc.stdout.readline()
        assert "\tdone 200\t" in first
        _calls(router, 1)
        second = proc.stdout.readline()  # blocks until --follow prints the new row
        assert "\tdone 200\t" in second and second.split("\t")[1] != first.split("\t")[1]
    finally:
        proc.terminate()
        proc.wait(10)


def test_router_log_without_a_store_says_so(tmp_path):
    done = _router_cli("log", home=tmp_path / "nothing-here")
    assert done.returncode == 1
    assert done.stderr.strip() == (f"router log: no route log at {tmp_path / 'nothing-here' / 'router.sqlite3'}: "
                                   "no router has run with this store yet")


def test_require_key_flag_beats_the_environment_and_is_announced(start_fleet):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet(a, extra_args=("--require-key", "always"),
                         env={"HUGPY_ROUTER_REQUIRE_KEY": "never", "HUGPY_ROUTER_TRUSTED_PROXIES": "10.9.0.0/16"})
    # Loopback is inside, so only `always` asks it for a key on a use route.
    status, data = request(router.url, "POST", "/v1/chat/completions", chat_body())
    assert status == 401 and json.loads(data)["error"]["code"] == "invalid_api_key"
    line = next(line for line in router.log_text().splitlines() if "access: " in line)
    assert "require-key always" in line and "trusted nets 127.0.0.0/8" in line
    assert "trusted proxies 10.9.0.0/16" in line and "loopback manages without a key in every mode" in line


def test_serve_help_says_loopback_manages_without_a_key():
    done = subprocess.run([sys.executable, "-m", "router", "serve", "--help"], capture_output=True, text=True,
                          cwd=ROOT, timeout=30)
    text = " ".join(done.stdout.split())
    assert "--require-key {never,outside,always}" in text
    assert "loopback manages the router (admin routes) without a key" in text


def test_sim_starts_boxes_of_each_kind_and_prints_lines_that_build_a_working_fleet(tmp_path):
    from conftest import RouterProcess
    import re
    import socket

    with socket.socket() as probe:  # a free port for the Ollama box, as an operator would pick one
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sim = subprocess.Popen([sys.executable, "-m", "router.sim", "--kind", "ollama", "--port", str(port),
                            "--kind", "hugpy", "--kind", "lmstudio", "--models", "tiny-llama"],
                           stdout=subprocess.PIPE, text=True, cwd=ROOT)
    router = None
    try:
        assert sim.stdout.readline().startswith("sim fleet ready: 3 boxes")
        lines = [sim.stdout.readline().strip() for _ in range(3)]
        assert re.fullmatch(rf"router boxes add --name sim-ollama-1-[0-9a-f]{{4}} --url http://127.0.0.1:{port} "
                            "--kind ollama", lines[0])
        assert " --kind hugpy --key hpk_box_" in lines[1] and lines[2].endswith("--kind lmstudio")
        boxes = tmp_path / "boxes.json"
        for line in lines:  # pasted as they are, with this checkout's `router`
            argv = line.split()[1:]
            done = _router_cli("--boxes", str(boxes), *argv, home=tmp_path / "home")
            assert done.returncode == 0, done.stderr
        router = RouterProcess(boxes)
        pins = [line.split()[4] for line in lines]  # each box's --name
        assert [pin.rsplit("-", 1)[0] for pin in pins] == ["sim-ollama-1", "sim-hugpy-2", "sim-lmstudio-3"]
        for pin in pins:
            status, _ = request(router.url, "POST", "/v1/chat/completions",
                                json.dumps({"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}],
                                            "alloc": {"worker": pin}}).encode())
            assert status == 200, pin
        assert [row["box"] for row in _rows_written(router, 3)] == pins
    finally:
        if router is not None:
            router.stop()
        sim.terminate()
        sim.wait(10)


def test_install_dry_run_prints_the_unit_and_env_files_it_would_write_key_masked(tmp_path):
    env = home_env(tmp_path)
    home = tmp_path / "home"
    env_file = home / ".config" / "hugpy" / "router.env"
    env_file.parent.mkdir(parents=True)
    env_file.write_text("HUGPY_ROUTER_KEY=hpk_admin_SECRET123\n")
    done = subprocess.run([str(EXE), "install", "--user", "--port", "18433", "--dry-run", "--no-local-box"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    unit = home / ".config" / "systemd" / "user" / "hugpy-router.service"
    assert f"--- {env_file} (would be written) ---" in out and f"--- {unit} (would be written) ---" in out
    assert "HUGPY_ROUTER_PORT=18433" in out and "HUGPY_ROUTER_KEY=hpk_…(kept)" in out
    assert "[Service]" in out and "ExecReload=/bin/kill -HUP $MAINPID" in out
    assert "SECRET123" not in out + done.stderr
    assert not unit.exists() and env_file.read_text() == "HUGPY_ROUTER_KEY=hpk_admin_SECRET123\n"


def test_the_dashboard_has_a_legend_for_every_load_column(start_fleet_in_process):
    import re

    router = start_fleet_in_process(SimBox("a", catalog=["tiny"], residents=["tiny"]))
    status, page = request(router.url, "GET", "/ui")
    assert status == 200
    page = page.decode()
    legend = page[page.index('<details id="legend"'):page.index("</details>")]
    terms = re.findall(r"<dt>(.*?)</dt>", legend)
    assert terms == ["GPU pressure 0–3", "pending", "reservations", "in flight / limit", "back-off"]
    columns = re.findall(r"<th>(.*?)</th>", page[page.index('<table id="boxes">'):page.index("</thead>")])
    assert all(term.replace(" 0–3", "") in columns for term in terms)
    assert "How a box is chosen" in legend


def test_router_log_never_prints_a_callers_control_characters():
    """A model name is the caller's own text: an ESC or a newline in it reaches the operator's
    terminal only escaped, so it can neither drive the terminal nor forge a line."""
    from router.cli.log import format_row

    line = format_row({"received_at": 1.0, "request_id": "r1", "facade": "openai",
                       "model": "tiny\x1b]0;owned\x07\nFAKE\tdone 200", "box": "a", "state": "done", "http_status": 200})
    assert "\x1b" not in line and "\n" not in line and "\x07" not in line
    assert line.split("\t")[3] == "tiny\\x1b]0;owned\\x07\\nFAKE\\tdone 200"


def test_the_readme_quick_start_walks_an_operators_day():
    readme = (ROOT / "README.md").read_text()
    start = readme[readme.index("## Using it"):readme.index("Every command and flag:")]
    for step in ("router boxes add ", "router serve ", "/v1/chat/completions", "router keys create ",
                 "router log ", "router boxes set ", "install ", "python -m router.sim --kind"):
        assert step in start, step
