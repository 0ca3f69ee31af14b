"""Chapter 1 (book/01_gguf.ipynb, `ds4ref.bundled`): the book's data and results are found from
the package, so that a chapter runs from any working directory, and a wheel carries them."""
from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import ds4ref.bundled as bundled
from ds4ref.bundled import DataNotFoundError, data_path, results_path

ROOT = Path(__file__).resolve().parents[1]


def test_data_and_results_are_the_checkouts():
    assert data_path("oracle", "ops_A.npz") == ROOT / "data" / "oracle" / "ops_A.npz"
    assert data_path() == ROOT / "data"
    assert results_path("trained.json") == ROOT / "book" / "results" / "trained.json"
    assert json.loads(results_path("trained.json").read_text())      # a real file


def test_an_installed_copy_comes_first_and_a_missing_one_is_named(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "ds4ref"
    (pkg / "data" / "oracle").mkdir(parents=True)
    (pkg / "results").mkdir()
    monkeypatch.setattr(bundled, "_package_dir", lambda: pkg)
    assert data_path("oracle", "x.npz") == pkg / "data" / "oracle" / "x.npz"
    assert results_path("a.json") == pkg / "results" / "a.json"
    lone = tmp_path / "lone" / "ds4ref"
    lone.mkdir(parents=True)
    monkeypatch.setattr(bundled, "_package_dir", lambda: lone)
    with pytest.raises(DataNotFoundError, match=r"data: not found at .*lone/ds4ref/data \(an "
                       r"install\) nor .*lone/data \(a clone\)") as e:
        data_path("oracle")
    assert isinstance(e.value, FileNotFoundError)
    with pytest.raises(DataNotFoundError, match="book/results: not found"):
        results_path()


def test_a_wheel_carries_every_data_and_results_file():
    """pyproject.toml maps data/ and book/results/ into the package (ds4ref.data,
    ds4ref.results) and its package-data patterns match every file there that git tracks."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    tracked = subprocess.run(["git", "ls-files", "data", "book/results"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    assert len(tracked) > 20
    for pkg, folder in (("ds4ref.data", "data"), ("ds4ref.results", "book/results")):
        assert pkg in conf["packages"] and conf["package-dir"][pkg] == folder
    missed = []
    for f in tracked:
        # the package of a file is its folder's, which must be listed (setuptools warns
        # of a data folder that is not), and one of that package's patterns must match
        folder, name = f.rsplit("/", 1)
        pkg = ("ds4ref.results" if folder == "book/results"
               else "ds4ref." + folder.replace("/", "."))
        patterns = conf["package-data"].get(pkg, ())
        if pkg not in conf["packages"] or not any(fnmatch.fnmatch(name, p)
                                                  for p in patterns):
            missed.append(f)
    assert not missed, missed


def test_a_chapter_runs_from_another_directory(tmp_path):
    """Chapter 0's code, run as a script from an unrelated folder, prints what the chapter
    stored."""
    nb = json.loads((ROOT / "book" / "00_intro.ipynb").read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    script = "\n\n".join("".join(c["source"]) for c in code)
    want = "".join("".join(o["text"]) for c in code for o in c["outputs"]
                   if o["output_type"] == "stream")
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == want
    assert "../data" not in script
