"""The route log's `router` column (router/store/route_log.py rule 14; SQLite migration 0006):
the instance name of the router that served the call, `host:port` unless `--instance` names it."""

from __future__ import annotations

import pytest

from router.sim import SimOllama

from conftest import wait_for
from support.calls import call, get_json

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("extra, expected", [((), None), (("--instance", "front-a"), "front-a")])
def test_a_single_router_names_itself_in_each_row(start_fleet, extra, expected):
    router = start_fleet(SimOllama("o", tags=["tiny"], loaded=["tiny"]), extra_args=extra)
    assert call(router)[0] == 200
    rows = wait_for(lambda: get_json(router, "/v1/telemetry?tail=5")["rows"])
    assert [row["router"] for row in rows] == [expected or router.url.removeprefix("http://")]
    assert get_json(router, "/v1/router/state")["database"] == {
        "engine": "sqlite", "up": True, "route_log_parked": 0, "route_log_dropped_while_down": 0}
