"""Sources: datasets saved with save_to_disk, byte-order marks, corrupt Parquet, binary files."""

from __future__ import annotations

import builtins
import json
import os
import random

import pytest

from conftest import write_jsonl
from trainforge.data.sources import BadRows, DataError, expand_paths, iter_source, source_files

BOM = b"\xef\xbb\xbf"


def rows_of(spec, policy="error", txt_mode="file"):
    return list(iter_source(str(spec), BadRows(policy), txt_mode))


# ---------------------------------------------------------------- datasets saved with save_to_disk


@pytest.fixture
def datasets():
    return pytest.importorskip("datasets")


def test_saved_dataset_rows_are_streamed_in_order_with_locations(tmp_path, datasets):
    texts = [f"document {i}" for i in range(2500)]  # more than one read batch
    datasets.Dataset.from_dict({"text": texts, "n": list(range(2500))}).save_to_disk(tmp_path / "ds")
    got = rows_of(tmp_path / "ds")
    assert [r.data for r in got] == [{"text": t, "n": i} for i, t in enumerate(texts)]
    assert got[0].where == f"{tmp_path / 'ds'}: row 1" and got[-1].where == f"{tmp_path / 'ds'}: row 2500"
    assert expand_paths(str(tmp_path / "ds")) == [tmp_path / "ds"]  # not its state.json / dataset_info.json


def test_saved_dataset_keeps_nested_fields_and_ignores_a_stored_format(tmp_path, datasets):
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    ds = datasets.Dataset.from_dict({"messages": [convo, convo]}).with_format("numpy")
    ds.save_to_disk(tmp_path / "chat")
    assert [r.data for r in rows_of(tmp_path / "chat")] == [{"messages": convo}] * 2


def test_saved_dataset_dict_reads_its_train_split_and_says_so(tmp_path, datasets):
    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"text": ["a", "b"]}), "test": datasets.Dataset.from_dict({"text": ["z"]})}
    )
    dd.save_to_disk(tmp_path / "dd")
    got = rows_of(tmp_path / "dd")
    assert [r.data["text"] for r in got] == ["a", "b"]
    assert [r.where for r in got] == [f"{tmp_path / 'dd'} (train split): row 1", f"{tmp_path / 'dd'} (train split): row 2"]
    # one split's directory is a dataset of its own
    assert [r.data["text"] for r in rows_of(tmp_path / "dd" / "test")] == ["z"]


def test_saved_dataset_dict_without_train_split_names_the_splits(tmp_path, datasets):
    one = datasets.Dataset.from_dict({"text": ["a"]})
    datasets.DatasetDict({"validation": one, "test": one}).save_to_disk(tmp_path / "dd")
    d = tmp_path / "dd"
    expected = f"{d} is a DatasetDict with no 'train' split (splits: validation, test); point at one split's directory, e.g. {d / 'validation'}"
    with pytest.raises(DataError) as e:
        rows_of(d)
    assert str(e.value) == expected
    with pytest.raises(DataError, match="no 'train' split"):
        source_files(str(d))


def test_saved_dataset_below_a_directory_is_one_source_beside_files(tmp_path, datasets):
    write_jsonl(tmp_path / "mix" / "a.jsonl", [{"text": "from jsonl"}])
    datasets.Dataset.from_dict({"text": ["from arrow"]}).save_to_disk(tmp_path / "mix" / "b_saved")
    assert expand_paths(str(tmp_path / "mix")) == [tmp_path / "mix" / "a.jsonl", tmp_path / "mix" / "b_saved"]
    assert [r.data["text"] for r in rows_of(tmp_path / "mix")] == ["from jsonl", "from arrow"]


def test_saved_dataset_source_files_cover_its_arrow_and_json_files(tmp_path, datasets):
    datasets.Dataset.from_dict({"text": ["a", "b"]}).save_to_disk(tmp_path / "ds", num_shards=2)
    names = [p.name for p in source_files(str(tmp_path / "ds"))]
    assert names == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow", "dataset_info.json", "state.json"]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(tmp_path / "dd")
    files = source_files(str(tmp_path / "dd"))
    assert files[0] == tmp_path / "dd" / "dataset_dict.json"
    assert {p.parent for p in files[1:]} == {tmp_path / "dd" / "train"} and any(p.suffix == ".arrow" for p in files)


