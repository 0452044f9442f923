"""`hugpy-router install | uninstall | status`: the router as a systemd service on the hugpy
layout, with the files hugpy-router 0.0.4's installer writes (so each can repair the other's).

  --system  user hugpy-router (no login) in group hugpy, venv /opt/hugpy-router/venv,
            /etc/hugpy/router.env (0640 root:hugpy-router: it holds keys), the boxes file at
            0.0.4's /etc/hugpy/router.boxes.json, a link to /etc/hugpy/router/boxes.json in the
            router's own folder (0750 hugpy-router, the file 0600: it holds keys), store
            /var/lib/hugpy-router (StateDirectory, group-readable), unit
            /etc/systemd/system/hugpy-router.service (root, once)
  --user    this account's service on this environment's interpreter:
            <XDG config>/hugpy/router.env, the boxes file <hugpy config>/router/boxes.json,
            store <hugpy data>/router, unit <XDG config>/systemd/user/hugpy-router.service;
            `$HUGPY_ROUTER_HOME` and `$HUGPY_ROUTER_BOXES`, when the shell sets them, name the
            store and the boxes file instead, as they do for `router` in that shell
  both      <conf>/router.endpoint.json (no secret), as 0.0.4

Rules:
1. A plan first: every step is listed with what it changes, then run in order; `--dry-run`
   prints the whole plan and changes nothing. A missing systemd is in the plan (dry run) or
   stops `install` before its first step (exit 2, nothing changed).
2. The port is `--port N` or `auto`, else the one already configured; never assumed.
3. The admin key (`HUGPY_ROUTER_KEY`, `hpk_box_...`) is made once and kept across re-installs;
   so is every other value already in router.env that the command line does not set.
4. A hugpy-wrapper installed in the same mode becomes a box (its URL from
   wrapper.endpoint.json, its key from wrapper.env, its name FITEVICT_WORKER or the host
   name), replacing a box of that name or URL, unless `--no-local-box`.
5. The unit is `Type=notify` (READY=1 once the listeners are up and each box had its first
   inventory read, serve/notify.py), `ExecReload` sends SIGHUP (boxes file and keys re-read),
   and the system unit is hardened (NoNewPrivileges, ProtectSystem=strict, ProtectHome,
   PrivateTmp, StateDirectory, UMask=0027).
6. The system service may edit its boxes file (the admin API's box routes, which hugpy-core
   configures the fleet by), and nothing else in /etc: `ReadWritePaths=` names only the
   router's own folder `/etc/hugpy/router`, owned by the service user, where the file, its
   lock and its temp files live. /etc/hugpy itself is shared with hugpy-wrapper (its env file
   holds the box key), so it stays read-only to the router; 0.0.4's path is a link into the
   folder (a regular file there, as 0.0.4 writes it, is moved in on install).
"""

from __future__ import annotations

import argparse
import grp
import json
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from router import __version__
from router.boxes import config as boxes_config
from router.store.files import write_atomically
from router.store import paths

SERVICE = "hugpy-router"
COMPONENT = "router"
PACKAGE = "hugpy-router"
SHARED_GROUP = paths.SHARED_GROUP
SYS_CONF = Path("/etc/hugpy")
SYS_PREFIX = Path("/opt") / SERVICE
SYS_STATE = Path("/var/lib") / SERVICE
SYS_UNIT_DIR = Path("/etc/systemd/system")
# A first start reads every box once (bounded per box); 30 s is 0.0.4's health wait.
HEALTH_WAIT_S = 30
# The unit's start limit: the first inventory reads are bounded well below this.
START_TIMEOUT_S = 90


class InstallError(Exception):
    """A precondition or a step failed; the steps after it did not run."""


@dataclass(frozen=True)
class Layout:
    mode: str  # "system" | "user"
    python: Path  # the service's interpreter
    venv: Path | None  # made by the system install; the user's is this environment
    conf_dir: Path
    state_dir: Path
    boxes_file: Path
    unit_path: Path
    service_user: str | None

    @property
    def env_file(self) -> Path:
        return self.conf_dir / f"{COMPONENT}.env"

    @property
    def endpoint_file(self) -> Path:
        return self.conf_dir / f"{COMPONENT}.endpoint.json"

    @property
    def bin_dir(self) -> Path:
        return self.python.parent

    @property
    def router_dir(self) -> Path:
        """The system service's one writable folder under /etc (rule 6)."""
        return self.conf_dir / COMPONENT

    @property
    def systemctl(self) -> list[str]:
        return ["systemctl"] if self.mode == "system" else ["systemctl", "--user"]


