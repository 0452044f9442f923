"""`router boxes add|list|remove|block|unblock` and the boxes file's rules."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

from router.boxes import config

KEY = "hpk_box_Zm9vYmFyLWtleS1zZWNyZXQtdmFsdWUtMTIzNDU2"


def run(tmp_path, *args):
    return subprocess.run(
        [sys.executable, "-m", "router", "boxes", "--boxes-file", str(tmp_path / "boxes.json"), *args],
        capture_output=True, text=True, timeout=30,
    )


def test_add_reads_the_key_file_and_writes_0600(tmp_path):
    key_file = tmp_path / "wrapper.env"
    key_file.write_text(f'# hugpy\nFITEVICT_WORKER=ae\nFITEVICT_TOKEN="{KEY}"\n')
    result = run(tmp_path, "add", "--name", "ae", "--url", "http://127.0.0.1:40717",
                 "--key-file", str(key_file), "--pool", "gpu")
    assert result.returncode == 0, result.stderr
    path = tmp_path / "boxes.json"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    doc = json.loads(path.read_text())
    assert doc["boxes"] == [{"name": "ae", "url": "http://127.0.0.1:40717", "kind": "hugpy",
                             "key": KEY, "pool": "gpu"}]
    listed = run(tmp_path, "list")
    assert "ae\thugpy\thttp://127.0.0.1:40717" in listed.stdout
    assert KEY not in listed.stdout


def test_block_unblock_remove(tmp_path):
    assert run(tmp_path, "add", "--name", "a", "--url", "http://127.0.0.1:1").returncode == 0
    assert run(tmp_path, "add", "--name", "b", "--url", "http://127.0.0.1:2").returncode == 0
    assert run(tmp_path, "block", "a").returncode == 0
    boxes = config.load(tmp_path / "boxes.json").boxes
    assert [(b.name, b.blocked) for b in boxes] == [("a", True), ("b", False)]
    assert run(tmp_path, "unblock", "a").returncode == 0
    assert not config.load(tmp_path / "boxes.json").boxes[0].blocked
    assert run(tmp_path, "remove", "a").returncode == 0
    assert [b.name for b in config.load(tmp_path / "boxes.json").boxes] == ["b"]
    assert run(tmp_path, "remove", "zzz").returncode == 1


def test_bad_input_is_refused_with_a_clear_message(tmp_path):
    result = run(tmp_path, "add", "--name", "bad name", "--url", "http://127.0.0.1:1")
    assert result.returncode == 2 and "box name" in result.stderr
    result = run(tmp_path, "add", "--name", "a", "--url", "ftp://x")
    assert result.returncode == 2 and "url must be" in result.stderr
    (tmp_path / "empty.env").write_text("OTHER=1\n")
    result = run(tmp_path, "add", "--name", "a", "--url", "http://h:1", "--key-file", str(tmp_path / "empty.env"))
    assert result.returncode == 2 and "FITEVICT_TOKEN" in result.stderr


def test_serve_without_port_refuses_clearly(tmp_path):
    result = subprocess.run([sys.executable, "-m", "router", "serve"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "--port" in result.stderr


def test_no_option_is_prefix_matched_and_no_secret_is_echoed(tmp_path):
    for argv in (["add", "--name", "a", "--url", "http://h:1", "--key-f", KEY],
                 ["add", "--name", "a", "--url", "http://h:1", "--kye", "plain-secret-value"],
                 ["add", "--name", "a", "--url", "http://h:1", "--pool", "p", KEY]):
        result = run(tmp_path, *argv)
        assert result.returncode == 2
        assert "unrecognized arguments" in result.stderr
        assert KEY not in result.stderr and "plain-secret-value" not in result.stderr
    assert not (tmp_path / "boxes.json").exists()


def test_version_is_single_sourced():
    import importlib.metadata

    import router

    for prog in ("router", "hugpy-router"):
        exe = os.path.join(os.path.dirname(sys.executable), prog)
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
        assert out.split() == [prog, router.__version__]
    assert importlib.metadata.version("hugpy-router") == router.__version__


def test_add_over_a_taken_name_suggests_another_name_first(tmp_path):
    """Issue 38: a second box given a name already in the file is most often another box, so
    the refusal offers another --name before the edits of the box already there."""
    assert run(tmp_path, "add", "--name", "gpu1", "--url", "http://127.0.0.1:1").returncode == 0
    taken = run(tmp_path, "add", "--name", "gpu1", "--url", "http://127.0.0.1:2")
    assert taken.returncode == 1
    hint = taken.stderr
    assert "router boxes add --name gpu1-2 " in hint
    assert hint.index("another --name") < hint.index("router boxes set gpu1") < hint.index("--replace")