def test_saved_dataset_edit_changes_the_cache_fingerprint(tmp_path, datasets, tiny_tokenizer_dir):
    from trainforge.config.data import DataSettings
    from trainforge.data.cache import fingerprint
    from trainforge.model.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_tokenizer_dir)
    datasets.Dataset.from_dict({"text": ["alpha beta", "gamma"]}).save_to_disk(tmp_path / "ds")
    cfg = DataSettings(train=str(tmp_path / "ds"), eval=None, cache_dir=tmp_path / "cache")
    before = fingerprint(cfg, "text", tok, 0)
    assert fingerprint(cfg, "text", tok, 0) == before  # reading does not change it
    rows_of(tmp_path / "ds")
    assert fingerprint(cfg, "text", tok, 0) == before
    datasets.Dataset.from_dict({"text": ["alpha beta", "gamma delta"]}).save_to_disk(tmp_path / "ds2")
    cfg2 = DataSettings(train=str(tmp_path / "ds2"), eval=None, cache_dir=tmp_path / "cache")
    assert fingerprint(cfg2, "text", tok, 0) != before


def test_saved_dataset_is_accepted_by_the_config(tmp_path, datasets):
    from trainforge.config.data import DataSettings

    datasets.Dataset.from_dict({"text": ["a"]}).save_to_disk(tmp_path / "ds")
    cfg = DataSettings(train=str(tmp_path / "ds"), eval=str(tmp_path / "ds"))
    assert cfg.sources()[0].path == str(tmp_path / "ds")


def test_saved_dataset_without_the_datasets_package_says_what_to_install(tmp_path, datasets, monkeypatch):
    datasets.Dataset.from_dict({"text": ["a"]}).save_to_disk(tmp_path / "ds")
    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets" or name.startswith("datasets."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(DataError) as e:
        rows_of(tmp_path / "ds")
    assert str(e.value) == (
        f"{tmp_path / 'ds'} is a dataset saved with datasets' save_to_disk; reading it needs the datasets package: "
        "pip install 'trainforge[datasets]'"
    )
    assert [p.name for p in source_files(str(tmp_path / "ds"))][-1] == "state.json"  # fingerprinting needs no datasets


def test_saved_dataset_with_a_missing_arrow_file_is_a_data_error(tmp_path, datasets):
    datasets.Dataset.from_dict({"text": ["a"]}).save_to_disk(tmp_path / "ds")
    for arrow in (tmp_path / "ds").glob("*.arrow"):
        arrow.unlink()
    with pytest.raises(DataError, match=r"ds: not a readable saved dataset"):
        rows_of(tmp_path / "ds")


# ---------------------------------------------------------------- UTF-8 byte-order mark


# ---------------------------------------------------------------- Hugging Face Hub snapshots


def test_hub_snapshot_directory_reads_its_train_split_not_its_test_split(tmp_path):
    """A snapshot of a Hub dataset repository (push_to_hub's data/<split>-00000-of-0000N files beside the
    card) trains on its train split only: its test rows never reach training."""
    pd = pytest.importorskip("pandas")
    hub = tmp_path / "hub"
    (hub / "data").mkdir(parents=True)
    (hub / "README.md").write_text("---\nconfigs: []\n---\n")
    pd.DataFrame({"text": ["t1", "t2"]}).to_parquet(hub / "data" / "train-00000-of-00002.parquet")
    pd.DataFrame({"text": ["t3"]}).to_parquet(hub / "data" / "train-00001-of-00002.parquet")
    pd.DataFrame({"text": ["held out"]}).to_parquet(hub / "data" / "test-00000-of-00001.parquet")
    assert [r.data["text"] for r in rows_of(hub)] == ["t1", "t2", "t3"]
    assert [p.name for p in source_files(str(hub))] == ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]


@pytest.mark.parametrize(
    "files",
    [
        ["train.jsonl", "test.jsonl", "validation.jsonl"],
        ["data/train/shard_0.jsonl", "data/train/shard_1.jsonl", "data/test/shard_0.jsonl"],
        ["my_train_file_00001.jsonl", "my_eval_file.jsonl", "dev.jsonl"],
    ],
)
def test_hub_split_keywords_in_file_and_directory_names(tmp_path, files):
    for name in files:
        write_jsonl(tmp_path / name, [{"text": name}])
    assert [r.data["text"] for r in rows_of(tmp_path)] == sorted(f for f in files if "train" in f)


