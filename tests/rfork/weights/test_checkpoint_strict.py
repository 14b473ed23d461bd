"""The safetensors header parser is strict: a file (or an index) from anywhere is checked before a byte
is read: types, offsets within the data, offsets that agree with dtype and shape, no overlapping spans
but tied ones, index paths inside the checkpoint directory. Errors are CheckpointError naming the file
and the tensor, never a raw TypeError or KeyError."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rfork.errors import CheckpointError
from rfork.weights.checkpoint import read_checkpoint_info

ITEMSIZE = {"F32": 4, "BF16": 2, "U8": 1, "I64": 8}
TORCH_ITEMSIZE = {"float32": 4, "bfloat16": 2, "uint8": 1, "int64": 8}


def _write(path: Path, header: Any, data: bytes = b"", *, raw: bytes | None = None) -> Path:
    body = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return path


def _entry(dtype: str, shape: list[int], begin: int, end: int | None = None) -> dict[str, Any]:
    n = ITEMSIZE[dtype]
    for d in shape:
        n *= d
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, begin + n if end is None else end]}


def test_a_well_formed_file_with_a_tied_tensor_reads(tmp_path: Path) -> None:
    header = {
        "__metadata__": {"format": "pt"},
        "a": _entry("F32", [4], 0),
        "tied": _entry("F32", [4], 0),
        "b": _entry("BF16", [2, 3], 16),
        "empty": _entry("F32", [0], 28),
    }
    info = read_checkpoint_info(_write(tmp_path / "model.safetensors", header, bytes(28)))
    assert {t.name: (t.nbytes, t.offset) for t in info.tensors}["tied"] == (16, 8 + len(json.dumps(header)))
    assert len(info.tensors) == 4


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (_entry("F32", [4], 0, 12), r"'w'.*hold 12 bytes, but F32\[4\] is 16"),
        (_entry("F32", [4], 8), r"'w'.*not within the 16 data bytes"),
        (_entry("F32", [4], 12, 8), r"'w'.*not within"),
        ({"dtype": "F32", "shape": [4], "data_offsets": ["0", "16"]}, r"'w'.*data_offsets"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [0, 8, 16]}, r"'w'.*data_offsets"),
        ({"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}, r"'w'.*shape"),
        ({"dtype": "F32", "shape": [True, 4], "data_offsets": [0, 16]}, r"'w'.*shape"),
        ({"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}, r"'w'.*shape"),
        ({"dtype": 7, "shape": [4], "data_offsets": [0, 16]}, r"'w'.*dtype"),
        ({"shape": [4], "data_offsets": [0, 16]}, r"'w'.*dtype"),
        ([0, 16], r"'w'.*not a JSON object"),
    ],
)
def test_a_bad_entry_names_the_tensor_and_the_file(tmp_path: Path, entry: Any, message: str) -> None:
    path = _write(tmp_path / "bad.safetensors", {"w": entry}, bytes(16))
    with pytest.raises(CheckpointError, match=message) as err:
        read_checkpoint_info(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ({"a": _entry("F32", [4], 0), "b": _entry("F32", [4], 8)}, "overlaps"),
        ({"a": _entry("F32", [4], 0), "b": _entry("I64", [2], 0)}, "overlaps"),  # same bytes, other dtype
        ({"a": _entry("F32", [4], 0), "b": _entry("F32", [2, 2], 0)}, "overlaps"),  # other shape
        ({"a": _entry("U8", [24], 0), "b": _entry("F32", [2], 4)}, "overlaps"),  # inside another
        ([1, 2], "not a JSON object"),
        ({"__metadata__": [1]}, "__metadata__"),
    ],
)
def test_bad_headers_are_refused(tmp_path: Path, header: Any, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        read_checkpoint_info(_write(tmp_path / "bad.safetensors", header, bytes(24)))


@pytest.mark.parametrize(
    "raw",
    [b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "a": {}}', b"\xff\xfe", b"{", b"null"],
)
def test_duplicate_keys_and_undecodable_headers_are_refused(tmp_path: Path, raw: bytes) -> None:
    with pytest.raises(CheckpointError, match="bad.safetensors"):
        read_checkpoint_info(_write(tmp_path / "bad.safetensors", None, bytes(4), raw=raw))


def test_a_header_longer_than_the_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "short.safetensors"
    path.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(CheckpointError, match="header of 1000 bytes"):
        read_checkpoint_info(path)


def _indexed(tmp_path: Path, weight_map: Any) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    _write(d / "part-1.safetensors", {"a": _entry("F32", [2], 0)}, bytes(8))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return d


@pytest.mark.parametrize(
    "target",
    [
        "../outside.safetensors",
        "/etc/passwd",
        "sub/../../outside.safetensors",
        "",
        ".",
        5,
        "link.safetensors",
    ],
)
def test_index_paths_stay_inside_the_checkpoint(tmp_path: Path, target: Any) -> None:
    _write(tmp_path / "outside.safetensors", {"x": _entry("F32", [2], 0)}, bytes(8))
    d = _indexed(tmp_path, {"a": "part-1.safetensors", "x": target})
    (d / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: tensor 'x'"):
        read_checkpoint_info(d)


@pytest.mark.parametrize("doc", [[], {"weight_map": []}, {"other": {}}])
def test_an_index_without_a_weight_map_object_is_refused(tmp_path: Path, doc: Any) -> None:
    d = _indexed(tmp_path, {})
    (d / "model.safetensors.index.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="weight_map"):
        read_checkpoint_info(d)


def test_a_tensor_in_two_files_or_in_the_wrong_one_is_refused(tmp_path: Path) -> None:
    d = _indexed(tmp_path, {"a": "part-1.safetensors", "b": "part-2.safetensors"})
    _write(d / "part-2.safetensors", {"a": _entry("F32", [2], 0)}, bytes(8))
    with pytest.raises(CheckpointError, match="'a' is also in"):
        read_checkpoint_info(d)
    _write(d / "part-2.safetensors", {"c": _entry("F32", [2], 0), "b": _entry("F32", [2], 8)}, bytes(16))
    (d / "model.safetensors.index.json").write_text(
        json.dumps(
            {"weight_map": {"a": "part-1.safetensors", "b": "part-2.safetensors", "c": "part-1.safetensors"}}
        )
    )
    with pytest.raises(CheckpointError, match="'c' is mapped to 'part-1.safetensors'"):
        read_checkpoint_info(d)


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**65), 2**65)
    | st.floats(allow_nan=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)
_field = st.one_of(
    st.sampled_from(list(ITEMSIZE) + ["F8", "f32"]),  # dtype-like
    st.lists(st.integers(-2, 70), max_size=3),  # shape- or offsets-like
    _json,
)
_entries = st.dictionaries(
    st.text(min_size=1, max_size=6),
    st.one_of(
        st.fixed_dictionaries({"dtype": _field, "shape": _field, "data_offsets": _field}),
        st.builds(
            _entry,
            st.sampled_from(list(ITEMSIZE)),
            st.lists(st.integers(0, 3), max_size=2),
            st.integers(0, 40),
        ),
        _json,
    ),
    max_size=5,
)


@given(header=_entries, data_len=st.integers(0, 64))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_header_is_either_sound_or_a_checkpoint_error(tmp_path: Path, header: Any, data_len: int) -> None:
    path = _write(tmp_path / "fuzz.safetensors", header, bytes(data_len))
    try:
        info = read_checkpoint_info(path)
    except CheckpointError as exc:
        error = str(exc)
    else:
        error = ""
    if error:
        assert str(path) in error
        return
    base = 8 + len(json.dumps(header).encode())
    spans = []
    for t in info.tensors:
        numel = 1
        for dim in t.shape:
            numel *= dim
        assert base <= t.offset <= t.offset + t.nbytes <= base + data_len
        assert t.nbytes == numel * TORCH_ITEMSIZE[t.dtype]
        if t.nbytes:
            spans.append((t.offset, t.offset + t.nbytes, t.dtype, t.shape))
    spans.sort()
    for (b0, e0, *k0), (b1, e1, *k1) in zip(spans, spans[1:], strict=False):
        assert b1 >= e0 or (b0, e0, k0) == (b1, e1, k1)