def layout(mode: str) -> Layout:
    """The files of a `mode` install (the module docstring's table)."""
    if mode == "system":
        venv = SYS_PREFIX / "venv"
        return Layout("system", venv / "bin" / "python", venv, SYS_CONF, SYS_STATE,
                      SYS_CONF / "router.boxes.json", SYS_UNIT_DIR / f"{SERVICE}.service", SERVICE)
    xdg = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    # The store and boxes file this shell's `router` uses ($HUGPY_ROUTER_HOME, $HUGPY_ROUTER_BOXES
    # included), so the keys and boxes made here are the service's; STATE_DIRECTORY is a unit's own.
    shell = {k: v for k, v in os.environ.items() if k != "STATE_DIRECTORY"}
    return Layout("user", Path(sys.executable), None, xdg / "hugpy", paths.store_dir(shell),
                  paths.boxes_path(shell), xdg / "systemd" / "user" / f"{SERVICE}.service", None)


# --- files -----------------------------------------------------------------------------------


def read_env(path: Path) -> dict[str, str]:
    """KEY=value lines of an env file (quotes dropped); {} when it is missing."""
    values: dict[str, str] = {}
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return values
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            values[key.strip().removeprefix("export ").strip()] = value.strip().strip('"').strip("'")
    return values


def render_env(values: dict[str, str]) -> str:
    lines = [f"# {SERVICE} service configuration, written by `hugpy-router install`.",
             "# Edit it and run `hugpy-router install` again (or restart the service) to apply."]
    for key in sorted(values):
        value = str(values[key])
        if any(c in value for c in "\n\r\"\\"):
            raise InstallError(f"{key}: newlines, quotes and backslashes are not allowed in values")
        lines.append(f'{key}="{value}"' if (" " in value or "#" in value) else f"{key}={value}")
    return "\n".join(lines) + "\n"


def write_file(path: Path, text: str, mode: int, owner: str | None = None, group: str | None = None) -> None:
    """Writes `text` atomically with `mode` (and owner/group), safe against planted links
    (router.store.files)."""
    write_atomically(path, text.encode("utf-8"), mode, owner, group)


def render_unit(lay: Layout) -> str:
    """The unit file (rule 5)."""
    lines = ["[Unit]", "Description=hugpy router (one address in front of every box)",
             "After=network-online.target", "Wants=network-online.target", "",
             "[Service]", "Type=notify", "NotifyAccess=main"]
    if lay.mode == "system":
        lines += [f"User={lay.service_user}", f"Group={lay.service_user}", f"SupplementaryGroups={SHARED_GROUP}"]
    lines += [
        f"EnvironmentFile={lay.env_file}",
        f"Environment=PATH={lay.bin_dir}:/usr/local/bin:/usr/bin:/bin",
        "Environment=PYTHONUNBUFFERED=1",
        f"ExecStart={lay.bin_dir / 'hugpy-router'} serve"
        " --host ${HUGPY_ROUTER_HOST} --port ${HUGPY_ROUTER_PORT}",
        "ExecReload=/bin/kill -HUP $MAINPID",
        f"TimeoutStartSec={START_TIMEOUT_S}",
        "Restart=on-failure",
        "RestartSec=3",
    ]
    if lay.mode == "system":
        lines += [f"StateDirectory={SERVICE}", "StateDirectoryMode=0750", "UMask=0027", "NoNewPrivileges=yes",
                  "ProtectSystem=strict", "ProtectHome=read-only", "PrivateTmp=yes",
                  f"ReadWritePaths={lay.router_dir}"]
    wanted_by = "multi-user.target" if lay.mode == "system" else "default.target"
    lines += ["", "[Install]", f"WantedBy={wanted_by}", ""]
    return "\n".join(lines)


def new_admin_key() -> str:
    """An admin key as 0.0.4 (hugpy-wrapper's box key shape): hpk_box_<secret>."""
    return f"hpk_box_{secrets.token_urlsafe(32)}"