def test_hub_snapshot_without_a_train_split_names_its_splits(tmp_path):
    write_jsonl(tmp_path / "data" / "train_prefs-00000-of-00001.jsonl", [{"text": "a"}])
    write_jsonl(tmp_path / "data" / "test_prefs-00000-of-00001.jsonl", [{"text": "b"}])
    with pytest.raises(DataError) as e:
        rows_of(tmp_path)
    assert str(e.value) == (
        f"{tmp_path}: its files are in the splits test_prefs, train_prefs (as Hugging Face Hub files are named) and "
        f"none is 'train'; point data.train at one split's files, e.g. '{tmp_path / 'data' / 'train_prefs*'}'"
    )


def test_a_hub_snapshots_metadata_json_is_not_read_as_data(tmp_path):
    """dataset_infos.json (older Hub repositories) beside the data stopped the run as a row without the format's
    fields; datasets.load_dataset skips it, config.json and dataset_info.json."""
    write_jsonl(tmp_path / "data.jsonl", [{"text": "a"}])
    for name in ("dataset_infos.json", "dataset_info.json", "config.json"):
        (tmp_path / name).write_text('{"default": {"features": {}}}')
    assert [r.data for r in rows_of(tmp_path)] == [{"text": "a"}]
    assert source_files(str(tmp_path)) == [tmp_path / "data.jsonl"]


def test_a_directory_of_one_split_or_none_reads_every_file(tmp_path):
    for name in ("train-00000-of-00002.jsonl", "train-00001-of-00002.jsonl", "extra.jsonl", "sub/notes.jsonl"):
        write_jsonl(tmp_path / name, [{"text": name}])
    assert len(rows_of(tmp_path)) == 4


def test_json_lines_in_a_json_file_are_read_line_by_line(tmp_path):
    """datasets' Dataset.to_json("train.json") writes JSON Lines under .json, as many Hub repositories ship them;
    they stopped at line 2 with "malformed JSON at column 1: Extra data"."""
    path = tmp_path / "train.json"
    path.write_bytes(BOM + b'{"text": "a"}\n\n{"text": "b", "id": null}\n{"text": broken}\n')
    got = rows_of(path, policy="skip")
    assert [r.data["text"] for r in got] == ["a", "b"] and [r.where for r in got] == [f"{path}:1", f"{path}:3"]
    with pytest.raises(DataError, match=f"{path}:4: malformed JSON"):
        rows_of(path)
    pretty = tmp_path / "one.json"  # a pretty-printed object is still no row list
    pretty.write_text('{\n  "data": [{"text": "a"}]\n}\n')
    with pytest.raises(DataError, match="expected a JSON array of objects, got dict"):
        rows_of(pretty)


def test_bom_is_skipped_in_every_text_format(tmp_path):
    rows = [{"text": "alpha"}, {"text": "beta"}]
    (tmp_path / "a.jsonl").write_bytes(BOM + b"".join(json.dumps(r).encode() + b"\n" for r in rows))
    (tmp_path / "b.json").write_bytes(BOM + json.dumps(rows).encode())
    (tmp_path / "c.csv").write_bytes(BOM + b"text\r\nalpha\r\nbeta\r\n")
    for name in ("a.jsonl", "b.json", "c.csv"):
        assert [r.data for r in rows_of(tmp_path / name)] == rows, name
    assert rows_of(tmp_path / "a.jsonl")[0].where.endswith("a.jsonl:1")
    (tmp_path / "d.txt").write_bytes(BOM + b"alpha\r\n\r\nbeta\r\n")
    assert [r.data["text"] for r in rows_of(tmp_path / "d.txt", txt_mode="paragraph")] == ["alpha", "beta"]
    assert [r.data["text"] for r in rows_of(tmp_path / "d.txt")] == ["alpha\n\nbeta\n"]


def test_bom_only_skipped_at_the_start(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b'{"text": "ok"}\n' + BOM + b'{"text": "ok"}\n')
    with pytest.raises(DataError, match=r"a\.jsonl:2: malformed JSON"):
        rows_of(tmp_path / "a.jsonl")


