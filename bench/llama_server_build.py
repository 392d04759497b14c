"""Build llama-server once from the llama.cpp that llama-cpp-python==<pin> vendors, cached.

The peer the service is measured against (bench/vs_llama_server.py, bench/cost_breakdown.py)
must run the same llama.cpp as our engine, built for this CPU the same way: the sdist is
fetched with ``pip download --no-binary :all: --no-deps``, and cmake gets the CPU flags
scripts/dev.py gives llama-cpp-python (not ``-march=native``: its AMX code is killed with
SIGILL on a machine that does not grant AMX), plus ``-DLLAMA_CURL=OFF`` and static libraries
(one binary to cache).
The binary lands in ``~/.cache/llm-service/llama-server/<key>/llama-server``, where ``key``
hashes the pin and the flags; later calls return at once.

CUDA: with ``LLAMA_CUDA=1`` (or ``--cuda``) the flags are scripts/dev.py's CUDA build's
(``-DGGML_CUDA=ON``, ``LLAMA_CUDA_ARCHS``), a build of its own. ``--libs-from DIR`` instead
compiles llama-server alone, without CUDA, against shared libraries, and puts DIR's
llama.cpp libraries beside it (a CUDA llama-cpp-python wheel's ``llama_cpp/lib``): the peer
then runs the very libraries our engine runs, and ggml's CUDA kernels are compiled once,
not twice (bench/gpu_check.sh).
Offline: ``PIP_NO_INDEX=1 PIP_FIND_LINKS=<folder holding the sdist>`` (pip reads both).
Run:  .venv/bin/python bench/llama_server_build.py [--cuda | --libs-from DIR]
      (prints the binary's path)
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path.home() / ".cache" / "llm-service" / "llama-server"


def _dev():
    """scripts/dev.py as a module (its CPU flags and the pin)."""
    spec = importlib.util.spec_from_file_location("_dev", ROOT / "scripts" / "dev.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def pin() -> str:
    """``llama-cpp-python==X.Y.Z`` as requirements.txt pins it."""
    text = (ROOT / "requirements.txt").read_text()
    return next(line.strip() for line in text.splitlines()
                if line.startswith("llama-cpp-python=="))


def build(log=print, shared: bool = False, cflags: str = "",
          libs_from: Path | None = None) -> Path:
    """The cached llama-server binary, built first if needed (~10 min on 2 cores).
    ``shared``: llama.cpp's libraries as shared objects (position-independent code, as the
    llama-cpp-python wheel builds them) beside the binary (``vs_llama_server.LlamaServer``
    sets ``LD_LIBRARY_PATH`` to its folder). ``cflags``: more C and
    C++ compiler flags (a build variant to compare, e.g. ``-fno-semantic-interposition``).
    ``libs_from``: a folder of llama.cpp's shared libraries (a llama-cpp-python wheel's
    ``llama_cpp/lib``, a CUDA one say) that replace the build's own beside the binary; the
    binary itself is compiled without CUDA (it holds no GPU code: only ggml does)."""
    dev = _dev()
    flags = dev.llama_cmake_args()
    if libs_from is not None:
        shared = True
        flags = " ".join(f for f in flags.split() if "CUDA" not in f)
        libs = sorted(Path(libs_from).glob("*.so*"))
        if not any(lib.name.startswith("libllama.so") for lib in libs):
            raise SystemExit(f"{libs_from} holds no libllama.so")
        libs_key = "|".join(f"{lib.name}:{lib.stat().st_size}:{lib.stat().st_mtime_ns}"
                            for lib in libs)
    key = f"{pin()}|{flags}|{os.uname().machine}" + ("|shared" if shared else "")
    key += f"|cflags={cflags}" if cflags else ""
    key += f"|libs={libs_key}" if libs_from is not None else ""
    key = hashlib.sha256(key.encode()).hexdigest()[:16]
    binary = CACHE / key / "llama-server"
    if binary.exists():
        return binary
    log(f"building llama-server from {pin()}'s vendored llama.cpp with: {flags or 'defaults'}"
        + (f" and compiler flags {cflags}" if cflags else "")
        + (f", to run on the libraries of {libs_from}" if libs_from is not None else ""))
    with tempfile.TemporaryDirectory(prefix="llama-server-src-") as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check",
                        "--no-binary", ":all:", "--no-deps", "-d", tmp, pin()], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        src = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
        build_dir = src / "build"
        subprocess.run(["cmake", "-S", str(src), "-B", str(build_dir),
                        "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                        "-DLLAMA_BUILD_SERVER=ON",
                        f"-DBUILD_SHARED_LIBS={'ON' if shared else 'OFF'}",
                        *flags.split(),
                        *([f"-DCMAKE_C_FLAGS={cflags}", f"-DCMAKE_CXX_FLAGS={cflags}"]
                          if cflags else [])], check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server",
                        "-j", str(os.cpu_count() or 2)], check=True)
        binary.parent.mkdir(parents=True, exist_ok=True)
        for lib in (build_dir / "bin").glob("*.so*") if shared else ():
            shutil.copy2(lib, binary.parent / lib.name, follow_symlinks=True)
        if libs_from is not None:
            _put_libs(Path(libs_from), binary.parent)
        shutil.copy2(build_dir / "bin" / "llama-server", binary.with_suffix(".tmp"))
        binary.with_suffix(".tmp").rename(binary)
    log(f"llama-server cached at {binary}")
    return binary


def _put_libs(libs_from: Path, folder: Path) -> None:
    """``libs_from``'s libraries in ``folder``, each under every name the build gave its
    namesake there (``libllama.so.0``: the name the binary asks for) and its own."""
    theirs = {lib.name.split(".so")[0]: lib for lib in sorted(libs_from.glob("*.so*"))}
    for stem, lib in theirs.items():
        for name in {lib.name} | {own.name for own in folder.glob(f"{stem}.so*")}:
            shutil.copy2(lib, folder / name, follow_symlinks=True)


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", action="store_true", help="shared libraries beside it")
    parser.add_argument("--cflags", default="", help="more C/C++ compiler flags")
    parser.add_argument("--cuda", action="store_true",
                        help="with CUDA (as LLAMA_CUDA=1; LLAMA_CUDA_ARCHS, default 90)")
    parser.add_argument("--libs-from", type=Path, metavar="DIR",
                        help="run on DIR's llama.cpp libraries (e.g. a CUDA wheel's "
                             "llama_cpp/lib); compiles llama-server alone")
    args = parser.parse_args()
    if args.cuda:
        os.environ["LLAMA_CUDA"] = "1"
    print(build(log=lambda line: print(line, file=sys.stderr), shared=args.shared,
                cflags=args.cflags, libs_from=args.libs_from))
