"""The pinned mmap threshold (peer/malloc.py): its setting, and that a pinned threshold keeps large buffers mapped
after glibc's own rule would have moved them onto the heap."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from p2ptrain.peer.malloc import DEFAULT, ENV, mmap_threshold, pin_mmap_threshold

# In a fresh process: a mapped 8 MiB block freed (glibc's own rule raises its threshold to 8 MiB), then whether a
# 4 MiB block is mapped (mallinfo2's hblks counts mapped blocks).
_PROBE = """
import ctypes, json, sys
from p2ptrain.peer.census import _MallInfo2
from p2ptrain.peer.malloc import pin_mmap_threshold
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = _MallInfo2
pinned = pin_mmap_threshold(int(sys.argv[1]), env={})
libc.free(libc.malloc(8 << 20))
before = libc.mallinfo2().hblks
block = libc.malloc(4 << 20)
mapped = libc.mallinfo2().hblks - before
libc.free(block)
print(json.dumps({"pinned": pinned, "mapped": mapped}))
"""


def test_the_setting_defaults_to_four_mib_and_refuses_nonsense() -> None:
    assert mmap_threshold({}) == DEFAULT == 4 << 20
    assert mmap_threshold({ENV: "0"}) == 0 and mmap_threshold({ENV: " 4194304 "}) == 4 << 20
    for bad in ("1M", "-1", "1.5", str((32 << 20) + 1)):
        with pytest.raises(ValueError, match=ENV):
            mmap_threshold({ENV: bad})


def test_nothing_is_pinned_when_off_or_when_the_user_set_glibcs_variable() -> None:
    assert not pin_mmap_threshold(0, env={})
    assert not pin_mmap_threshold(1 << 20, env={"MALLOC_MMAP_THRESHOLD_": "65536"})


def _probe(nbytes: int) -> dict[str, int | bool]:
    out = subprocess.run([sys.executable, "-c", _PROBE, str(nbytes)], capture_output=True, text=True, timeout=60,
                         check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_pinned_threshold_keeps_a_large_buffer_mapped_where_glibcs_rule_would_not() -> None:
    assert _probe(0) == {"pinned": False, "mapped": 0}  # glibc's rule: the threshold rose to 8 MiB, on the heap
    assert _probe(1 << 20) == {"pinned": True, "mapped": 1}  # pinned at 1 MiB: mapped