def test_utf16_file_says_to_re_encode(tmp_path):
    (tmp_path / "a.jsonl").write_bytes('{"text": "alpha"}\n'.encode("utf-16"))
    with pytest.raises(DataError) as e:
        rows_of(tmp_path / "a.jsonl", policy="skip")
    assert str(e.value) == f"{tmp_path / 'a.jsonl'} is UTF-16 text (it starts with a UTF-16 byte-order mark); re-encode it as UTF-8"


# ---------------------------------------------------------------- corrupt Parquet


def test_corrupt_parquet_is_a_data_error_naming_the_file(tmp_path):
    pytest.importorskip("pyarrow")
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"this is not parquet at all" * 10)
    with pytest.raises(DataError) as e:
        rows_of(path, policy="skip")
    assert str(e.value).startswith(f"{path} is not a readable Parquet file: ")
    assert "magic bytes" in str(e.value)  # pyarrow's own words follow
    (tmp_path / "empty.parquet").write_bytes(b"")
    with pytest.raises(DataError, match=r"empty\.parquet is not a readable Parquet file: "):
        rows_of(tmp_path / "empty.parquet")


def test_truncated_parquet_is_a_data_error(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rng = random.Random(0)
    texts = ["".join(rng.choice("abcdefgh ") for _ in range(200)) for _ in range(2000)]
    pq.write_table(pa.Table.from_pylist([{"text": t} for t in texts]), tmp_path / "ok.parquet")
    data = (tmp_path / "ok.parquet").read_bytes()
    path = tmp_path / "cut.parquet"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"cut\.parquet is not a readable Parquet file"):
        rows_of(path)


# ---------------------------------------------------------------- binary files


@pytest.mark.parametrize("suffix", [".jsonl", ".txt", ".json", ".csv"])
@pytest.mark.parametrize("policy", ["error", "skip"])
def test_binary_file_is_not_a_text_file_whatever_the_policy(tmp_path, suffix, policy):
    path = tmp_path / f"blob{suffix}"
    path.write_bytes(random.Random(1).randbytes(4096))
    with pytest.raises(DataError, match=rf"blob\{suffix} is not a text file \(byte \d+ is "):
        rows_of(path, policy=policy)


def test_binary_message_names_the_first_bad_byte(tmp_path):
    path = tmp_path / "nul.jsonl"
    path.write_bytes(b'{"text": "ok"}\n\x00\x01\x02')
    with pytest.raises(DataError) as e:
        rows_of(path, policy="skip")
    assert str(e.value) == f"{path} is not a text file (byte 15 is NUL); give a JSONL, JSON, CSV or text file in UTF-8"
    path = tmp_path / "junk.txt"
    path.write_bytes(b"ab" + bytes([0x9F, 0x01, 0xFF, 0xC0]) * 8)
    with pytest.raises(DataError) as e:
        rows_of(path, policy="skip")
    assert str(e.value) == (
        f"{path} is not a text file (byte 2 is 0x9f, not valid UTF-8; 32 of its first 34 bytes are not text); "
        "give a JSONL, JSON, CSV or text file in UTF-8"
    )


def test_binary_detection_leaves_text_alone(tmp_path):
    # a 2-byte character cut by the end of the 8 KiB sample is text
    (tmp_path / "a.txt").write_bytes(b"x" + ("é" * 5000 + "\n").encode())
    assert len(rows_of(tmp_path / "a.txt")) == 1
    # one undecodable line in a JSONL file is a bad row, located by line, not a binary file
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "ok"}\n\xff\xfe\n{"text": "ok"}\n')
    with pytest.raises(DataError, match=r"b\.jsonl:2: not valid UTF-8"):
        rows_of(tmp_path / "b.jsonl")
    assert len(rows_of(tmp_path / "b.jsonl", policy="skip")) == 2
    # Latin-1 text: per-line messages telling to re-encode, not "not a text file"
    (tmp_path / "c.jsonl").write_bytes('{"text": "café"}\n'.encode("latin-1") * 3)
    with pytest.raises(DataError, match=r"c\.jsonl:1: not valid UTF-8"):
        rows_of(tmp_path / "c.jsonl")
    # terminal escapes and form feeds are text
    (tmp_path / "d.txt").write_bytes(b"\x1b[1mbold\x1b[0m\f\n" * 50)
    assert len(rows_of(tmp_path / "d.txt")) == 1


