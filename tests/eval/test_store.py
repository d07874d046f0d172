"""``kvpass.eval.store``: plain and gzipped (``.json.gz``) stores, their shards, atomic deterministic writes,
and the ``read_json`` / ``write_json`` helpers the benchmark scripts use."""

from __future__ import annotations

import ast
import gzip
import json
import random
import sys
from pathlib import Path

import pytest

from kvpass.eval.store import (
    Store,
    case_key,
    is_gzip,
    merge_shards,
    read_json,
    shard_path,
    shard_paths,
    split_name,
    write_json,
)


def random_cases(n: int, seed: int = 0) -> list[dict]:
    """``n`` records shaped like scored suite cases, with fresh random content (keys unique)."""
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        fields = {"policy": rng.choice(["snapkv", "d2o[scores=window]", "full"]), "budget": rng.choice([0.1, 0.2, 0.5]),
                  "seed": i, "mode": rng.choice(["query_aware", "query_agnostic"])}
        cases.append({"key": case_key(**fields), **fields, "output": "".join(rng.choice("abcé→ ") for _ in range(12)),
                      "correct": rng.random() < 0.5, "seconds": rng.random(), "cache_bytes": rng.randrange(1 << 20)})
    rng.shuffle(cases)
    return cases


@pytest.mark.parametrize(("name", "base", "suffix"), [("x.json.gz", "x", ".json.gz"), ("x.json", "x", ".json"),
                                                      ("a.b-cases.json.gz", "a.b-cases", ".json.gz"),
                                                      ("x.gz", "x", ".gz"), ("x", "x", "")])
def test_split_name_and_shard_path(name, base, suffix):
    assert split_name(Path("d") / name) == (base, suffix)
    assert shard_path(Path("d") / name, 3) == Path("d") / f"{base}.shard3{suffix}"
    assert is_gzip(name) == (suffix == ".json.gz")


def test_gzip_store_round_trip_keeps_every_case(tmp_path):
    cases = random_cases(50)
    store = Store(tmp_path / "sub" / "s.json.gz", meta={"model": "smollm2"})      # the parent is created
    store.add_many(cases)
    raw = (tmp_path / "sub" / "s.json.gz").read_bytes()
    assert raw[:2] == b"\x1f\x8b"                                                  # gzip magic
    body = json.loads(gzip.decompress(raw))
    assert [c["key"] for c in body["cases"]] == sorted(c["key"] for c in cases)   # sorted by key
    assert body["meta"] == {"schema": 1, "model": "smollm2"}
    again = Store(tmp_path / "sub" / "s.json.gz")
    assert again.cases == {c["key"]: c for c in cases} and again.meta == store.meta
    assert not list((tmp_path / "sub").glob("*.tmp"))


def test_gzip_store_bytes_depend_only_on_content(tmp_path):
    cases = random_cases(30, seed=1)
    a, b = Store(tmp_path / "a.json.gz"), Store(tmp_path / "b.json.gz")
    a.add_many(cases)
    for c in reversed(cases):                       # another insertion order, one write per case
        b.add(dict(reversed(list(c.items()))))      # and another field order
    assert (tmp_path / "a.json.gz").read_bytes() == (tmp_path / "b.json.gz").read_bytes()
    header = (tmp_path / "a.json.gz").read_bytes()[:10]
    assert header[4:8] == b"\0\0\0\0"               # mtime 0: no timestamp in the bytes
    b.add({**cases[0], "correct": not cases[0]["correct"]})
    assert (tmp_path / "a.json.gz").read_bytes() != (tmp_path / "b.json.gz").read_bytes()


def test_plain_json_store_is_unchanged(tmp_path):
    cases = random_cases(20, seed=2)
    store = Store(tmp_path / "p.json")
    store.add_many(cases)
    text = (tmp_path / "p.json").read_text(encoding="utf-8")
    body = {"meta": {"schema": 1}, "cases": sorted(cases, key=lambda c: c["key"])}
    assert text == json.dumps(body, indent=1, sort_keys=True)                    # the format of before
    assert Store(tmp_path / "p.json").cases == {c["key"]: c for c in cases}


@pytest.mark.parametrize("name", ["m.json", "m.json.gz"])
def test_shards_are_read_and_merged_in_the_store_format(tmp_path, name):
    cases = random_cases(40, seed=3)
    path = tmp_path / name
    Store(path).add_many(cases[:10])
    for i in range(3):                                 # three workers, each into its own shard
        Store(path, write_path=shard_path(path, i)).add_many(cases[10 + 10 * i: 20 + 10 * i])
    shards = shard_paths(path)
    assert [p.name for p in shards] == [shard_path(path, i).name for i in range(3)]
    assert all(is_gzip(p) == is_gzip(path) for p in shards)
    assert len(Store(path)) == 40                      # the store reads through its shards
    merged = merge_shards(path)
    assert merged.cases == {c["key"]: c for c in cases}
    assert shard_paths(path) == [] and sorted(p.name for p in tmp_path.iterdir()) == [name]
    assert Store(path).cases == merged.cases


