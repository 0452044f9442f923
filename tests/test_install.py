"""`hugpy-router install | uninstall | status` (router/cli/install.py) and the service protocol
the unit relies on (router/serve/notify.py): units checked by `systemd-analyze verify` (Debian's
systemd package, installed by scripts/setup), plans printed by --dry-run that change nothing,
a refusal where systemd is missing, READY=1 after the first inventory, SIGHUP reloads."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import LISTENING_RE, ROOT, write_boxes
from router.cli import install
from router.sim import SimBox, SimFleet
from support.installed import EXE, home_env
from support.url_calls import request

WRAPPER_KEY = "hpk_box_localwrapperkey0123456789"
HARDENING = ("NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=read-only", "PrivateTmp=yes",
             "StateDirectory=hugpy-router", "UMask=0027")


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def local_wrapper(home: Path) -> None:
    """A user-mode hugpy-wrapper install's files, as `fitevict install --user` writes them."""
    conf = home / ".config" / "hugpy"
    conf.mkdir(parents=True)
    (conf / "wrapper.endpoint.json").write_text(json.dumps({"service": "hugpy-wrapper", "url": "http://127.0.0.1:40717/"}))
    (conf / "wrapper.env").write_text(f"FITEVICT_WORKER=ae\nFITEVICT_TOKEN={WRAPPER_KEY}\n")


@pytest.mark.parametrize("mode", ["system", "user"])
def test_units_pass_systemd_analyze_verify(mode, tmp_path):
    analyze = subprocess.run(["systemd-analyze", "--version"], capture_output=True)
    assert analyze.returncode == 0, "systemd-analyze is missing: run scripts/setup (Debian's systemd package)"
    lay = dataclasses.replace(install.layout(mode), python=Path(sys.executable), conf_dir=tmp_path)
    lay.env_file.write_text("HUGPY_ROUTER_PORT=1\n")
    unit = tmp_path / "hugpy-router.service"
    unit.write_text(install.render_unit(lay))
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr.strip()) == (0, "")  # a bad setting is only a warning: none
    text = unit.read_text()
    for line in ("Type=notify", "NotifyAccess=main", "ExecReload=/bin/kill -HUP $MAINPID",
                 f"ExecStart={sys.executable.rsplit('/', 1)[0]}/hugpy-router serve --host ${{HUGPY_ROUTER_HOST}} "
                 "--port ${HUGPY_ROUTER_PORT}", f"EnvironmentFile={lay.env_file}"):
        assert line in text.splitlines()
    hardened = [line for line in HARDENING if line in text.splitlines()]
    assert hardened == (list(HARDENING) if mode == "system" else [])
    # the one writable place in the config dir: the router's own folder (install rule 6)
    writable = [line for line in text.splitlines() if line.startswith("ReadWritePaths=")]
    assert writable == ([f"ReadWritePaths={tmp_path / 'router'}"] if mode == "system" else [])
    assert ("User=hugpy-router" in text) is (mode == "system")