def test_binary_file_through_prepare_is_not_no_rows_found(tmp_path, tiny_tokenizer_dir):
    from trainforge.config.data import DataSettings
    from trainforge.data.prepare import prepare_data
    from trainforge.model.tokenizer import load_tokenizer

    path = tmp_path / "blob.jsonl"
    path.write_bytes(os.urandom(2048))
    cfg = DataSettings(train=str(path), eval=None, cache_dir=tmp_path / "cache", num_workers=1, on_bad_row="skip")
    with pytest.raises(DataError, match=r"blob\.jsonl is not a text file"):
        prepare_data(cfg, load_tokenizer(tiny_tokenizer_dir), seed=0, log=lambda *_: None)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".txt"])
def test_a_file_the_system_refuses_to_read_is_a_data_error_naming_it(tmp_path, monkeypatch, suffix):
    """Permission denied (which root never meets, so it is injected), an I/O error: the file and the reason."""
    path = tmp_path / f"rows{suffix}"
    path.write_text('{"text": "a"}\n' if suffix != ".csv" else "text\na\n")
    real_open = builtins.open

    def refusing(file, *args, **kwargs):
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refusing)
    monkeypatch.setattr(type(path), "read_bytes", lambda self: refusing(self))
    with pytest.raises(DataError, match=rf"{path}: cannot be read \(Permission denied\)"):
        list(iter_source(str(path), BadRows("error")))


# ---------------------------------------------------------------- gzip-compressed text files


def gz(path, text: str | bytes):
    import gzip

    with gzip.open(path, "wb") as f:
        f.write(text.encode() if isinstance(text, str) else text)
    return path


def test_gzip_compressed_text_files_are_read_as_their_format_with_lines(tmp_path):
    """Anthropic's hh-rlhf ships only train.jsonl.gz: JSONL, JSON, CSV and text read through gzip, the same
    rows and the same file:line locations as uncompressed."""
    rows = [{"chosen": "\n\nHuman: hi\n\nAssistant: hello", "rejected": "\n\nHuman: hi\n\nAssistant: go away"}] * 2
    jsonl = gz(tmp_path / "train.jsonl.gz", "".join(json.dumps(r) + "\n" for r in rows))
    got = rows_of(jsonl)
    assert [r.data for r in got] == rows and got[1].where == f"{jsonl}:2"
    assert [r.data for r in rows_of(gz(tmp_path / "a.json.gz", json.dumps(rows)))] == rows
    csv_rows = rows_of(gz(tmp_path / "b.csv.gz", BOM + b"prompt,completion\nq,a\n"))
    assert [r.data for r in csv_rows] == [{"prompt": "q", "completion": "a"}] and csv_rows[0].where.endswith("b.csv.gz:2")
    assert [r.data["text"] for r in rows_of(gz(tmp_path / "c.txt.gz", "one\n\ntwo\n"), txt_mode="paragraph")] == ["one", "two"]


def test_gzip_files_in_a_hub_layout_are_found_and_split(tmp_path):
    base = tmp_path / "hh" / "harmless-base"
    base.mkdir(parents=True)
    gz(base / "train.jsonl.gz", json.dumps({"text": "train row"}) + "\n")
    gz(base / "test.jsonl.gz", json.dumps({"text": "test row"}) + "\n")
    assert [r.data["text"] for r in rows_of(tmp_path / "hh")] == ["train row"]


def test_bad_gzip_files_are_named(tmp_path):
    whole = gz(tmp_path / "whole.jsonl.gz", json.dumps({"text": "x" * 5000}) + "\n")
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(whole.read_bytes()[:40])
    with pytest.raises(DataError, match=r"cut.jsonl.gz: not a complete gzip file"):
        rows_of(cut)
    (tmp_path / "plain.jsonl.gz").write_bytes(b'{"text": "not compressed"}\n')
    with pytest.raises(DataError, match=r"plain.jsonl.gz: not a complete gzip file"):
        rows_of(tmp_path / "plain.jsonl.gz")
    (tmp_path / "x.parquet.gz").write_bytes(b"")
    with pytest.raises(DataError, match=r"unsupported file type '.parquet.gz'.*\.jsonl\.gz"):
        rows_of(tmp_path / "x.parquet.gz")
    bad_line = gz(tmp_path / "bad.jsonl.gz", '{"text": "ok"}\n{"text": \n')
    with pytest.raises(DataError, match=r"bad.jsonl.gz:2: malformed JSON"):
        rows_of(bad_line)


