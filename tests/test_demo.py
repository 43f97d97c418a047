"""The README's first command, `bash ci/demo.sh` (the pool story), runs as described."""

from __future__ import annotations

from sglang_oobguard import demo


def test_demo_tells_its_story_and_says_so(mp, capsys):
    assert demo.run() == 0
    out = capsys.readouterr().out
    assert "Demo finished as described." in out
    assert "KVOutOfBoundsError: set_kv_buffer (MHA) layer 1: 1 of 3 slot ids outside [0, 65): loc[2] = -1" in out
    assert "loc[2] = 3 is not allocated (freed)" in out and "free_index[0] = 3 is not allocated (double free)" in out