def env_values(lay: Layout, host: str, port: int, current: dict[str, str]) -> dict[str, str]:
    """router.env's values: what is there, with host, port, store and boxes file set, and the
    admin key kept or made once (rule 3)."""
    values = dict(current)
    values.update({"HUGPY_ROUTER_HOST": host, "HUGPY_ROUTER_PORT": str(port),
                   "HUGPY_ROUTER_KEY": current.get("HUGPY_ROUTER_KEY") or new_admin_key(),
                   "HUGPY_ROUTER_HOME": str(lay.state_dir), "HUGPY_ROUTER_BOXES": str(lay.boxes_file)})
    if lay.mode == "system":
        values["HUGPY_ROUTER_STORE_MODE"] = "group"
    return values


def local_wrapper_box(lay: Layout) -> boxes_config.BoxConfig | None:
    """The hugpy-wrapper installed in the same mode, as a box (rule 4), or None."""
    try:
        endpoint = json.loads((lay.conf_dir / "wrapper.endpoint.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    env = read_env(lay.conf_dir / "wrapper.env")
    url = endpoint.get("url") if isinstance(endpoint, dict) else None
    if not isinstance(url, str) or not env.get("FITEVICT_TOKEN"):
        return None
    name = env.get("FITEVICT_WORKER") or socket.gethostname().split(".")[0]
    return boxes_config.BoxConfig(name=name, url=url.rstrip("/"), key=env["FITEVICT_TOKEN"])


# --- checks ------------------------------------------------------------------------------------


def systemd_running() -> bool:
    """systemd is this machine's init (sd_booted's test) and systemctl is here."""
    return os.path.isdir("/run/systemd/system") and shutil.which("systemctl") is not None


def probe_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0") else ("::1" if host == "::" else host)


def url_of(host: str, port: int) -> str:
    probe = probe_host(host)
    return f"http://[{probe}]:{port}" if ":" in probe else f"http://{probe}:{port}"


def answers_health(host: str, port: int, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url_of(host, port) + "/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except OSError:
        return False


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def resolve_port(host: str, wanted: str | None, current: dict[str, str]) -> int:
    """Rule 2. Raises InstallError."""
    want = str(wanted or current.get("HUGPY_ROUTER_PORT") or "").strip()
    if not want:
        raise InstallError("--port is required: a number, or `auto` to pick a free one (no port is assumed)")
    if want == "auto":
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.bind((host, 0))
            return sock.getsockname()[1]
    try:
        port = int(want)
    except ValueError:
        raise InstallError(f"--port must be a number or `auto`, not {want!r}") from None
    if not 1 <= port <= 65535:
        raise InstallError(f"--port {port} is out of range")
    return port


# --- plans -------------------------------------------------------------------------------------


@dataclass
class Step:
    name: str
    detail: str
    run: Callable[[], None]


@dataclass
class Plan:
    steps: list[Step] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    blocker: str | None = None  # why it cannot run here (rule 1)
    files: list[tuple[Path, str]] = field(default_factory=list)  # what it writes, shown by a dry run

    def add(self, name: str, detail: str, run: Callable[[], None]) -> None:
        self.steps.append(Step(name, detail, run))


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        said = (done.stderr or done.stdout).strip()[-600:]
        raise InstallError(f"`{' '.join(cmd)}` failed ({done.returncode}): {said}")


def _blocker(lay: Layout) -> str | None:
    if not systemd_running():
        return ("systemd is not running here (no /run/systemd/system or no systemctl): install needs a "
                "Linux machine booted with systemd; run `hugpy-router serve` under your own supervisor instead")
    if lay.mode == "system" and os.geteuid() != 0:
        return f"--system needs root once (user {SERVICE}, {SYS_PREFIX}, {SYS_CONF}, a unit)"
    if lay.mode == "user" and os.geteuid() == 0:
        return "--user as root makes no sense; use --system"
    return None


def plan_install(args: argparse.Namespace) -> Plan:
    lay = layout(args.mode)
    plan = Plan(blocker=_blocker(lay))
    current = read_env(lay.env_file)
    port = resolve_port(args.host, args.port, current)
    if not args.dry_run and not answers_health(args.host, port) and not port_free(args.host, port):
        raise InstallError(f"{args.host}:{port} is taken by something else; choose another --port (or `auto`)")
    values = env_values(lay, args.host, port, current)
    spec = args.package or f"{PACKAGE}=={__version__}"
    box = None if args.no_local_box else local_wrapper_box(lay)
    if lay.mode == "system":
        plan.add("accounts", f"group {SHARED_GROUP}; user {SERVICE} (no login) in it", _accounts)
        plan.add("code", f"venv {lay.venv} + pip install {spec}", lambda: _code(lay, spec))
    else:
        plan.add("code", f"use this environment ({sys.prefix})", lambda: None)
        linger = subprocess.run(["loginctl", "show-user", pwd.getpwuid(os.getuid()).pw_name, "-p", "Linger"],
                                capture_output=True, text=True).stdout.strip() if shutil.which("loginctl") else ""
        if linger != "Linger=yes":
            plan.notes.append("lingering is off for this user: the service stops when you log out "
                              "(`loginctl enable-linger` keeps it running)")
    if args.no_local_box:
        local = ""
    elif box is None:
        local = f" (no {lay.mode} hugpy-wrapper here: add boxes with `hugpy-router boxes add`)"
    else:
        local = f" + box {box.name} = the local hugpy-wrapper at {box.url}"
    if lay.mode == "system":
        plan.add("router folder", f"{lay.router_dir} (0750 {SERVICE}: the service's only writable place in "
                                  f"{lay.conf_dir}); {lay.boxes_file} links to its boxes.json",
                 lambda: own_folder(lay))
    owner = f", {SERVICE}" if lay.mode == "system" else ""
    plan.add("boxes", f"{lay.boxes_file} (holds box keys: 0600{owner}){local}", lambda: _boxes(lay, box))
    plan.add("config", f"{lay.env_file} (host {args.host}, port {port}, admin key "
                       f"{'kept' if current.get('HUGPY_ROUTER_KEY') else 'made'}, store {lay.state_dir})",
             lambda: _config(lay, values))
    plan.add("service", f"{lay.unit_path} (Type=notify, ExecReload), enabled and (re)started",
             lambda: _service(lay))
    # A dry run shows these two files as they would be written, the admin key masked.
    shown = {**values, "HUGPY_ROUTER_KEY": "hpk_…" + ("(kept)" if current.get("HUGPY_ROUTER_KEY") else "(made at install)")}
    plan.files += [(lay.env_file, render_env(shown)), (lay.unit_path, render_unit(lay))]
    plan.add("ready", f"wait for {url_of(args.host, port)}/health", lambda: _ready(lay, args.host, port))
    plan.add("endpoint", f"{lay.endpoint_file} (no secret)", lambda: _endpoint(lay, args.host, port))
    return plan


def _accounts() -> None:
    try:
        grp.getgrnam(SHARED_GROUP)
    except KeyError:
        _run(["groupadd", "--system", SHARED_GROUP])
    try:
        pwd.getpwnam(SERVICE)
        _run(["usermod", "--append", "--groups", SHARED_GROUP, SERVICE])
    except KeyError:
        _run(["useradd", "--system", "--user-group", "--groups", SHARED_GROUP, "--home-dir", str(SYS_STATE),
              "--no-create-home", "--shell", "/usr/sbin/nologin", "--comment", "hugpy router", SERVICE])


def _code(lay: Layout, spec: str) -> None:
    if not lay.python.exists():
        _run([sys.executable, "-m", "venv", str(lay.venv)])
    _run([str(lay.python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", spec])


def _boxes(lay: Layout, box: boxes_config.BoxConfig | None) -> None:
    def change(boxes: boxes_config.BoxesFile) -> None:
        if box is not None:
            boxes.boxes = [b for b in boxes.boxes if b.name != box.name and b.url != box.url]
            boxes.put(box)

    boxes_config.edit(lay.boxes_file, change)
    if lay.mode == "system":  # rule 6: the service edits it (the edit wrote it 0600)
        account = pwd.getpwnam(lay.service_user)
        for path in (lay.boxes_file.resolve(), Path(f"{lay.boxes_file.resolve()}.lock")):
            os.chown(path, account.pw_uid, account.pw_gid)


def own_folder(lay: Layout) -> None:
    """The router's own folder under the config dir, owned by the service user; 0.0.4's boxes
    file path a relative link to the file in it (rule 6)."""
    account = pwd.getpwnam(lay.service_user)
    lay.router_dir.mkdir(mode=0o750, exist_ok=True)
    os.chown(lay.router_dir, account.pw_uid, account.pw_gid)
    os.chmod(lay.router_dir, 0o750)
    inside = lay.router_dir / "boxes.json"
    if lay.boxes_file.is_file() and not lay.boxes_file.is_symlink():
        os.replace(lay.boxes_file, inside)  # 0.0.4's regular file moves in, keys and all
    if not lay.boxes_file.is_symlink():
        os.symlink(Path(COMPONENT) / inside.name, lay.boxes_file)
    Path(f"{lay.boxes_file}.lock").unlink(missing_ok=True)  # the lock now lives beside the file


def _config(lay: Layout, values: dict[str, str]) -> None:
    if lay.mode == "system":
        write_file(lay.env_file, render_env(values), 0o640, "root", SERVICE)
    else:
        write_file(lay.env_file, render_env(values), 0o600)


def _service(lay: Layout) -> None:
    write_file(lay.unit_path, render_unit(lay), 0o644)
    _run(lay.systemctl + ["daemon-reload"])
    _run(lay.systemctl + ["enable", f"{SERVICE}.service"])
    _run(lay.systemctl + ["restart", f"{SERVICE}.service"])  # Type=notify: returns once READY=1


def _ready(lay: Layout, host: str, port: int) -> None:
    deadline = time.monotonic() + HEALTH_WAIT_S
    while time.monotonic() < deadline:
        if answers_health(host, port):
            return
        time.sleep(1)
    raise InstallError(f"no /health on {host}:{port} within {HEALTH_WAIT_S}s "
                       f"(see `journalctl {'--user ' if lay.mode == 'user' else ''}-u {SERVICE}`)")


def _endpoint(lay: Layout, host: str, port: int) -> None:
    write_file(lay.endpoint_file, json.dumps({
        "service": SERVICE, "mode": lay.mode, "host": host, "port": port, "url": url_of(host, port),
        "version": __version__, "token_file": str(lay.env_file), "token_env": "HUGPY_ROUTER_KEY",
        "store": str(lay.state_dir), "boxes": str(lay.boxes_file)}, indent=1) + "\n", 0o644)


def plan_uninstall(args: argparse.Namespace) -> Plan:
    lay = layout(args.mode)
    plan = Plan(blocker=_blocker(lay))

    def stop() -> None:
        subprocess.run(lay.systemctl + ["disable", "--now", f"{SERVICE}.service"], capture_output=True)
        lay.unit_path.unlink(missing_ok=True)
        subprocess.run(lay.systemctl + ["daemon-reload"], capture_output=True)

    plan.add("service", f"stop, disable and remove {lay.unit_path}", stop)
    plan.add("endpoint", f"remove {lay.endpoint_file}", lambda: lay.endpoint_file.unlink(missing_ok=True))
    if lay.mode == "system":
        plan.add("code", f"remove {SYS_PREFIX}", lambda: shutil.rmtree(SYS_PREFIX, ignore_errors=True))
    if args.purge:
        for path in (lay.env_file, lay.boxes_file):
            plan.add("config", f"remove {path}", lambda path=path: path.unlink(missing_ok=True))
        plan.add("state", f"remove {lay.state_dir} (route_log, keys)",
                 lambda: shutil.rmtree(lay.state_dir, ignore_errors=True))
        if lay.mode == "system":
            plan.add("router folder", f"remove {lay.router_dir}",
                     lambda: shutil.rmtree(lay.router_dir, ignore_errors=True))
            plan.add("user", f"remove the system user {SERVICE}",
                     lambda: subprocess.run(["userdel", SERVICE], capture_output=True))
    else:
        plan.notes.append(f"kept {lay.env_file}, {lay.boxes_file} and {lay.state_dir} (`--purge` removes them)")
    return plan


def execute(plan: Plan, dry_run: bool, out=sys.stdout) -> None:
    """Rule 1. Raises InstallError (before the first step when the plan has a blocker)."""
    if plan.blocker and not dry_run:
        raise InstallError(plan.blocker + "; nothing was changed")
    for number, step in enumerate(plan.steps, 1):
        print(f"[{number}/{len(plan.steps)}] {step.name}: {step.detail}", file=out, flush=True)
        if not dry_run:
            step.run()
    for note in plan.notes:
        print(f"note: {note}", file=out, flush=True)
    if dry_run:
        for path, text in plan.files:
            print(f"--- {path} (would be written) ---\n{text.rstrip()}\n---", file=out, flush=True)
        if plan.blocker:
            print(f"note: this would stop before step 1: {plan.blocker}", file=out, flush=True)
        print("dry run: nothing was changed", file=out, flush=True)
    else:
        print("done", file=out, flush=True)


def status(args: argparse.Namespace) -> dict:
    lay = layout(args.mode)
    env = read_env(lay.env_file)
    active = "unknown"
    if shutil.which("systemctl"):
        active = subprocess.run(lay.systemctl + ["is-active", f"{SERVICE}.service"],
                                capture_output=True, text=True).stdout.strip() or "unknown"
    try:
        boxes = boxes_config.load(Path(env.get("HUGPY_ROUTER_BOXES") or lay.boxes_file)).boxes
    except boxes_config.ConfigError:
        boxes = []
    doc = {"mode": lay.mode, "unit": str(lay.unit_path) if lay.unit_path.exists() else None, "service": active,
           "config": str(lay.env_file) if env else None, "host": env.get("HUGPY_ROUTER_HOST"),
           "port": env.get("HUGPY_ROUTER_PORT"), "key": "set" if env.get("HUGPY_ROUTER_KEY") else None,
           "store": env.get("HUGPY_ROUTER_HOME") or str(lay.state_dir),
           "boxes": [{"name": b.name, "url": b.url, "key": "set" if b.key else None} for b in boxes]}
    if env.get("HUGPY_ROUTER_PORT", "").isdigit():
        doc["health"] = "ok" if answers_health(env.get("HUGPY_ROUTER_HOST", "127.0.0.1"),
                                               int(env["HUGPY_ROUTER_PORT"])) else "down"
    return doc


# --- the command line --------------------------------------------------------------------------


def add_install_parsers(sub: argparse._SubParsersAction) -> None:
    """`install`, `uninstall` and `status`, with 0.0.4's options."""
    def mode(parser: argparse.ArgumentParser) -> None:
        group = parser.add_mutually_exclusive_group()
        group.add_argument("--system", dest="mode", action="store_const", const="system",
                           help=f"a system service as user {SERVICE} (needs root once)")
        group.add_argument("--user", dest="mode", action="store_const", const="user",
                           help="this user's own service (default)")
        parser.set_defaults(mode="user")

    install = sub.add_parser("install", help="install or repair the router as a systemd service")
    mode(install)
    install.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    install.add_argument("--port", help="port, or `auto` (required unless already configured)")
    install.add_argument("--package",
                         help=f"pip spec for the system service's code (default {PACKAGE}=={__version__})")
    install.add_argument("--no-local-box", action="store_true",
                         help="do not add this machine's hugpy-wrapper as a box")
    install.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    uninstall = sub.add_parser("uninstall", help="stop and remove the router service")
    mode(uninstall)
    uninstall.add_argument("--purge", action="store_true",
                           help="also remove config, boxes file, store (and the user)")
    uninstall.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    state = sub.add_parser("status", help="what is installed and whether it answers")
    mode(state)


def install_command(args: argparse.Namespace) -> int:
    """Runs install, uninstall or status. Returns the exit status (2: refused or failed)."""
    if args.mode == "user" and not os.environ.get("XDG_RUNTIME_DIR"):
        run_dir = f"/run/user/{os.getuid()}"  # systemctl --user needs it; sudo -i shells lack it
        if os.path.isdir(run_dir):
            os.environ["XDG_RUNTIME_DIR"] = run_dir
    try:
        if args.command == "status":
            print(json.dumps(status(args), indent=1))
            return 0
        plan = plan_install(args) if args.command == "install" else plan_uninstall(args)
        execute(plan, args.dry_run)
    except (InstallError, boxes_config.ConfigError, OSError) as exc:
        print(f"hugpy-router {args.command}: {exc}", file=sys.stderr)
        return 2
    return 0
