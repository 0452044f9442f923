"""The boxes registry and the aliases in PostgreSQL (router.boxes.config rule 8).

Rules:
1. The tables hold exactly a boxes file's contents: `boxes` (an entry per box, as the file
   writes it, in `position` order) and `aliases`. `load` builds the file's document from them
   and parses it with router.boxes.config.parse, so one validator serves the file, the CLI, the
   admin API and this registry.
2. `edit` is the file's rule 5 in one transaction: the transaction advisory lock REGISTRY_LOCK
   (other routers and CLIs wait), read, change, validate, write; a change that fails writes
   nothing. The tables' triggers notify every router at commit (router.store.pg.conn rule 4).
3. `stamp` is the `boxes` topic's version (0 before any edit). While the database is down it
   answers the last stamp it read, so the fleet keeps its last copy and does not reload; the
   LISTEN task reloads when the database is back.
4. A database that cannot be reached raises RegistryDown (an OSError: the admin API answers
   503 for it, as for an unwritable file).
5. Several routers share these tables, and an entry may be bad on one of them only (a store
   path that is something else on this machine, a version skew): `load` skips a bad entry and
   says it (`skipped`; router.boxes.fleet rule 4) and the rest applies. `edit` reads the same
   way and writes a skipped entry back as it was (it may be good on the router that wrote it);
   an edit that puts a box of that name replaces it.
6. `announce` writes this router's listeners to the `routers` table at start, `withdraw`
   deletes them at stop, and `peers` reads every router's (router.boxes.listeners rule 4).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, TypeVar

from router.boxes import config as boxes_config
from router.boxes.config import RegistryDown
from router.boxes.listeners import Peer
from router.store.pg import conn as pg

log = logging.getLogger("router.boxes")
T = TypeVar("T")


class PgRegistry:
    """The boxes and aliases in PostgreSQL (rules 1-4)."""

    def __init__(self, url: str) -> None:
        self.session = pg.Session(url)
        import psycopg

        self._errors = psycopg.Error
        self.where = f"boxes registry in {pg.shown(url)}"
        self._stamp: object = 0
        self._down = False

    def _read(self, conn, skip_bad: bool = False) -> boxes_config.BoxesFile:
        boxes = [row[0] for row in conn.execute("SELECT doc FROM boxes ORDER BY position, name")]
        aliases = {name: chain for name, chain in conn.execute("SELECT name, chain FROM aliases ORDER BY position, name")}
        return boxes_config.parse({"boxes": boxes, "aliases": aliases}, Path("boxes"), self.where, skip_bad)

    def load(self) -> boxes_config.BoxesFile:
        try:
            with self.session.use() as conn:
                return self._read(conn, skip_bad=True)
        except self._errors as exc:
            raise RegistryDown(f"{self.where} unreachable: {type(exc).__name__}") from None

    def announce(self, peer: Peer) -> None:
        """Rule 6. Raises RegistryDown."""
        from psycopg.types.json import Jsonb

        self._run("INSERT INTO routers (instance, doc) VALUES (%s, %s) ON CONFLICT (instance) DO UPDATE"
                  " SET doc = excluded.doc, since = excluded.since", (peer.instance, Jsonb(peer.doc())))

    def withdraw(self, instance: str) -> None:
        self._run("DELETE FROM routers WHERE instance = %s", (instance,))

    def peers(self) -> list[Peer]:
        """Rule 6: every router's listeners; a row this code cannot read is left out. Raises RegistryDown."""
        rows = self._run("SELECT instance, doc FROM routers ORDER BY instance")
        peers = []
        for instance, doc in rows:
            try:
                peers.append(Peer.from_doc(instance, doc))
            except (KeyError, TypeError, ValueError):
                log.warning("%s: router %r's listeners cannot be read; left out", self.where, instance[:64])
        return peers

    def _run(self, sql: str, params: tuple = ()) -> list[tuple]:
        try:
            with self.session.use() as conn:
                cursor = conn.execute(sql, params)
                return cursor.fetchall() if cursor.description else []
        except self._errors as exc:
            raise RegistryDown(f"{self.where} unreachable: {type(exc).__name__}") from None

    def edit(self, change: Callable[[boxes_config.BoxesFile], T]) -> T:
        try:
            with self.session.use() as conn, conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (pg.REGISTRY_LOCK,))
                boxes = self._read(conn, skip_bad=True)
                good = {box.name for box in boxes.boxes}
                result = change(boxes)
                write(conn, boxes, keep=[name for (name,) in conn.execute("SELECT name FROM boxes")
                                         if name not in good])  # rule 5: the skipped entries
        except self._errors as exc:
            raise RegistryDown(f"{self.where} unreachable: {type(exc).__name__}") from None
        return result

    def stamp(self) -> object:
        try:
            with self.session.use() as conn:
                found = conn.execute("SELECT version FROM store_versions WHERE topic = 'boxes'").fetchone()
        except self._errors as exc:
            if not self._down:
                self._down = True
                log.warning("%s unreachable (%s): the last fleet keeps serving", self.where, type(exc).__name__)
            return self._stamp
        self._down = False
        self._stamp = found[0] if found else 0
        return self._stamp

    def close(self) -> None:
        self.session.close()


def write(conn, boxes: boxes_config.BoxesFile, keep: list[str] = ()) -> None:  # type: ignore[assignment]
    """Makes the tables hold `boxes` (rule 1), and the rows of the boxes named in `keep` as they
    are (rule 5) unless `boxes` has one of that name, inside the caller's transaction."""
    from psycopg.types.json import Jsonb

    conn.execute("DELETE FROM boxes WHERE NOT (name = ANY(%s))", (list(set(keep) - {b.name for b in boxes.boxes}),))
    conn.execute("DELETE FROM aliases")
    with conn.cursor() as cursor:
        cursor.executemany("INSERT INTO boxes (name, position, doc) VALUES (%s, %s, %s)",
                           [(box.name, n, Jsonb(box.to_json())) for n, box in enumerate(boxes.boxes)])
        cursor.executemany("INSERT INTO aliases (name, position, chain) VALUES (%s, %s, %s)",
                           [(a.name, n, Jsonb(list(a.chain))) for n, a in enumerate(boxes.aliases.values())])
