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
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, TypeVar

from router.boxes import config as boxes_config
from router.boxes.config import RegistryDown
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

    def _read(self, conn) -> boxes_config.BoxesFile:
        boxes = [row[0] for row in conn.execute("SELECT doc FROM boxes ORDER BY position, name")]
        aliases = {name: chain for name, chain in conn.execute("SELECT name, chain FROM aliases ORDER BY position, name")}
        return boxes_config.parse({"boxes": boxes, "aliases": aliases}, Path(self.where))

    def load(self) -> boxes_config.BoxesFile:
        try:
            with self.session.use() as conn:
                return self._read(conn)
        except self._errors as exc:
            raise RegistryDown(f"{self.where} unreachable: {type(exc).__name__}") from None

    def edit(self, change: Callable[[boxes_config.BoxesFile], T]) -> T:
        try:
            with self.session.use() as conn, conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (pg.REGISTRY_LOCK,))
                boxes = self._read(conn)
                result = change(boxes)
                write(conn, boxes)
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


def write(conn, boxes: boxes_config.BoxesFile) -> None:
    """Makes the tables hold `boxes` (rule 1), inside the caller's transaction."""
    from psycopg.types.json import Jsonb

    conn.execute("DELETE FROM boxes")
    conn.execute("DELETE FROM aliases")
    with conn.cursor() as cursor:
        cursor.executemany("INSERT INTO boxes (name, position, doc) VALUES (%s, %s, %s)",
                           [(box.name, n, Jsonb(box.to_json())) for n, box in enumerate(boxes.boxes)])
        cursor.executemany("INSERT INTO aliases (name, position, chain) VALUES (%s, %s, %s)",
                           [(a.name, n, Jsonb(list(a.chain))) for n, a in enumerate(boxes.aliases.values())])
