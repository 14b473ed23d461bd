"""rfork.weights.memory: flat region buffers (huge pages, packing) and pre-faulting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rfork.weights.memory import empty_host_buffer, pack, prefault, resident

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_CHECK = """
import json, sys
import json
import subprocess
import sys
from pathlib import Path
import torch
from rfork.weights.memory import empty_host_buffer

def huge_kib_in(ptr, nbytes):
    # AnonHugePages (KiB) of the mappings overlapping [ptr, +nbytes), from /proc/self/smaps
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < ptr + nbytes and ptr < hi
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total

n = 64 << 20
ours = empty_host_buffer(n)
ours.fill_(1)
plain = torch.empty(n, dtype=torch.uint8)
plain.fill_(1)
print(json.dumps({"ours": huge_kib_in(ours.data_ptr(), n), "plain": huge_kib_in(plain.data_ptr(), n)}))
"""


def test_pack_keeps_values_and_zero_byte_tensors():
    t = {"a": torch.randn(3, 5).bfloat16(), "empty": torch.empty(0, 4), "b": torch.arange(10.0)}
    layout, buffers, views = pack(t, max_region_bytes=40)
    assert len(buffers) == 2
    assert layout.placements[1].nbytes == 0
    for k, v in t.items():
        assert torch.equal(v, views[k])
        assert views[k].dtype == v.dtype


@pytest.mark.skipif(
    not _THP.exists() or "[madvise]" not in _THP.read_text(),
    reason="THP is not in madvise mode here (off, or on for every mapping)",
)
def test_rfork_buffers_get_huge_pages_and_torch_ones_do_not() -> None:
    # A fresh interpreter: in a long-lived one, a torch tensor may come from a heap mapping that
    # other code advised, and smaps counts per mapping, not per buffer.
    out = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    kib = json.loads(out.stdout.strip().splitlines()[-1])
    assert kib["ours"] >= 32 << 10  # most of the 64 MiB
    assert kib["plain"] == 0


def test_prefault_keeps_contents_and_tolerates_odd_spans() -> None:
    buf = empty_host_buffer(8 << 20)
    buf[:] = torch.arange(8 << 20, dtype=torch.int64).remainder(251).to(torch.uint8)
    before = buf.clone()
    prefault(buf.data_ptr() + 3, (8 << 20) - 5)  # unaligned start and end
    prefault(buf.data_ptr(), 0)
    assert torch.equal(buf, before)


def test_prefault_faults_fresh_pages_in_once_and_skips_resident_ones() -> None:
    buf = empty_host_buffer(8 << 20)  # a fresh mapping of its own: no page touched yet
    ptr = buf.data_ptr()
    assert not resident(ptr, buf.nbytes)
    buf[: 1 << 20].fill_(7)  # the first MiB touched
    assert resident(ptr, 1 << 20)
    assert resident(ptr + 5, 1000)  # unaligned spans cover their pages
    assert not resident(ptr + (6 << 20), 1 << 20)  # past any huge page the first touch brought in
    assert not resident(ptr, buf.nbytes)
    assert prefault(ptr, buf.nbytes)  # some pages were not in: populated
    assert resident(ptr, buf.nbytes)
    assert not prefault(ptr, buf.nbytes)  # all resident now: nothing to do
    assert not prefault(ptr, 0)
    assert not resident(ptr, 0)
    assert bool((buf[: 1 << 20] == 7).all())
    assert bool((buf[1 << 20 :] == 0).all())  # populating keeps the zero fill
