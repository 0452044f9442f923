"""Every hugpy-router 0.0.4 command line works unchanged on this router (tests/dropin.py runs
real 0.0.4 beside it): the boxes file either writes is read by the other, and `keys` goes
through a running router's admin API with `--router-port` or `$HUGPY_ROUTER_PORT`."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT
from dropin import NEW, OLD, Served, cli, require_004, user_env

BOX_KEY = "hpk_box_cliboxkey0123456789abcdef"


def test_boxes_command_lines_and_files_are_interchangeable(tmp_path):
    require_004()
    env = user_env(tmp_path / "home")
    key_file = tmp_path / "wrapper.env"
    key_file.write_text(f'FITEVICT_WORKER=ae\nFITEVICT_TOKEN="{BOX_KEY}"\n')
    store = tmp_path / "fitevict.sqlite3"  # a real wrapper store: this router checks that it is one
    subprocess.run([sys.executable, str(ROOT / "tests" / "hugpy_store_writer.py"), str(store), "ae"],
                   input="quit\n", text=True, check=True, capture_output=True)
    docs = {}
    for exe in (OLD, NEW):
        boxes = tmp_path / f"{exe.parent.parent.name}.json"
        for argv in (
            ["--boxes", str(boxes), "boxes", "add", "--name", "ae", "--url", "http://127.0.0.1:40717/",
             "--key", BOX_KEY, "--store", str(store), "--pool", "lab"],
            ["--boxes", str(boxes), "boxes", "add", "--name", "b2", "--url", "http://127.0.0.1:40718",
             "--key-file", str(key_file)],
            ["--boxes", str(boxes), "boxes", "add", "--name", "b3", "--url", "http://127.0.0.1:40719"],
            ["--boxes", str(boxes), "boxes", "remove", "b3"],
            ["--boxes", str(boxes), "boxes", "list"],
        ):
            done = cli(exe, env, *argv)
            assert BOX_KEY not in done.stdout + done.stderr
        docs[exe] = json.loads(boxes.read_text())["boxes"]
        # each reads the other's file
        other = OLD if exe is NEW else NEW
        listed = cli(other, env, "--boxes", str(boxes), "boxes", "list").stdout
        assert "ae" in listed and "b2" in listed and "b3" not in listed
    fields = ("name", "url", "key", "store")
    assert [{k: b.get(k) for k in fields} for b in docs[NEW]] == [{k: b.get(k) for k in fields} for b in docs[OLD]]
    assert [b.get("pool") or None for b in docs[NEW]] == [b.get("pool") or None for b in docs[OLD]]
    # the default boxes file is the same for both: <config>/hugpy/router/boxes.json
    cli(NEW, env, "boxes", "add", "--name", "d", "--url", "http://127.0.0.1:1")
    assert "d " in cli(OLD, env, "boxes", "list").stdout


def test_keys_through_the_running_router_as_0_0_4_does(tmp_path):
    require_004()
    admin = "hpk_box_cliadminkey0123456789abcdef"
    env = user_env(tmp_path / "home", HUGPY_ROUTER_KEY=admin, HUGPY_ROUTER_REQUIRE_KEY="always")
    router = Served(NEW, env, tmp_path / "new.log")
    try:
        port = router.url.rsplit(":", 1)[1]
        made = {}
        for exe in (OLD, NEW):  # 0.0.4's own CLI against this router, and ours
            done = cli(exe, env, "keys", "--router-port", port, "create", "--name", f"by-{exe.parent.parent.name}",
                       "--scope", "admin", "--expires-days", "3")
            made[exe] = done.stdout.strip()
            assert made[exe].startswith("hpk_") and made[exe] not in done.stderr
        assert router.call("GET", "/v1/models", key=made[OLD])[0] == 200  # a working key
        listed = json.loads(cli(NEW, {**env, "HUGPY_ROUTER_PORT": port}, "keys", "list", "--json").stdout)
        ids = [k["id"] for k in listed["keys"]]
        assert len(ids) == 2 and all(k["scope"] == "admin" for k in listed["keys"])
        assert "secret_hash" not in json.dumps(listed)
        assert cli(OLD, env, "keys", "--router-port", port, "revoke", ids[0]).returncode == 0
        assert cli(NEW, env, "keys", "--router-port", port, "revoke", ids[1]).stdout == f"key {ids[1]} revoked\n"
        assert router.call("GET", "/v1/models", key=made[OLD])[0] == 401
        listed = json.loads(cli(OLD, env, "keys", "--router-port", port, "list", "--all").stdout)
        assert sorted(k["id"] for k in listed["keys"] if k["revoked_at"]) == sorted(ids)
        gone = cli(NEW, env, "keys", "--router-port", port, "revoke", "0123456789", check=False)
        assert gone.returncode == 1 and "no key with id" in gone.stderr
        bad = cli(NEW, env, "keys", "--router-port", port, "create", "--name", " ", check=False)
        assert bad.returncode == 2
    finally:
        assert router.stop() == 0
    down = cli(NEW, env, "keys", "--router-port", port, "list", check=False)
    assert down.returncode == 1 and "no router answered" in down.stderr and admin not in down.stderr
