-- The routers on this database and their listeners (router/boxes/listeners.py rule 4): a row per
-- router instance, written at its start and deleted at its stop, so that any router and the CLI
-- refuse a box whose URL is one of them (a call sent there would loop through that router).
-- `doc`: {"host": bind address, "ports": [...], "machine": host name, "hosts": [names, addresses]}.
CREATE TABLE routers (
    instance text PRIMARY KEY,
    doc      jsonb NOT NULL,
    since    double precision NOT NULL DEFAULT extract(epoch FROM now())
);
