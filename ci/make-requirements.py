#!/usr/bin/env python3
"""Write ci/requirements/sglang-VERSION.txt for sglang releases that have none, from each
release's own pins (run once per new release; ci/sweep.sh runs it for a release it lacks).

sglang itself is installed with --no-deps (its GPU wheels cannot install on a CPU
machine), so a release's file lists the other packages that importing its pools on the
CPU needs, each pinned as that release pins it: its wheel's METADATA Requires-Dist,
unconditional or in the extras the runtime installs ("srt", "runtime_common"); a package
the release does not pin is left unpinned. Existing files are kept (the matrix's four
are hand-checked): --force rewrites them.

    python3 ci/make-requirements.py 0.5.15 0.5.20      # these releases
    python3 ci/make-requirements.py --all              # every release from 0.4.10 on PyPI
    python3 ci/make-requirements.py --list             # just name them (ci/sweep.sh's default list)
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

CI = Path(__file__).resolve().parent
FIRST = (0, 4, 10)
# What importing sglang.srt.mem_cache.memory_pool (and set_kv_buffer's imports) needs on
# the CPU, as measured on the matrix's releases (ci/requirements/sglang-*.txt).
IMPORTS = ["numpy", "tqdm", "requests", "aiohttp", "IPython", "pybase64", "psutil", "pillow", "pydantic",
           "pyzmq", "starlette", "packaging", "orjson", "msgspec", "transformers", "tokenizers",
           "huggingface_hub", "sentencepiece", "compressed-tensors", "openai", "soundfile", "dill", "gguf",
           "einops", "partial_json_parser", "xgrammar",
           # always: the model runner of 0.5.20 imports the HTTP stack, 0.5.2 and 0.5.5 need fastapi
           "fastapi", "uvicorn"]
# The CPU engine's own imports beyond those (the sweep's and ci/reach-back.sh's engine runs:
# tests/test_e2e_releases.py, the clean matrix), as the matrix's releases list them.
# torchao: the model runner of 0.4.10-0.5.8 applies its config at every start (layers/torchao_utils.py).
ENGINE = ["uvloop", "setproctitle", "zstandard", "xxhash", "prometheus-client", "python-multipart", "interegular",
          "torchao"]
# Taken only where the release itself names it (0.5.x's sgl_kernel stand-in path wants it).
IF_NAMED = ["apache-tvm-ffi"]
RUNTIME_EXTRAS = {"srt", "runtime_common", "runtime-common"}


def key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_version(text: str) -> tuple:
    release, _, post = text.partition(".post")
    return tuple(int(p) for p in release.split(".")) + (int(post) if post else -1,)


def releases() -> list[str]:
    """sglang's releases on the registry from 0.4.10 on, post releases included, pre-releases not."""
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "sglang"], capture_output=True,
                         text=True, check=True).stdout
    line = next(l for l in out.splitlines() if l.startswith("Available versions:"))
    names = [v.strip() for v in line.split(":", 1)[1].split(",")]
    names = [v for v in names if re.fullmatch(r"\d+\.\d+\.\d+(\.post\d+)?", v)]
    return sorted((v for v in names if parse_version(v)[:3] >= FIRST), key=parse_version)


def requires(version: str, folder: Path) -> list[str]:
    """The release's Requires-Dist lines, from its wheel (downloaded with --no-deps)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(folder),
                    f"sglang=={version}"], check=True, capture_output=True)
    wheel = next(folder.glob(f"sglang-{version}-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(f"sglang-{version}.dist-info/METADATA").decode()
    return [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]


def pins(lines: list[str]) -> dict[str, str]:
    """package key -> its requirement as the release states it, unconditional first,
    then the runtime extras; markers for other platforms or extras are left out."""
    found: dict[str, tuple[int, str]] = {}
    for line in lines:
        req, _, marker = line.partition(";")
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
        if extra and extra.group(1) not in RUNTIME_EXTRAS:
            continue
        if marker.strip() and not extra and ("platform_machine" in marker or "sys_platform" in marker
                                             or "python_version" in marker):
            continue
        m = re.match(r"\s*([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)", req)
        name, spec = m.group(1), m.group(3).strip().strip("()")
        rank = 1 if extra else 0
        if key(name) not in found or rank < found[key(name)][0]:
            found[key(name)] = (rank, spec)
    return {k: spec for k, (_, spec) in found.items()}


def render(version: str, lines: list[str]) -> str:
    stated = pins(lines)
    out = [f"# The real sglang {version} on a CPU machine: sglang itself is installed with --no-deps",
           "# (its GPU wheels cannot install here); these are the other imports it needs, pinned to what",
           f"# sglang {version} pins where it pins them (its METADATA Requires-Dist). Written by",
           "# ci/make-requirements.py; torch: ci/requirements/torch.txt (one copy shared by every release).",
           "# With the CPU engine's own imports (ENGINE), so that the sweep runs the engine here too."]
    for name in IMPORTS + ENGINE + [n for n in IF_NAMED if key(n) in stated]:
        spec = stated.get(key(name), "")
        note = "" if key(name) in stated else "  # not named in this release's Requires-Dist"
        if key(name) == "tokenizers" and not spec:
            note = "  # as its transformers requires"
        out.append(f"{name}{spec}{note}")
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="*")
    parser.add_argument("--all", action="store_true", help="every release from 0.4.10 on the registry")
    parser.add_argument("--force", action="store_true", help="rewrite existing files")
    parser.add_argument("--list", action="store_true", help="print the releases from 0.4.10 on, oldest first")
    args = parser.parse_args()
    if args.list:
        print("\n".join(releases()))
        return 0
    versions = releases() if args.all else args.versions
    with tempfile.TemporaryDirectory() as tmp:
        for version in versions:
            target = CI / "requirements" / f"sglang-{version}.txt"
            if target.exists() and not args.force:
                print(f"{target.name}: kept")
                continue
            target.write_text(render(version, requires(version, Path(tmp))))
            print(f"{target.name}: written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
