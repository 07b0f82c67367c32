"""The device suite's mutation check: each change below to the kernel must make it fail.

    python tests/device_mutations.py [TEST_FILES...]     # default: tests/test_device.py
    ONLY="autocast" python tests/device_mutations.py     # one mutation

Each mutation is applied to a copy of the tree (in a temporary folder), which the tests then
import; a line per mutation says how the run ended and names the tests that failed (a
mutation that fails nothing is a hole in the suite).
"""
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

SRC = pathlib.Path(__file__).resolve().parents[1]
MUTATIONS = {
    "replay skips device RNG restore (function replay)": ("ckptfx/kernel/replay_env.py",
        "            for i, state in self.device_rng:\n                mod.set_rng_state(state, i)\n",
        "            for i, state in self.device_rng:\n                pass\n"),
    "replay skips device RNG restore (remat segment)": ("ckptfx/recording/segment.py",
        "            mod.set_rng_state(state, i)\n            return", "            return"),
    "replay skips device autocast restore": ("ckptfx/kernel/replay_env.py",
        "        if self.device_autocast is not None and _autocast_state(",
        "        if False and self.device_autocast is not None and _autocast_state("),
    "remat replay puts back only the current device's generator": ("ckptfx/recording/segment.py",
        "{*(i for i, _ in frame.env.device_rng), *self.rng_devices}", "()"),
    "session lookup reads only the caller's thread-local": ("ckptfx/kernel/frame.py",
        "                opened = _carried(SESSION_KEY)", "                opened = None"),
}
tests = sys.argv[1:] or ["tests/test_device.py"]
for name, (path, old, new) in MUTATIONS.items():
    if os.environ.get("ONLY") and os.environ["ONLY"] not in name:
        continue
    dst = pathlib.Path(tempfile.mkdtemp(prefix="ckptfx-mutant-")) / "tree"
    shutil.copytree(SRC, dst, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.egg-info"))
    f = dst / path
    text = f.read_text()
    assert text.count(old) == 1, (name, text.count(old))
    f.write_text(text.replace(old, new))
    env = dict(os.environ, PYTHONPATH=str(dst))
    r = subprocess.run([sys.executable, "-c", "import ckptfx; print(ckptfx.__file__)"], env=env, cwd=dst, capture_output=True, text=True)
    assert r.stdout.startswith(str(dst)), r.stdout
    r = subprocess.run([sys.executable, "-m", "pytest", *tests, "-p", "no:cacheprovider", "-rf"],
                       env=env, cwd=dst, capture_output=True, text=True)
    failed = [line.split(" - ")[0] for line in r.stdout.splitlines() if line.startswith("FAILED")]
    print(f"{name}: {'CAUGHT' if failed else 'NOT CAUGHT'} ({len(failed)} tests failed)")
    for line in failed[:8]:
        print("   ", line)
    shutil.rmtree(dst.parent)