# ---------------------------------------------------------------- reads bounded in memory (gzip bombs)


def test_an_overlong_jsonl_line_is_a_bad_row_skipped_without_being_held(tmp_path, monkeypatch):
    """A one-line .jsonl.gz can decompress to many gigabytes; reading it as one line filled the memory. A line over
    the limit is a bad row (named with its line), skipped in bounded pieces, and the lines after it keep their numbers."""
    import gzip

    from trainforge.data import textfiles

    monkeypatch.setattr(textfiles, "MAX_LINE_BYTES", 1000)
    path = tmp_path / "train.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write(b'{"text": "short"}\n' + b'{"text": "' + b"a" * 50_000 + b'"}\n' + b'{"text": "after"}\n')
    with pytest.raises(DataError, match=r"train.jsonl.gz:2: the line is over 0 MiB"):
        rows_of(path)
    rows = rows_of(path, "skip")
    assert [(r.data["text"], r.where) for r in rows] == [("short", f"{path}:1"), ("after", f"{path}:3")]


@pytest.mark.parametrize("name,expect", [
    ("rows.json.gz", r"decompressed, an eighth of the memory available, and a JSON array is parsed whole; convert it to JSON Lines"),
    ("rows.json", r"GiB, an eighth of the memory available, and a JSON array is parsed whole"),
    ("book.txt", r"and a text file is read whole; split it into smaller files"),
])
def test_a_file_read_whole_is_refused_past_its_share_of_the_memory(tmp_path, monkeypatch, name, expect):
    import gzip

    from trainforge.data import textfiles

    monkeypatch.setattr(textfiles, "whole_file_limit", lambda: 4096)
    body = (json.dumps([{"text": "x" * 100}] * 100) if ".json" in name else "word " * 2000).encode()
    path = tmp_path / name
    path.write_bytes(gzip.compress(body) if name.endswith(".gz") else body)
    assert len(path.read_bytes()) > 4096 or name.endswith(".gz")
    with pytest.raises(DataError, match=expect):
        rows_of(path)
    monkeypatch.setattr(textfiles, "whole_file_limit", lambda: 1 << 30)
    assert rows_of(path)  # under the limit the same file reads


def test_an_overlong_csv_line_is_refused(tmp_path, monkeypatch):
    import gzip

    from trainforge.data import textfiles

    monkeypatch.setattr(textfiles, "MAX_LINE_BYTES", 1000)
    path = tmp_path / "rows.csv.gz"
    path.write_bytes(gzip.compress(b"text\nshort\n" + b"a" * 50_000 + b"\n"))
    with pytest.raises(DataError, match="rows.csv.gz: a line over 0 MiB"):
        rows_of(path, "skip")
    monkeypatch.setattr(textfiles, "MAX_LINE_BYTES", 1 << 20)
    assert [r.data["text"] for r in rows_of(path)] == ["short", "a" * 50_000]


@pytest.mark.parametrize("ending", ["\n", "\r\n"])
def test_malformed_json_names_the_column_on_the_line_itself(tmp_path, ending):
    """A row cut off mid-object was reported "at column 1": the column of the line after, as the parser
    counted the line's own newline. The last line, without an ending, alike."""
    path = tmp_path / "cut.jsonl"
    path.write_text(ending.join(['{"text": "ok"}', '{"text": "abc", ', '{"text": abc}', '{"text": "abc", ']), newline="")
    bad = BadRows("skip")
    assert [r.data for r in iter_source(str(path), bad, "file")] == [{"text": "ok"}]
    cut = "malformed JSON at column 17 (the line ends there: is the row cut off?): Expecting property name enclosed in double quotes"
    assert bad.first == [f"{path}:2: {cut}", f"{path}:3: malformed JSON at column 10: Expecting value", f"{path}:4: {cut}"]
