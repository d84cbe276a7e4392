"""A saved graph, a name or a string never becomes code, and loading never reads what the file
names: overlapping zip entries, source tables naming paths on the loading machine, and text
fields (class name, ``created_by``) that would print as code lines."""
from __future__ import annotations

import io
import json
import linecache
import struct
import zipfile
import zlib

import pytest
import torch
from torch import nn

import symtrace
from symtrace.graph import Graph, GraphModule
from symtrace.graph.source import SourceLocation
from symtrace.graph.tabular import format_tabular
from symtrace.serialize import SerializationError, load, save

HEADER = "symtrace.json"


# --- helpers ---------------------------------------------------------------------------------
def _linear_gm():
    torch.manual_seed(0)
    return symtrace.symbolic_trace(nn.Linear(4, 4), example_inputs=(torch.randn(2, 4),))


def _saved(gm=None) -> bytes:
    buf = io.BytesIO()
    save(_linear_gm() if gm is None else gm, buf)
    return buf.getvalue()


def _header(data: bytes) -> dict:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return json.loads(zf.read(HEADER))


def _blobs(data: bytes) -> dict:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return {i.filename: zf.read(i) for i in zf.infolist() if i.filename != HEADER}


def _rewritten(data: bytes, edit, extra=()) -> bytes:
    """``data`` with its header edited in place by ``edit(doc)`` (blobs kept; ``extra``: more
    ``(name, bytes)`` entries), written as a new stored zip."""
    doc = _header(data)
    edit(doc)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr(HEADER, json.dumps(doc))
        for name, body in list(_blobs(data).items()) + list(extra):
            zf.writestr(name, body)
    return out.getvalue()


def _load(data: bytes):
    return load(io.BytesIO(data))


def _graph_rec(doc: dict) -> dict:
    return doc["modules"][doc["root"]]["graph"]


def _local_header(name: bytes, extra_len: int = 0) -> bytes:
    # signature, version, flags, method (stored), time, date, crc, sizes (unused by readers: the
    # central directory's count), name length, extra length
    return struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, 0, 0, 0x21, 0, 0, 0, len(name), extra_len) + name


def _finish(body: bytes, records) -> bytes:
    """``body`` (local headers and data) plus a central directory of ``records``, each
    ``(name, local header offset, data size)``; the CRC is of the bytes a reader will read."""
    cd = b""
    for name, offset, size in records:
        n_name, n_extra = struct.unpack_from("<HH", body, offset + 26)
        start = offset + 30 + n_name + n_extra
        crc = zlib.crc32(body[start:start + size])
        cd += struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 20, 20, 0, 0, 0, 0x21, crc, size, size,
                          len(name), 0, 0, 0, 0, 0, offset) + name
    eocd = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(records), len(records), len(cd), len(body), 0)
    return body + cd + eocd


def _hand_built(doc: dict, blob_layout) -> bytes:
    """An archive holding the header ``doc`` first, then what ``blob_layout(offset)`` returns:
    ``(bytes, records)`` for the blobs, placed at ``offset``."""
    name = HEADER.encode()
    head = json.dumps(doc).encode()
    body = _local_header(name) + head
    blob_body, records = blob_layout(len(body))
    return _finish(body + blob_body, [(name, 0, len(head))] + records)


# --- (A) the zip container -------------------------------------------------------------------
def _nested(offset: int):
    """tensors/0.bin's data holds tensors/1.bin's local header and data: the bytes count twice."""
    kernel = bytes(range(64))
    lh1 = _local_header(b"tensors/1.bin", 1) + b"\0"  # 44 bytes: keeps the sizes whole float32s
    lh0 = _local_header(b"tensors/0.bin")
    body = lh0 + lh1 + kernel
    return body, [(b"tensors/0.bin", offset, len(lh1) + len(kernel)),
                  (b"tensors/1.bin", offset + len(lh0), len(kernel))]


def _shared(offset: int):
    """tensors/0.bin's extra field is tensors/1.bin's local header: both entries read the same data."""
    kernel = bytes(range(64))
    lh1 = _local_header(b"tensors/1.bin")
    lh0 = _local_header(b"tensors/0.bin", len(lh1))
    body = lh0 + lh1 + kernel
    return body, [(b"tensors/0.bin", offset, len(kernel)), (b"tensors/1.bin", offset + len(lh0), len(kernel))]


def _storages_for(doc: dict, sizes) -> dict:
    for rec, n in zip(doc["storages"], sizes):
        rec["nbytes"] = n
    return doc


