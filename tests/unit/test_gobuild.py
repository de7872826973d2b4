"""The build runner every Go program of the suite goes through: an entry is found only when whole
and unchanged, an entry the builders left before they shared the runner is found without a
build, a build lands in its entry in one move, and a part that cannot be built fails under CI=true."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from e2e import gobuild, support


def _program(tmp_path, names=("one", "two")):
    return gobuild.Program(tmp_path / "module", {name: f"example.test/cmd/{name}" for name in names})


def _entry(tmp_path, bin_dir="bin", names=("one", "two")):
    build = gobuild.GoBuild("example", "example programs", tmp_path / "cache" / "example" / "example-v1-abc",
                            (_program(tmp_path, names),), bin_dir=bin_dir)  # fmt: skip
    (build.entry / bin_dir).mkdir(parents=True)
    for name in names:
        (build.entry / bin_dir / name).write_bytes(b"\x7fELF" + name.encode())
    return build


def test_a_whole_entry_is_found_and_a_changed_or_partial_one_is_not(tmp_path):
    build = _entry(tmp_path)
    assert gobuild.complete(build.entry, build.binaries) is None  # no manifest: never finished
    (build.entry / "manifest.json").write_text(json.dumps(gobuild.manifest(build.entry / "bin", build.binaries)))
    assert gobuild.complete(build.entry, build.binaries) == build.entry / "bin"
    (build.entry / "bin" / "two").write_bytes(b"truncated")
    assert gobuild.complete(build.entry, build.binaries) is None
    (build.entry / "bin" / "two").unlink()
    assert gobuild.complete(build.entry, build.binaries) is None


def test_an_entry_left_whole_by_an_earlier_builder_is_found_without_a_build(tmp_path):
    build = _entry(tmp_path)
    (build.entry / "build-info.json").write_text(json.dumps({"seconds": 1.0}))
    assert gobuild._adopt(build) == build.entry / "bin"
    assert gobuild.complete(build.entry, build.binaries) == build.entry / "bin"


def test_a_staging_directory_without_its_build_info_is_not_taken_for_a_whole_entry(tmp_path):
    build = _entry(tmp_path)
    assert gobuild._adopt(build) is None
    assert not (build.entry / "manifest.json").exists()


def test_a_single_binary_recorded_without_its_name_is_found_while_unchanged(tmp_path):
    build = _entry(tmp_path, bin_dir="", names=("runc",))
    recorded = gobuild.manifest(build.entry, ["runc"])["runc"]
    (build.entry / "manifest.json").write_text(json.dumps(recorded))
    assert gobuild._adopt(build) == build.entry
    assert gobuild.complete(build.entry, ["runc"], bin_dir="") == build.entry
    (build.entry / "manifest.json").write_text(json.dumps({**recorded, "size": recorded["size"] + 1}))
    assert gobuild._adopt(build) is None


def test_a_failed_step_names_the_step_and_its_log(tmp_path):
    log = tmp_path / "build.log"
    with pytest.raises(gobuild.BuildError) as err:
        gobuild.step("example", "build one", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], tmp_path, log)
    message = str(err.value)
    assert "build one" in message and str(log) in message and "exit 3" in message
    assert "boom" in log.read_text()


def _cannot(what="no `go`") -> None:
    raise gobuild.BuildError(what)


def test_a_part_that_cannot_be_built_fails_its_command_and_an_optional_one_only_under_ci(monkeypatch, capsys):
    monkeypatch.delenv("CI", raising=False)
    assert gobuild.main("example", _cannot) == 1
    assert gobuild.main("example", _cannot, optional="the tests that run containers") == 0
    assert "the tests that run containers will skip: no `go`" in capsys.readouterr().err
    monkeypatch.setenv("CI", "true")
    assert gobuild.main("example", _cannot, optional="the tests that run containers") == 1
    assert "error: no `go`" in capsys.readouterr().err


def test_a_build_lands_whole_in_its_entry_and_is_found_the_next_time(request, tmp_path, monkeypatch, capsys):
    if shutil.which("go") is None:
        support.cannot_run(request, "Go build runner", "`go` is not on PATH")
    module = tmp_path / "module"
    for name in ("one", "two"):
        (module / "cmd" / name).mkdir(parents=True)
        (module / "cmd" / name / "main.go").write_text('package main\n\nfunc main() { println("hi") }\n')
    (module / "go.mod").write_text("module example.test\n\ngo 1.22\n")
    (module / "go.sum").write_text("")
    build = gobuild.GoBuild("example", "example programs", tmp_path / "cache" / "example" / "example-v1-abc",
                            (gobuild.Program(module, {"one": "example.test/cmd/one", "uno": "example.test/cmd/two"}),))  # fmt: skip
    (build.entry.parent).mkdir(parents=True)
    (build.entry.parent / f"{build.entry.name}.partial-1").mkdir()  # an interrupted build's leftovers
    bin_dir = gobuild.ensure(build)
    assert bin_dir == build.entry / "bin"
    assert sorted(os.listdir(bin_dir)) == ["one", "uno"]  # named as asked, not after the package's folder
    assert json.loads((build.entry / "build-info.json").read_text())["go"] == gobuild.go_version()
    assert not list(build.entry.parent.glob("*.partial-*"))
    assert "[example] built in" in capsys.readouterr().err
    assert gobuild.ensure(build) == bin_dir
    assert "[example]" not in capsys.readouterr().err  # found: nothing ran
