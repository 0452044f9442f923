"""A system install lets hugpy-core edit the fleet (install rule 6), proved where systemd cannot run:
the installer lays out a config folder as it does /etc/hugpy, then the router runs as an
unprivileged account in a mount namespace that sees what the unit sees (every mount read-only,
as ProtectSystem=strict, but the unit's ReadWritePaths=, its StateDirectory and a private /tmp).
A box edit through the admin API must land in the boxes file, at 0.0.4's path; the shared
config folder (hugpy-wrapper's env file) must stay read-only. Without the writable folder the
same edit is the 503 `boxes_file_unwritable` the unit used to give."""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

from router.boxes import config as boxes_config
from router.cli import install

from conftest import ROOT

SERVICE_USER = "nobody"  # stands in for hugpy-router: an account with no rights of its own
LISTENING_RE = re.compile(r"(router) listening on (http://\S+)")

# ProtectSystem=strict: every mount read-only but the kernel's; then the unit's writable paths,
# bound over themselves rw, and a private /tmp; then the service's account, without capabilities.
# This environment's interpreter may sit in a folder only root can enter (pyenv under /root):
# it is bound where the account can reach it, with this environment's packages on its path.
SANDBOX = r"""
set -e
# the interpreter, where the account can run it (as the unit's /opt/hugpy-router/venv)
mkdir -p "$TOP/python" && mount --bind "$PYTHON_PREFIX" "$TOP/python"
for m in $(awk '{print $2}' /proc/self/mounts | sort -u); do
  case "$m" in /proc|/proc/*|/sys|/sys/*|/dev|/dev/*) continue;; esac
  mount -o remount,bind,ro "$m" 2>/dev/null || true
done
for rw in $WRITABLE; do mount --bind "$rw" "$rw"; mount -o remount,bind,rw "$rw"; done
# a private /tmp, unless this checkout (its venv and the sandbox's own files) lives under /tmp
[ -n "$UNDER_TMP" ] || mount -t tmpfs -o mode=1777 tmpfs /tmp
as_service="setpriv --reuid=$SERVICE_UID --regid=$SERVICE_GID --clear-groups --inh-caps=-all --bounding-set=-all --no-new-privs"
if $as_service sh -c "echo x >> '$CONF/wrapper.env'" 2>/dev/null; then echo "wrapper.env is writable"; exit 3; fi
exec $as_service "$@"
"""


def sandbox_usable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to make the unit's mount namespace"
    if not shutil.which("unshare") or not shutil.which("setpriv"):
        return "needs unshare and setpriv (util-linux)"
    try:
        pwd.getpwnam(SERVICE_USER)
    except KeyError:
        return f"needs the {SERVICE_USER} account"
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
    return None if done.returncode == 0 else "mount namespaces are not allowed here"


def request(url: str, method: str, path: str, doc=None):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=None if doc is None else json.dumps(doc),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


@pytest.mark.skipif(sandbox_usable() is not None, reason=str(sandbox_usable()))
@pytest.mark.parametrize("writable", [True, False], ids=["with-ReadWritePaths", "without"])
def test_a_system_service_edits_its_boxes_file_and_nothing_else(writable):
    artifacts = ROOT / "tests" / "artifacts"
    artifacts.mkdir(exist_ok=True)
    top = Path(tempfile.mkdtemp(prefix="unit-", dir=artifacts))
    proc = None
    try:
        os.chmod(top, 0o755)  # the service account walks through it, as through /etc
        conf, state = top / "etc-hugpy", top / "var-lib-hugpy-router"
        conf.mkdir(mode=0o755)
        (conf / "wrapper.env").write_text("FITEVICT_TOKEN=hpk_box_wrapper\n")
        account = pwd.getpwnam(SERVICE_USER)
        state.mkdir(mode=0o750)
        os.chown(state, account.pw_uid, account.pw_gid)  # StateDirectory= does this
        lay = dataclasses.replace(install.layout("system"), conf_dir=conf, boxes_file=conf / "router.boxes.json",
                                  state_dir=state, service_user=SERVICE_USER)
        # 0.0.4 left a regular boxes file at its path, root's and read-only to the service
        lay.boxes_file.write_text(json.dumps({"boxes": [{"name": "a", "url": "http://127.0.0.1:9", "kind": "hugpy"}]}))
        os.chmod(lay.boxes_file, 0o640)
        install.own_folder(lay)
        install._boxes(lay, None)
        assert lay.boxes_file.is_symlink() and (lay.router_dir / "boxes.json").is_file()
        assert f"ReadWritePaths={lay.router_dir}" in install.render_unit(lay).splitlines()

        unit_writable = [str(state)] + ([str(lay.router_dir)] if writable else [])
        env = {**os.environ, "WRITABLE": " ".join(unit_writable), "CONF": str(conf), "TOP": str(top),
               "PYTHON_PREFIX": sys.base_prefix, "PYTHONPATH": sysconfig.get_paths()["purelib"],
               "LD_LIBRARY_PATH": f"{top}/python/lib",  # its libpython, not the one it finds otherwise
               "SERVICE_UID": str(account.pw_uid), "SERVICE_GID": str(account.pw_gid),
               "HUGPY_ROUTER_HOME": str(state), "PYTHONDONTWRITEBYTECODE": "1",
               "UNDER_TMP": "1" if top.resolve().is_relative_to("/tmp") else ""}
        proc = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", SANDBOX, "sandbox",
             f"{top}/python/bin/python{sys.version_info[0]}.{sys.version_info[1]}", "-m", "router", "serve", "--host", "127.0.0.1", "--port", "auto",
             "--boxes-file", str(lay.boxes_file)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        line = proc.stdout.readline()
        match = LISTENING_RE.search(line)
        if match is None:
            proc.terminate()
            pytest.fail(f"the router did not start in the sandbox: {line!r} {proc.stderr.read()}")
        url = match.group(2)

        status, doc = request(url, "POST", "/v1/boxes", {"name": "b", "url": "http://127.0.0.1:10", "kind": "hugpy"})
        names = [box.name for box in boxes_config.load(lay.boxes_file).boxes]
        if writable:
            assert (status, doc["name"]) == (201, "b")
            assert names == ["a", "b"]  # read at 0.0.4's path, through the link
            assert not (conf / "router.boxes.json.lock").exists()  # the lock lives beside the file
        else:
            assert (status, doc["error"]["code"]) == (503, "boxes_file_unwritable")
            assert names == ["a"]
        assert (conf / "wrapper.env").read_text() == "FITEVICT_TOKEN=hpk_box_wrapper\n"
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        shutil.rmtree(top, ignore_errors=True)