def test_user_dry_run_prints_the_whole_plan_and_changes_nothing(tmp_path):
    home = tmp_path / "home"
    local_wrapper(home)
    before = tree(home)
    done = subprocess.run([str(EXE), "install", "--user", "--port", "18431", "--dry-run"],
                          env=home_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    conf = home / ".config" / "hugpy"
    for part in (f"{conf}/router/boxes.json", "box ae = the local hugpy-wrapper at http://127.0.0.1:40717",
                 f"{conf}/router.env (host 127.0.0.1, port 18431, admin key made, store "
                 f"{home}/.local/share/hugpy/router)", f"{home}/.config/systemd/user/hugpy-router.service",
                 "http://127.0.0.1:18431/health", f"{conf}/router.endpoint.json", "dry run: nothing was changed"):
        assert part in out, part
    assert WRAPPER_KEY not in out + done.stderr
    assert tree(home) == before
    no_box = subprocess.run([str(EXE), "install", "--user", "--port", "auto", "--no-local-box", "--dry-run"],
                            env=home_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert no_box.returncode == 0 and "local hugpy-wrapper" not in no_box.stdout
    purge = subprocess.run([str(EXE), "uninstall", "--user", "--purge", "--dry-run"],
                           env=home_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert purge.returncode == 0 and f"remove {home}/.local/share/hugpy/router" in purge.stdout
    assert tree(home) == before


def test_user_install_carries_the_shells_store_and_boxes_file(tmp_path):
    """Issue 38: a key made in a shell with $HUGPY_ROUTER_HOME (a box added with
    $HUGPY_ROUTER_BOXES) lands where the service installed from that shell reads."""
    store, boxes = tmp_path / "my-store", tmp_path / "my-boxes.json"
    env = home_env(tmp_path, HUGPY_ROUTER_HOME=str(store), HUGPY_ROUTER_BOXES=str(boxes))
    made = subprocess.run([str(EXE), "keys", "create", "--name", "laptop"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    added = subprocess.run([str(EXE), "boxes", "add", "--name", "a", "--url", "http://127.0.0.1:1"], env=env,
                           capture_output=True, text=True, timeout=60)
    assert added.returncode == 0, added.stderr
    assert (store / "router.sqlite3").is_file() and boxes.is_file()
    done = subprocess.run([str(EXE), "install", "--user", "--port", "18432", "--no-local-box", "--dry-run"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert f"HUGPY_ROUTER_HOME={store}" in lines and f"HUGPY_ROUTER_BOXES={boxes}" in lines
    assert f"store {store})" in done.stdout


def test_system_dry_run_lists_0_0_4s_files(tmp_path):
    done = subprocess.run([str(EXE), "install", "--system", "--port", "auto", "--dry-run", "--package", "hugpy-router==9.9"],
                          env=home_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for part in ("group hugpy; user hugpy-router", "venv /opt/hugpy-router/venv + pip install hugpy-router==9.9",
                 "/etc/hugpy/router.boxes.json", "/etc/hugpy/router.env", "store /var/lib/hugpy-router",
                 "/etc/systemd/system/hugpy-router.service", "/etc/hugpy/router.endpoint.json"):
        assert part in done.stdout, part


def test_without_systemd_install_fails_at_once_and_changes_nothing(tmp_path):
    home = tmp_path / "home"
    local_wrapper(home)
    before = tree(home)
    etc_before = os.path.exists("/etc/hugpy/router.env")
    no_systemctl = home_env(tmp_path, PATH=str(tmp_path / "empty-bin"))  # no systemctl on the PATH
    for argv in (["install", "--user", "--port", "18432"], ["install", "--system", "--port", "18432"],
                 ["uninstall", "--user"]):
        done = subprocess.run([str(EXE), *argv], env=no_systemctl, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done
        assert "systemd is not running here" in done.stderr and "nothing was changed" in done.stderr
        assert done.stdout == ""  # not even the first step was announced
    dry = subprocess.run([str(EXE), "install", "--user", "--port", "18432", "--dry-run"], env=no_systemctl,
                         capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0 and "this would stop before step 1: systemd is not running here" in dry.stdout
    assert tree(home) == before and os.path.exists("/etc/hugpy/router.env") == etc_before
    missing_port = subprocess.run([str(EXE), "install", "--user"], env=no_systemctl, capture_output=True,
                                  text=True, timeout=60)
    assert missing_port.returncode == 2 and "--port is required" in missing_port.stderr


def test_admin_key_is_made_once_and_kept(tmp_path):
    lay = dataclasses.replace(install.layout("user"), conf_dir=tmp_path)
    first = install.env_values(lay, "127.0.0.1", 1234, {})
    assert first["HUGPY_ROUTER_KEY"].startswith("hpk_box_") and first["HUGPY_ROUTER_PORT"] == "1234"
    lay.env_file.write_text(install.render_env({**first, "OTHER": "kept"}))
    again = install.env_values(lay, "0.0.0.0", 99, install.read_env(lay.env_file))
    assert again["HUGPY_ROUTER_KEY"] == first["HUGPY_ROUTER_KEY"] and again["OTHER"] == "kept"
    assert (again["HUGPY_ROUTER_HOST"], again["HUGPY_ROUTER_PORT"]) == ("0.0.0.0", "99")
    assert "HUGPY_ROUTER_STORE_MODE" not in again
    assert install.env_values(dataclasses.replace(lay, mode="system"), "h", 1, {})["HUGPY_ROUTER_STORE_MODE"] == "group"


def test_local_wrapper_becomes_a_box(tmp_path):
    local_wrapper(tmp_path / "home")
    lay = dataclasses.replace(install.layout("user"), conf_dir=tmp_path / "home" / ".config" / "hugpy")
    box = install.local_wrapper_box(lay)
    assert (box.name, box.url, box.key) == ("ae", "http://127.0.0.1:40717", WRAPPER_KEY)
    assert install.local_wrapper_box(dataclasses.replace(lay, conf_dir=tmp_path)) is None


def test_ready_after_first_inventory_then_reload_and_stop(tmp_path):
    box = SimBox("a", catalog=["tiny"], residents=["tiny"])
    fleet = SimFleet([box])
    fleet.start()
    boxes = write_boxes(tmp_path / "boxes.json", [box])
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(tmp_path / "notify.sock"))
    listener.settimeout(20)
    env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "HUGPY_ROUTER_HOME": str(tmp_path / "store")}
    log = open(tmp_path / "router.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "router", "serve", "--port", "auto", "--boxes-file", str(boxes)],
                            env=env, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT)
    try:
        assert listener.recv(4096).decode().startswith("READY=1")
        url = LISTENING_RE.search(proc.stdout.readline()).group(2)
        state = json.loads(request(url, "GET", "/v1/router/state")[1])
        (seen,) = state["boxes"]
        assert seen["online"] and [r["key"] for r in seen["residents"]] == ["tiny"]  # read before READY
        proc.send_signal(signal.SIGHUP)
        assert listener.recv(4096) == b"RELOADING=1" and listener.recv(4096) == b"READY=1"
        proc.send_signal(signal.SIGTERM)
        assert listener.recv(4096) == b"STOPPING=1"
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        log.close()
        listener.close()
        fleet.stop()
    assert "reloaded: boxes file" in (tmp_path / "router.log").read_text()


def test_a_planted_symlink_never_receives_the_env_text(tmp_path):
    """Issue 20 item 11: links planted at the installer's old temp name (for every process id
    nearby) and at the env file's own name point at a victim file; the env text, admin key
    included, lands only in a fresh 0600 file of its own, and the victim is untouched."""
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("victim\n")
    victim.chmod(0o644)
    env_file = config_dir / "router.env"
    for pid in range(max(1, os.getpid() - 50), os.getpid() + 50):
        (config_dir / f".router.env.tmp-{pid}").symlink_to(victim)
    env_file.symlink_to(victim)
    text = install.render_env({"HUGPY_ROUTER_KEY": "hpk_admin_secret", "HUGPY_ROUTER_PORT": "8080"})
    install.write_file(env_file, text, 0o600)
    assert victim.read_text() == "victim\n" and (victim.stat().st_mode & 0o777) == 0o644
    assert not env_file.is_symlink() and env_file.read_text() == text
    assert (env_file.stat().st_mode & 0o777) == 0o600
    # No temp file is left behind, and a failed write leaves the old file as it was.
    assert sorted(p.name for p in config_dir.iterdir() if not p.is_symlink()) == ["router.env"]
    with pytest.raises(LookupError):
        install.write_file(env_file, "other\n", 0o640, group="no-such-group-here")
    assert env_file.read_text() == text
    assert sorted(p.name for p in config_dir.iterdir() if not p.is_symlink()) == ["router.env"]