def test_gzip_store_does_not_read_plain_shards_or_the_other_way(tmp_path):
    gz, plain = tmp_path / "s.json.gz", tmp_path / "s.json"
    Store(gz, write_path=shard_path(gz, 0)).add(random_cases(1, seed=4)[0])
    Store(plain, write_path=shard_path(plain, 0)).add(random_cases(1, seed=5)[0])
    assert [p.name for p in shard_paths(gz)] == ["s.shard0.json.gz"]
    assert [p.name for p in shard_paths(plain)] == ["s.shard0.json"]


def test_read_and_write_json_helpers(tmp_path):
    obj = {"b": [1, 2.5, None, "ü"], "a": {"z": True}}
    for name in ("o.json", "o.json.gz", "deep/o.json.gz"):
        path = write_json(tmp_path / name, obj)
        assert read_json(path) == obj
        assert read_json(str(path)) == obj
    assert (tmp_path / "o.json").read_text(encoding="utf-8").startswith('{\n "a"')         # plain: indent 1, sorted
    assert gzip.decompress((tmp_path / "o.json.gz").read_bytes()).startswith(b'{"a":{"z":true}')  # compact, sorted
    with pytest.raises(gzip.BadGzipFile):                # a .json.gz that is not gzip is an error, not guessed
        (tmp_path / "bad.json.gz").write_text("{}")
        read_json(tmp_path / "bad.json.gz")


def test_suite_gpu_seed_one_liner_reads_a_gzipped_seed(tmp_path):
    """benchmarks/suite_gpu.sh's SEED step: the spec's cases of a .json.gz store into a plain per-process store,
    with store.py loaded by path (what the script runs)."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    script = (root / "benchmarks" / "suite_gpu.sh").read_text()
    start = script.index('$py -c "import sys; sys.path.insert(0, sys.argv[4])')
    code = script[start + len('$py -c "'): script.index('" "$SEED"', start)]
    cases = random_cases(30, seed=6)
    seed = tmp_path / "seed.json.gz"
    Store(seed, meta={"model": "smollm2"}).add_many(cases)
    out = tmp_path / "snapkv" / "quality-suite-smollm2-cases.json"
    subprocess.run([sys.executable, "-c", code, str(seed), "snapkv", str(out), str(root / "kvpass" / "eval")],
                   check=True, cwd=tmp_path)
    got = json.loads(out.read_text(encoding="utf-8"))                    # plain JSON on the GPU machine
    assert got["meta"]["model"] == "smollm2"
    assert {c["key"] for c in got["cases"]} == {c["key"] for c in cases if c["policy"] == "snapkv"}


def test_store_module_imports_only_the_standard_library():
    """The peers venv loads kvpass/eval/store.py by path (benchmarks/peers/cases.py): no kvpass, no torch."""
    import kvpass.eval.store as store

    tree = ast.parse(Path(store.__file__).read_text(encoding="utf-8"))
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names and names <= set(sys.stdlib_module_names) | {"__future__"}, names


def test_merge_suite_stores_folds_plain_and_gzipped_folders_into_a_gzipped_store(tmp_path, capsys):
    """benchmarks/merge_suite_stores.py: per-process stores (plain on the GPU machine, or gzipped) and their
    shards added to the committed .json.gz store."""
    from benchmarks.merge_suite_stores import main

    cases = [{**c, "kind": "suite"} for c in random_cases(30, seed=7)]
    merged = tmp_path / "quality-suite-smollm2-cases.json.gz"
    Store(merged).add_many(cases[:10])                                  # what is committed already
    plain = tmp_path / "out" / "snapkv" / "quality-suite-smollm2-cases.json"
    Store(plain).add_many(cases[10:15])
    Store(plain, write_path=shard_path(plain, 1)).add_many(cases[15:20])
    Store(tmp_path / "out" / "d2o" / "quality-suite-smollm2-cases.json.gz").add_many(cases[20:])
    main(str(tmp_path / "out"), str(merged), "smollm2")
    assert "30 suite cases" in capsys.readouterr().out
    assert Store(merged).cases == {c["key"]: c for c in cases} and is_gzip(merged)