def test_hand_built_archive_is_well_formed():
    # the builder itself: a plain layout loads, so the refusals below are about overlap alone
    doc = _header(_saved())
    blobs = _blobs(_saved())

    def plain(offset):
        body, records = b"", []
        for name, data in blobs.items():
            records.append((name.encode(), offset + len(body), len(data)))
            body += _local_header(name.encode()) + data
        return body, records

    gm = _load(_hand_built(doc, plain))
    assert gm(torch.ones(2, 4)).shape == (2, 4)


def _zipfile_reads(data: bytes) -> bool:
    """Whether this Python's zipfile reads every entry of ``data`` without refusing it (newer
    versions check overlapping entries themselves)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            for name in zf.namelist():
                zf.read(name)
    except zipfile.BadZipFile:
        return False
    return True


@pytest.mark.parametrize("layout,sizes", [(_nested, (108, 64)), (_shared, (64, 64))], ids=["nested", "shared"])
def test_overlapping_entries_are_refused(layout, sizes):
    # each entry's local header and data must be its own bytes: otherwise a small file holds
    # many times its size in tensors
    doc = _storages_for(_header(_saved()), sizes)
    data = _hand_built(doc, layout)
    blob_bytes = len(layout(0)[0])
    if _zipfile_reads(data):  # zipfile itself reads both entries happily (Python 3.12 refuses)
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            assert [len(zf.read(f"tensors/{i}.bin")) for i in (0, 1)] == list(sizes)
    assert sum(sizes) > blob_bytes - 2 * 43  # more tensor bytes than blob bytes (less the headers)
    with pytest.raises(SerializationError, match="overlap"):
        _load(data)


def test_central_directory_records_sharing_a_local_header_are_refused():
    doc = _header(_saved())
    kernel = bytes(64)

    def same_header(offset):
        body = _local_header(b"tensors/0.bin") + kernel
        return body, [(b"tensors/0.bin", offset, 64), (b"tensors/1.bin", offset, 64)]

    with pytest.raises(SerializationError, match="overlap"):  # refused before zipfile reads either
        _load(_hand_built(_storages_for(doc, (64, 64)), same_header))


def test_entry_running_into_the_central_directory_is_refused():
    # the last blob claims 4 more bytes than it has: the central directory's first signature,
    # which zipfile hands out as tensor data
    doc = _storages_for(_header(_saved()), (64, 20))
    blobs = _blobs(_saved())

    def overrun(offset):
        lh0 = _local_header(b"tensors/0.bin")
        body = lh0 + blobs["tensors/0.bin"] + _local_header(b"tensors/1.bin") + blobs["tensors/1.bin"]
        return body, [(b"tensors/0.bin", offset, 64), (b"tensors/1.bin", offset + len(lh0) + 64, 20)]

    data = _hand_built(doc, overrun)
    # _finish took the CRC of the 16 bytes before the central directory; make it cover all 20
    cd_at = data.index(b"PK\x01\x02")
    last = data.rindex(b"PK\x01\x02")
    crc = zlib.crc32(data[cd_at - 16:cd_at + 4])
    data = data[:last + 16] + struct.pack("<I", crc) + data[last + 20:]
    if _zipfile_reads(data):  # (Python 3.12's zipfile refuses this layout itself)
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            assert zf.read("tensors/1.bin")[-4:] == b"PK\x01\x02"
    with pytest.raises(SerializationError, match="past the end"):
        _load(data)


def test_entries_the_header_does_not_name_are_refused():
    data = _rewritten(_saved(), lambda d: None, extra=[("tensors/7.bin", b"x" * 8)])
    with pytest.raises(SerializationError, match="neither the header"):
        _load(data)
    data = _rewritten(_saved(), lambda d: None, extra=[("notes.txt", b"hi")])
    with pytest.raises(SerializationError, match="neither the header"):
        _load(data)


def test_materialised_bytes_are_bounded_by_the_file():
    data = _saved()
    gm = _load(data)
    total = sum(t.untyped_storage().nbytes() for t in list(gm.parameters()) + list(gm.buffers()))
    assert total <= len(data)


# --- (B) source locations ------------------------------------------------------------------
SECRET = "TOP_SECRET_VALUE_9f3a = 'hunter2'"


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "secret.py"
    path.write_text(SECRET + "\n")
    linecache.checkcache()
    yield str(path)
    linecache.clearcache()


def _every_loc(doc: dict, path: str) -> None:
    """Point the sources table (old three-item form) and every ``$loc`` value at ``path``."""
    graph = _graph_rec(doc)
    graph["sources"] = [[path, 1, "f"] for _ in graph["sources"]] or [[path, 1, "f"]]

    def walk(v):
        if isinstance(v, dict):
            if set(v) == {"$loc"}:
                v["$loc"] = [path, 1, "f"]
                return
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
    walk(doc)


def _texts(gm, *errors) -> str:
    parts = [gm.code, gm.print_readable(False), str(gm.graph), format_tabular(gm.graph)]
    for e in errors:
        parts += [str(e)] + list(getattr(e, "__notes__", []))
    return "\n".join(parts)


def test_loading_never_reads_a_path_the_file_names(secret_file):
    data = _rewritten(_saved(), lambda d: _every_loc(d, secret_file))
    assert secret_file in data.decode("latin-1")
    gm = _load(data)
    locs = [n.meta["source"] for n in gm.graph.nodes if "source" in n.meta]
    locs += [g.source for g in gm.graph.guards if g.source is not None]
    assert locs and all(loc.filename == secret_file for loc in locs)
    assert torch.equal(gm(torch.ones(2, 4)), _linear_gm()(torch.ones(2, 4)))
    errors = []
    with pytest.raises(RuntimeError) as shape_error:  # the node's error note names its source
        gm(torch.ones(2, 5))
    errors.append(shape_error.value)
    with pytest.raises(symtrace.GuardError) as guard_error:  # so does a guard failure
        gm(torch.ones(2, 4, dtype=torch.float64))
    errors.append(guard_error.value)
    text = _texts(gm, *errors) + "".join(loc.describe() for loc in locs)
    assert "hunter2" not in text and "TOP_SECRET" not in text
    assert secret_file not in linecache.cache
    assert all(loc.text == "" for loc in locs)  # an old file's locations: no text, never a read


def test_source_text_comes_from_the_file_not_the_path(secret_file):
    def edit(doc):
        _every_loc(doc, secret_file)
        _graph_rec(doc)["sources"] = [[secret_file, 1, "f", "y = shown_instead(x)"]]
    gm = _load(_rewritten(_saved(), edit))
    assert "shown_instead" in gm.code and "hunter2" not in gm.code
    assert secret_file not in linecache.cache


class _Marked(nn.Module):
    def forward(self, x):
        return torch.relu(x) * 3  # original-line-marker-41c7


def test_round_trip_keeps_the_original_line_text(monkeypatch):
    gm = symtrace.symbolic_trace(_Marked(), example_inputs=(torch.randn(3),))
    assert "original-line-marker-41c7" in gm.code
    data = _saved(gm)
    sources = _graph_rec(_header(data))["sources"]
    assert sources and all(len(s) == 4 for s in sources)
    assert any("original-line-marker-41c7" in s[3] for s in sources)

    def no_reading(*args, **kwargs):
        raise AssertionError("loading read a source file")
    monkeypatch.setattr(linecache, "getline", no_reading)
    monkeypatch.setattr(linecache, "getlines", no_reading)
    loaded = _load(data)
    assert "original-line-marker-41c7" in loaded.code
    assert torch.equal(loaded(torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 6.0]))
    # a loaded location carries its text; equal locations within one graph still group lines
    locs = [n.meta["source"] for n in loaded.graph.nodes if "source" in n.meta]
    assert all(isinstance(loc.text, str) for loc in locs)
    assert loaded.code.count("original-line-marker-41c7") == 1


def test_source_location_text_field():
    loc = SourceLocation("/nonexistent/file.py", 3, "f")
    assert loc.text is None and loc.line() == ""
    with_text = SourceLocation("/nonexistent/file.py", 3, "f", "a = b")
    assert with_text.line() == "a = b" and with_text.describe().endswith(": a = b")
    assert SourceLocation(*tuple(with_text)) == with_text


@pytest.mark.parametrize("entry", [
    ["f.py", 1, "f", "x = 1\x00\nimport os\r\x0b\x0c\x1c\x85\u2028\u2029\x1b[2J"],
    ["f.py", 1, "f", "x" * 100_000],
], ids=["control characters in the text", "long text"])
def test_source_text_is_sanitised(entry):
    gm = _load(_rewritten(_saved(), lambda d: _graph_rec(d).update(sources=[entry] * len(_graph_rec(d)["sources"]))))
    assert gm(torch.ones(2, 4)).shape == (2, 4)
    texts = [n.meta["source"].text for n in gm.graph.nodes if "source" in n.meta]
    assert texts and all(len(t) <= 4096 for t in texts)
    assert not any(c in t for t in texts for c in "\x00\n\r\x0b\x0c\x1c\x85\u2028\u2029\x1b")
    for text in (gm.code, gm.print_readable(False)):
        for line in text.splitlines():
            assert "import os" not in line or line.lstrip().startswith("#")


def test_source_path_with_nul_in_its_lines_cannot_break_the_module(tmp_path):
    # an old file (no text) naming a real file whose line holds a NUL byte
    path = tmp_path / "nul.py"
    path.write_bytes(b"x = 1\x00 # \x0b\n")
    gm = _load(_rewritten(_saved(), lambda d: _graph_rec(d).update(sources=[[str(path), 1, "f"]])))
    assert gm(torch.ones(2, 4)).shape == (2, 4)
    assert "\x00" not in gm.code


@pytest.mark.parametrize("entry", [
    ["/tmp/a\x00b.py", 1, "f"], ["/tmp/a\nimport os", 1, "f"], ["f\u2028.py", 1, "f"], ["f.py", 1, "g\x0b"],
    ["f.py", 1, "g\x85"], ["x" * 5000, 1, "f"], ["f.py", 1, "f", 3], ["f.py", -1, "f"], ["f.py", 1, "f", "t", 5],
], ids=["nul", "newline", "u2028", "vt in function", "nel in function", "long path", "text not str",
        "negative line", "five items"])
def test_bad_source_entries_are_refused(entry):
    with pytest.raises(SerializationError, match="source"):
        _load(_rewritten(_saved(), lambda d: _graph_rec(d).update(sources=[entry])))


# --- (C) text fields -----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["X(torch.nn.Module):\n    pass\nimport os\nclass Y", "class", "a b", "",
                                  "Ok\u2028"])
def test_class_name_must_be_an_identifier_on_load(name):
    data = _rewritten(_saved(), lambda d: d["modules"][d["root"]].update(class_name=name))
    with pytest.raises(SerializationError, match="class name"):
        _load(data)


@pytest.mark.parametrize("label", ["pass\nimport os", "a\rb", "a\x1b[31mred", "a\u2028b", "x" * 5000])
def test_created_by_must_be_one_printable_line_on_load(label):
    data = _rewritten(_saved(), lambda d: _graph_rec(d).update(created_by=label))
    with pytest.raises(SerializationError, match="created_by"):
        _load(data)


def test_good_text_fields_load():
    def edit(d):
        d["modules"][d["root"]]["class_name"] = "Über_Net2"
        _graph_rec(d)["created_by"] = "lower(backend='x86') ✓"
    gm = _load(_rewritten(_saved(), edit))
    text = gm.print_readable(False)
    assert text.startswith("# made by lower(backend='x86') ✓\nclass Über_Net2(torch.nn.Module):")


def test_graph_module_class_name_must_be_an_identifier():
    g = Graph()
    g.output(g.placeholder("x"))
    for bad in ("X(torch.nn.Module):\n    pass", "class", "a-b", "", None, "<lambda>"):
        with pytest.raises(ValueError, match="identifier"):
            GraphModule(nn.Module(), g, class_name=bad)
    assert GraphModule(nn.Module(), g, class_name="Fine_1")._class_name == "Fine_1"


def test_traced_lambda_gets_an_identifier_class_name():
    gm = symtrace.symbolic_trace(lambda x: x + 1, example_inputs=(torch.randn(2),))
    assert gm._class_name.isidentifier()
    assert "class <" not in gm.print_readable(False)
    assert _load(_saved(gm))(torch.ones(2)).tolist() == [2.0, 2.0]


def test_created_by_prints_as_one_line():
    gm = _linear_gm()
    gm.graph.created_by = "my_pass\nimport os\x1b[2J\u2028x"
    printed = [gm.print_readable(False), str(gm.graph), format_tabular(gm.graph)]
    for text in printed:
        assert "\nimport os" not in text and "\x1b" not in text and "\u2028" not in text
    assert gm.print_readable(False).splitlines()[0] == "# made by my_pass?import os?[2J?x"
    # saving writes the label as the printed line, so the file loads
    assert _load(_saved(gm)).graph.created_by == "my_pass?import os?[2J?x"
