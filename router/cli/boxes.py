"""`router boxes list | add | set | remove | block | unblock`: the boxes file.

Rules:
1. Every change is one registry edit (the boxes file's `boxes_config.edit`, or the database's
   with `--database-url`: locked, atomic), the code path of the admin API's box routes; a
   running router applies it within a second (its file watch, or the database's
   notification), or at once on SIGHUP.
2. `add` adds a box. Over an existing name it refuses (exit 1) unless `--replace` is given,
   which replaces the box whole; a replace that leaves out the key the box had says that it
   dropped it.
3. `set NAME` changes only the fields it names and keeps every other (the key included), as
   the admin API's `PUT /v1/boxes/<name>` does. An empty value (`--pool ''`, `--agent ''`,
   `--store ''`, `--max-inflight none`) clears the field.
4. A field that does not validate (router.core.box_fields), or a URL that names the listeners
   of the router serving this boxes file (router.boxes.listeners rule 2) or of any router on
   the database (its rule 4), exits 2 with one line; nothing is written. An unknown box exits 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from router.boxes import config as boxes_config
from router.boxes import listeners
from router.cli.store import add_database_option, registry_of
from router.core.types import BoxKind


def _limit(value: str) -> int | None:
    if value.strip().lower() in ("", "none"):
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number or 'none' (got {value!r})") from None


def add_boxes_parser(sub) -> None:
    boxes = sub.add_parser("boxes", help="manage the boxes file")
    boxes.add_argument("--boxes-file", type=Path, default=None)
    add_database_option(boxes)
    bsub = boxes.add_subparsers(dest="boxes_command", required=True)
    add = bsub.add_parser("add", help="add a box (--replace: replace the box of that name whole)")
    add.add_argument("--name", required=True)
    add.add_argument("--url", required=True, help="http(s)://host:port of the box's front door")
    add.add_argument("--kind", choices=[k.value for k in BoxKind], default=BoxKind.HUGPY.value)
    add.add_argument("--replace", action="store_true",
                     help="replace a box of that name whole (its key too: give it again)")
    _key_options(add)
    add.add_argument("--store", help="the box's store file, when readable on this machine")
    add.add_argument("--pool")
    add.add_argument("--agent", help="http://host:port of a `router agent` on the box's host (GPU telemetry)")
    add.add_argument("--max-inflight", type=_limit, default=None,
                     help="calls the box takes at once, from every facade; more wait in the router's queue")
    change = bsub.add_parser("set", help="change only the named fields of a box (its key stays unless given)")
    change.add_argument("name")
    change.add_argument("--kind", choices=[k.value for k in BoxKind], default=None)
    _key_options(change)
    change.add_argument("--store", default=None, help="the box's store file ('' clears it)")
    change.add_argument("--pool", default=None, help="'' clears it")
    change.add_argument("--agent", default=None, help="http://host:port of a `router agent` ('' clears it)")
    change.add_argument("--max-inflight", type=_limit, default=argparse.SUPPRESS,
                        help="calls the box takes at once ('none' clears it)")
    bsub.add_parser("list", help="list boxes (keys are never shown)")
    for name in ("remove", "block", "unblock"):
        cmd = bsub.add_parser(name, help=f"{name} a box")
        cmd.add_argument("name")


def _key_options(parser: argparse.ArgumentParser) -> None:
    key = parser.add_mutually_exclusive_group()
    key.add_argument("--key", help="the box key itself (hpk_box_...)")
    key.add_argument("--key-file", help="env file with the box key (FITEVICT_TOKEN=...)")


def _key(args: argparse.Namespace) -> str | None:
    return boxes_config.read_key_file(args.key_file) if args.key_file else args.key


def _not_this_router(args: argparse.Namespace, peers: list, box: boxes_config.BoxConfig) -> None:
    """Rule 4: raises ConfigError when the box names the listeners of the router serving the
    boxes file (the router of this machine, with a database), or of any of `peers`, the routers
    on the database (router.boxes.listeners rule 4)."""
    running = listeners.read_record(args.boxes_file or boxes_config.default_path())
    if running is not None:
        running.check([box])
    listeners.check_peers([box], peers)


def boxes_command(args: argparse.Namespace) -> int:
    registry, path = registry_of(args)
    if args.boxes_command == "list":
        for box in registry.load().boxes:
            flags = " ".join(
                f for f in (f"pool={box.pool}" if box.pool else "", "blocked" if box.blocked else "",
                            "key" if box.key else "no-key", f"store={box.store}" if box.store else "",
                            f"max_inflight={box.max_inflight}" if box.max_inflight else "") if f
            )
            print(f"{box.name}\t{box.kind.value}\t{box.url}\t{flags}")
        return 0
    try:
        if args.boxes_command == "add":
            return _add(args, registry, path)
        if args.boxes_command == "set":
            return _set(args, registry)
        if args.boxes_command == "remove":
            registry.edit(lambda boxes: boxes.remove(args.name))
        else:
            blocked = args.boxes_command == "block"
            registry.edit(lambda boxes: boxes.update(args.name, blocked=blocked))
    except boxes_config.UnknownBox:
        print(f"router: no box named {args.name} in {path}", file=sys.stderr)
        return 1
    except boxes_config.BoxExists as exc:
        # A new box first: one that takes a taken name is most often another box, not this one.
        print(f"router: box {exc.name} is already in {path}: for another box, give it another --name "
              f"(`router boxes add --name {exc.name}-2 ...`); for this one, `router boxes set {exc.name} ...` "
              "changes some of its fields, `router boxes add --replace ...` replaces it whole", file=sys.stderr)
        return 1
    print(f"box {args.name}: {args.boxes_command} done")
    return 0


def _add(args: argparse.Namespace, registry: boxes_config.Registry, path: str) -> int:
    new = boxes_config.BoxConfig(
        name=args.name, url=args.url.rstrip("/"), kind=BoxKind(args.kind), key=_key(args),
        store=args.store, pool=args.pool or None, agent=args.agent, max_inflight=args.max_inflight,
    )

    peers = registry.peers()

    def change(boxes: boxes_config.BoxesFile) -> boxes_config.BoxConfig | None:
        old = boxes.find(new.name)
        boxes.put(new, replace=args.replace)
        _not_this_router(args, peers, new)
        return old

    old = registry.edit(change)
    print(f"box {new.name} {'replaced' if old else 'added'} in {path}")
    if old is not None and old.key and not new.key:
        print(f"box {new.name}: its key was dropped (give --key or --key-file to keep one; "
              "`router boxes set` keeps what it does not name)", file=sys.stderr)
    return 0


def _set(args: argparse.Namespace, registry: boxes_config.Registry) -> int:
    fields: dict = {}
    if args.kind is not None:
        fields["kind"] = args.kind
    if args.key is not None or args.key_file is not None:
        fields["key"] = _key(args)
    for name in ("store", "pool", "agent"):
        value = getattr(args, name)
        if value is not None:
            fields[name] = value or None
    if hasattr(args, "max_inflight"):
        fields["max_inflight"] = args.max_inflight
    if not fields:
        print("router: boxes set: name at least one field to change (see --help)", file=sys.stderr)
        return 2

    peers = registry.peers()

    def change(boxes: boxes_config.BoxesFile) -> None:
        _not_this_router(args, peers, boxes.update(args.name, **fields))

    registry.edit(change)
    shown = ", ".join(f"{k}={'(set)' if k == 'key' else (v if v is not None else 'none')}" for k, v in fields.items())
    print(f"box {args.name}: {shown}")
    return 0
