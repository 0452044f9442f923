"""`router log [--tail N] [--follow] [--json] [--store FILE]`: the newest calls of the route log.

Rules:
1. It reads the store file (`router.store.paths`, or `--store`), or the PostgreSQL store with
   `--database-url` (router.cli.store), in the same way as the admin API's
   `/v1/telemetry?tail=N`, so a running router is not asked and need not be up. SQLite's WAL
   lets it read while the router writes.
2. A line per call: when it arrived (UTC), its request id, facade, model, the box that served
   it, its state and HTTP status, and its timings (queue wait, first byte, total), then the
   error code if any. The route log holds no body, prompt, chunk or key, so neither does this;
   a column's control characters are shown escaped (`\x1b`), never sent to the terminal.
3. `--json`: each row as one JSON object per line, every column of the row.
4. `--follow` prints new rows as they are written (polled every FOLLOW_POLL_S), until Ctrl-C.
5. No store file yet is exit 1 with one line: a router has not run with that store.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import orjson

from router.cli.store import add_database_option, database_of
from router.store import engines, paths

# The route-log writer commits every 50 ms; half a second keeps `--follow` current to the eye
# at a cost of two index probes a second.
FOLLOW_POLL_S = 0.5
TAIL_DEFAULT = 20
TAIL_MAX = 5000


def _tail(value: str) -> int:
    count = int(value)
    if not 1 <= count <= TAIL_MAX:
        raise argparse.ArgumentTypeError(f"must be 1 to {TAIL_MAX}")
    return count


def add_log_parser(sub) -> None:
    log = sub.add_parser("log", help="show the newest calls of the route log (never a body)")
    log.add_argument("--tail", type=_tail, default=TAIL_DEFAULT,
                     help=f"how many of the newest calls (default {TAIL_DEFAULT}, at most {TAIL_MAX})")
    log.add_argument("--follow", action="store_true", help="keep printing new calls as they come, until Ctrl-C")
    log.add_argument("--json", action="store_true", help="one JSON object per call, every column")
    log.add_argument("--store", type=Path, default=None,
                     help="the router's store file (default: $HUGPY_ROUTER_HOME/router.sqlite3, as serve uses)")
    add_database_option(log)


def _ms(start: float | None, end: float | None) -> str:
    return f"{(end - start) * 1000:.0f}ms" if start is not None and end is not None else "-"


def _shown(text: str) -> str:
    """A column as the terminal may print it: a model name is the caller's own text, and a
    control character (ESC, CR, LF, tab) in it would forge lines or drive the operator's terminal."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def format_row(row: dict) -> str:
    """One call as a line (rule 2)."""
    at = row.get("received_at")
    when = datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z" if at else "-"
    status = f"{row.get('state') or '-'} {row.get('http_status') or '-'}"
    waited = row.get("waited_ms")
    timings = (f"wait {'-' if waited is None else f'{waited:.0f}ms'} "
               f"first {_ms(at, row.get('first_byte_at'))} total {_ms(at, row.get('responded_at'))}")
    fields = [when, row.get("request_id") or "-", row.get("facade") or "-", row.get("model") or "-",
              row.get("box") or "-", status, timings]
    if row.get("error"):
        fields.append(row["error"])
    return "\t".join(map(_shown, fields))


def _print(rows: list[dict], as_json: bool) -> None:
    for row in rows:
        print(orjson.dumps(row).decode() if as_json else format_row(row))
    sys.stdout.flush()


def log_command(args: argparse.Namespace) -> int:
    path = args.store or paths.db_path()
    url = database_of(args)
    if url is None and not Path(path).exists():
        print(f"router log: no route log at {path}: no router has run with this store yet", file=sys.stderr)
        return 1
    reader = engines.route_log(path, url)
    page = reader.read(tail=args.tail)
    _print(page["rows"], args.json)
    if not args.follow:
        return 0
    since = page["next"]
    try:
        while True:
            time.sleep(FOLLOW_POLL_S)
            page = reader.read(since, TAIL_MAX)
            _print(page["rows"], args.json)
            since = page["next"]
    except KeyboardInterrupt:
        return 0
