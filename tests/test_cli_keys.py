"""`router keys` (router/cli/keys.py): each subcommand through its own parser, on a real store
under HUGPY_ROUTER_HOME=tmp_path."""

from __future__ import annotations

import argparse
import time

import pytest

from router.boxes import listeners
from router.cli.keys import NOTE, add_keys_parser, keys_command
from router.core.access import hash_secret, parse_key
from router.store.keys import KeyStore


@pytest.fixture
def run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HUGPY_ROUTER_HOME", str(tmp_path))
    monkeypatch.delenv("HUGPY_ROUTER_PORT", raising=False)  # no port: the store file (rule 1)
    parser = argparse.ArgumentParser(prog="router")
    add_keys_parser(parser.add_subparsers(dest="command", required=True))

    def run(*argv: str) -> tuple[int, str, str]:
        code = keys_command(parser.parse_args(["keys", *argv]))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_create_prints_the_key_once_alone_on_stdout(run, tmp_path):
    code, out, err = run("create", "--name", "laptop")
    assert code == 0
    key = out.strip()
    key_id, secret = parse_key(key)
    assert NOTE in err and key_id in err and key not in err
    store = KeyStore(tmp_path / "router.sqlite3")
    assert store.scope_of(key, time.time(), None) == "use"
    store.close()
    code, out, err = run("list")
    assert key_id in out and "laptop" in out and "\tuse\t" in out
    assert secret not in out and hash_secret(secret) not in out


def test_admin_scope_and_expiry(run, tmp_path):
    code, out, _ = run("create", "--name", "ops", "--scope", "admin", "--expires-days", "0.5")
    assert code == 0
    store = KeyStore(tmp_path / "router.sqlite3")
    (entry,) = store.list()
    assert entry["scope"] == "admin"
    assert abs(entry["expires_at"] - entry["created_at"] - 43_200) < 1e-6
    assert store.scope_of(out.strip(), entry["expires_at"] + 1, None) is None
    store.close()


def test_revoke_and_list_all(run):
    _, out, _ = run("create", "--name", "old")
    key_id = parse_key(out.strip())[0]
    assert run("revoke", key_id)[:2] == (0, f"key {key_id} revoked\n")
    assert key_id not in run("list")[1]
    listed = run("list", "--all")[1]
    (line,) = [l for l in listed.splitlines() if l.startswith(key_id)]
    assert line.split("\t")[6] != "-"  # the revoked column is filled
    code, _, err = run("revoke", "0123456789")
    assert code == 1 and "no key with id 0123456789" in err


@pytest.mark.parametrize("argv", [["create", "--name", "  "], ["create", "--name", "x", "--expires-days", "-1"]])
def test_bad_input_exits_2_with_the_reason(run, argv):
    code, out, err = run(*argv)
    assert code == 2 and out == "" and err.startswith("router keys: ")


def test_scope_choices_come_from_the_parser(run):
    with pytest.raises(SystemExit):
        run("create", "--name", "x", "--scope", "root")


def test_limits_are_set_at_creation_changed_and_shown(run, tmp_path):
    _, out, _ = run("create", "--name", "team", "--rpm", "60", "--budget-tokens", "5000",
                    "--budget-period", "week", "--models", "llama3.2, qwen")
    key_id = parse_key(out.strip())[0]
    listed = run("list")[1]
    assert "rpm=60 budget_tokens=5000 budget_period=week models=llama3.2,qwen" in listed
    assert run("limits", key_id, "--rpm", "0", "--tpm", "1000", "--models", "")[:2] == (
        0, f"key {key_id} limits: tpm=1000 budget_tokens=5000 budget_period=week\n")
    code, out, _ = run("usage", key_id)
    assert code == 0 and f"{key_id}\tteam\tweek from " in out
    assert run("limits", "0123456789", "--rpm", "5")[0] == 1


def test_usage_on_the_store_file_says_why_left_is_empty_and_how_to_get_it(run, tmp_path, monkeypatch):
    boxes = tmp_path / "boxes.json"
    monkeypatch.setenv("HUGPY_ROUTER_BOXES", str(boxes))
    key_id = parse_key(run("create", "--name", "team", "--rpm", "60")[1].strip())[0]
    code, out, err = run("usage")
    assert code == 0 and "\t-\trpm=60" in out  # left: nothing, on the store file
    assert "`left` is empty" in err and "router keys --router-port PORT usage" in err, err
    listeners.write_record(boxes, "127.0.0.1", [8123, 11434])  # a router serving that boxes file (this pid)
    err = run("usage", "--json")[2]
    assert "a router runs on port 8123: router keys --router-port 8123 usage" in err, err
    run("limits", key_id, "--rpm", "0")
    assert run("usage")[2] == ""  # no limits: nothing is missing


@pytest.mark.parametrize("argv, reason", [
    (["--rpm", "-2"], "rpm must be a whole number"),
    (["--budget-period", "year"], "budget_period must be one of day, week, month"),
])
def test_bad_limits_exit_2_with_one_line_and_change_nothing(run, argv, reason):
    _, out, _ = run("create", "--name", "team", "--rpm", "5")
    key_id = parse_key(out.strip())[0]
    code, out, err = run("limits", key_id, *argv)
    assert code == 2 and out == "" and reason in err and err.count("\n") == 1
    assert "rpm=5\n" in run("list")[1] or "\trpm=5" in run("list")[1]
    code, _, err = run("create", "--name", "other", *argv)
    assert code == 2 and reason in err
