"""`router batches [--database-url URL] list | show ID | cancel ID`: the batches in the store
(docs/batches.md).

Rules:
1. The command works on the store itself (`router.store.engines.batches`): the store file under
   `$HUGPY_ROUTER_HOME` (router.store.paths), or the PostgreSQL store of `--database-url` (default
   `$HUGPY_ROUTER_DATABASE_URL`), as `router keys` does. Every owner's batches are shown: this is
   the operator's view, as an admin key's `GET /v1/batches` is.
2. `list` prints one line per batch, newest first (id, owner, status, endpoint, completed/failed/total
   lines, created), at most `--limit`; `--owner` keeps one owner's (a key's id, `admin`, or
   `inside` for keyless callers); `--json` prints OpenAI's list object, as `GET /v1/batches` does.
3. `show ID` prints the batch as OpenAI's batch object (router.core.batches.batch_object), as
   `GET /v1/batches/ID` does. Neither prints a line's body or answer.
4. `cancel ID` marks a validating or in-progress batch `cancelling`; a running router (any, on a
   shared store) ends its unrun lines `batch_cancelled` and the batch `cancelled` once its running
   lines are done. Cancelling a cancelling batch says so again; any other batch (failed, finalizing
   or ended) is left as it is, said on stderr, exit 1.
5. An unknown id exits 1, said on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone

from router.cli.store import add_database_option, database_of
from router.core.batches import batch_object, list_object
from router.store import engines, paths
from router.store.batches import CANCELLED_FROM

DEFAULT_LIST_LIMIT = 100
MAX_LIST_LIMIT = 10_000


def add_batches_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds `batches` and its subcommands to `subparsers`. Returns the `batches` parser."""
    batches = subparsers.add_parser(
        "batches", help="see and cancel batches (OpenAI's Batch API)",
        description=f"The batches in the router's store ({paths.db_path()} here).",
    )
    add_database_option(batches)
    bsub = batches.add_subparsers(dest="batches_command", required=True)
    listing = bsub.add_parser("list", help="every owner's batches, newest first")
    listing.add_argument("--owner", default=None, help="only this owner's: a key's id, admin, or inside (keyless callers)")
    listing.add_argument("--limit", type=_list_limit, default=DEFAULT_LIST_LIMIT, metavar="N",
                         help=f"at most this many (1-{MAX_LIST_LIMIT}, default {DEFAULT_LIST_LIMIT})")
    listing.add_argument("--json", action="store_true", help="print OpenAI's list object, as GET /v1/batches does")
    show = bsub.add_parser("show", help="a batch as OpenAI's batch object (JSON)")
    show.add_argument("id")
    cancel = bsub.add_parser("cancel", help="cancel a batch: its unrun lines end, its run ones are kept")
    cancel.add_argument("id")
    return batches


def _list_limit(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_LIST_LIMIT:
        raise argparse.ArgumentTypeError(f"must be 1 to {MAX_LIST_LIMIT}")
    return value


def _when(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def batches_command(args: argparse.Namespace) -> int:
    """Runs one `router batches` subcommand. Returns the exit status. Raises ConfigError when the
    store cannot be opened (main prints it and exits 2)."""
    store = engines.batches(paths.db_path(), database_of(args))
    try:
        if args.batches_command == "list":
            return _list(store, args)
        row = store.batch(args.id) if args.batches_command == "show" else store.cancel(args.id, time.time())
        if row is None:
            print(f"router batches: no batch with id {args.id}", file=sys.stderr)
            return 1
        if args.batches_command == "show":
            print(json.dumps(batch_object(row), indent=1))
            return 0
        if row.status != "cancelling":
            print(f"router batches: batch {args.id} is {row.status}: only a batch {' or '.join(CANCELLED_FROM)} "
                  "can be cancelled", file=sys.stderr)
            return 1
        print(f"batch {args.id} cancelling: its unrun lines end batch_cancelled, and it ends cancelled once "
              f"its running lines are done ({(row.completed or 0) + (row.failed or 0)} of {row.total or 0} lines "
              "done)")
        return 0
    finally:
        store.close()


def _list(store, args: argparse.Namespace) -> int:
    rows = store.batches(args.owner, args.limit + 1, None)
    shown = rows[:args.limit]
    if args.json:
        print(json.dumps(list_object([batch_object(row) for row in shown], len(rows) > args.limit), indent=1))
        return 0
    print("id\towner\tstatus\tendpoint\tcompleted/failed/total\tcreated")
    for row in shown:
        print("\t".join((row.id, row.owner, row.status, row.endpoint,
                         f"{row.completed or 0}/{row.failed or 0}/{row.total or 0}", _when(row.created_at))))
    if len(rows) > args.limit:
        print(f"router batches: more than {args.limit}; --limit N shows more", file=sys.stderr)
    return 0
