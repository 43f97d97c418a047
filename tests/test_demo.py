"""The README's first command, `bash ci/demo.sh` (the pool story), runs as described,
and prints nothing but its story: no import-time warnings, no log lines."""

from __future__ import annotations

from helpers import SHIM, run_python

DEMO = SHIM + "from sglang_oobguard.__main__ import main; sys.exit(main(['demo']))"


def test_demo_tells_its_story_and_nothing_else():
    proc = run_python(DEMO, {})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout
    assert proc.stderr == ""
    assert "Demo finished as described." in out
    assert "KVOutOfBoundsError: set_kv_buffer (MHA) layer 1: 1 of 3 slot ids outside [0, 65): loc[2] = -1" in out
    assert "loc[2] = 3 is not allocated (freed)" in out and "free_index[0] = 3 is not allocated (double free)" in out
    assert "   logged: sglang_oobguard: bad KV slot ids, write contained" in out  # the warn line, in its step
    # step 5's history names the demo's own frames (a door of the package, not the guard) and says in words
    # that no forward step had run
    assert "slot 3 last freed before any forward step by " in out and "> _liveness_story (demo.py:" in out
    assert "step -1" not in out
    story = [line for line in out.splitlines() if line and not line.startswith("   ")]
    assert all(line[0].isdigit() or line.startswith(("Real sglang", "Demo ")) for line in story), story
