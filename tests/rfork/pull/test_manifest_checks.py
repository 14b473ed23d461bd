"""The manifest a loader accepts: the wire type (planner.contract.RankManifest), checked once where the
loader receives it (`RankManifest.check`, through rfork.pull.planner_session.check_manifest); anything
else is refused with a clear error."""

from __future__ import annotations

import base64
import contextlib
import json
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from backends.layout import plan_layout
from planner.contract import RankManifest, RegionEntry
from planner.contract.manifest import DTYPE_BYTES
from rfork import pull_into
from rfork.errors import ManifestError
from rfork.pull.planner_session import check_manifest
from rfork.weights import checksum as ck
from tests.rfork.conftest import AUTH, opts, tied_model, tied_seed

names = st.text(alphabet="abcdefghij._0123456789", min_size=1, max_size=20)
dtypes = st.sampled_from(["bfloat16", "float16", "float32", "int8", "int64"])
shapes = st.lists(st.integers(min_value=0, max_value=9), min_size=0, max_size=3)


def _good_doc():
    return {
        "rank": 0,
        "checksum_algorithm": ck.XXH3_128,
        "regions": [{"index": 0, "nbytes": 16, "descriptor": base64.b64encode(b"x").decode()}],
        "tensors": [
            {
                "name": "w",
                "dtype": "float32",
                "shape": [2, 2],
                "nbytes": 16,
                "region": 0,
                "offset": 0,
                "checksum": "0" * 32,
            }
        ],
    }


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(names, st.tuples(dtypes, shapes), min_size=0, max_size=12),
    st.integers(min_value=1, max_value=4096),
)
def test_manifest_round_trip_from_any_layout(specs, max_region):
    layout = plan_layout([(n, d, s) for n, (d, s) in specs.items()], max_region_bytes=max_region)
    doc = {
        "rank": 3,
        "checksum_algorithm": ck.XXH3_128,
        "regions": [
            {"index": i, "nbytes": n, "descriptor": base64.b64encode(b"d%d" % i).decode()}
            for i, n in enumerate(layout.region_sizes)
        ],
        "tensors": [
            {
                "name": p.name,
                "dtype": p.dtype,
                "shape": list(p.shape),
                "nbytes": p.nbytes,
                "region": p.region,
                "offset": p.offset,
                "checksum": "0" * 32,
            }
            for p in layout.placements
        ],
    }
    m = RankManifest.model_validate(json.loads(json.dumps(doc)))
    check_manifest(m)
    assert m.model_dump(exclude={"origin"}) == doc
    # regions never overlap and stay in bounds
    for r in range(len(layout.region_sizes)):
        spans = sorted(
            (p.offset, p.offset + p.nbytes) for p in layout.placements if p.region == r and p.nbytes
        )
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
        assert all(end <= layout.region_sizes[r] for _, end in spans)


@settings(max_examples=80, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=4),
        max_leaves=12,
    )
)
def test_garbage_is_refused_by_the_wire_type_or_the_loader_check(doc):
    with contextlib.suppress(ValidationError, ManifestError):
        check_manifest(RankManifest.model_validate(doc))


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("tensors", 0, "nbytes"), 12),
        (("tensors", 0, "offset"), 4),
        (("tensors", 0, "region"), 1),
        (("tensors", 0, "dtype"), "complex999"),
        (("regions", 0, "descriptor"), "!!"),
        (("rank",), -1),
        (("tensors", 0, "shape"), [2, "2"]),
        (("checksum_algorithm",), ""),
    ],
)
def test_inconsistent_fields_are_refused(path, value):
    doc = _good_doc()
    check_manifest(RankManifest.model_validate(doc))
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises((ValidationError, ManifestError)):
        check_manifest(RankManifest.model_validate(doc))


def test_the_wire_sizes_dtypes_as_torch_does():
    """The check needs no torch: its table must say what torch says, for every dtype torch has."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # making some (quantized, complex32) warns
        sizes = {
            name: torch.empty((), dtype=dt).element_size()
            for name in dir(torch)
            if isinstance(dt := getattr(torch, name), torch.dtype)
        }
    assert {name: DTYPE_BYTES.get(name) for name in sizes} == sizes


def test_descriptors_are_read_as_the_check_decoded_them():
    m = RankManifest.model_validate(_good_doc())
    with pytest.raises(RuntimeError, match="check"):
        m.descriptor(0)  # nothing reads an unchecked manifest
    check_manifest(m)
    assert m.descriptor(0) == b"x"


@pytest.mark.slow
def test_a_pull_checks_the_manifest_once_and_decodes_each_descriptor_once(planner, monkeypatch):
    checks: list[RankManifest] = []
    decoded: list[int] = []
    check, descriptor_bytes = RankManifest.check, RegionEntry.descriptor_bytes

    def counted_check(self: RankManifest) -> None:
        checks.append(self)
        check(self)

    def counted_decode(self: RegionEntry) -> bytes:
        decoded.append(self.index)
        return descriptor_bytes(self)

    monkeypatch.setattr(RankManifest, "check", counted_check)
    monkeypatch.setattr(RegionEntry, "descriptor_bytes", counted_decode)
    with tied_seed(planner) as (_model, ident, _seed):
        result = pull_into(
            identity=ident, planner_url=planner, tensors=tied_model(1).state_dict(),
            options=opts(become_seed=False), **AUTH,
        )
    assert result.source == "rfork-tcp"
    assert len(checks) == 1
    assert sorted(decoded) == sorted(r.index for r in checks[0].regions)  # each region once
