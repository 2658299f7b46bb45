"""scripts/llama_cpp_build.py's decisions: a llama.cpp build names every x86 option, on for what
the CPU advertises and runs, AMX only where a probe ran its tile instructions, and a wheel cached
under a key that says how it was built; a build that fails its trial run here gives way to a
safer one."""

import importlib.util
import json
import os
import signal
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "llama_cpp_build.py"
spec = importlib.util.spec_from_file_location("llama_cpp_build", SCRIPT)
build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)

AVX512 = "avx512f avx512cd avx512vl avx512dq avx512bw avx512vbmi avx512_vnni avx512_bf16"
BASE = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi2"
EPYC = f"flags\t\t: {BASE} {AVX512} avx_vnni"  # this project's AMD machines
XEON = f"flags\t\t: {BASE} {AVX512} avx_vnni amx_bf16 amx_tile amx_int8"  # AMX in cpuid, faulting


def test_the_flags_are_read_from_proc_cpuinfo():
    text = f"processor\t: 0\nvendor_id\t: GenuineIntel\n{XEON}\nbugs\t\t: spectre_v1\n\nprocessor\t: 1\n{EPYC}\n"
    assert build.cpu_flags(text) == set(XEON.partition(":")[2].split())
    assert build.cpu_flags("processor: 0\n") == set()


def test_amx_is_built_only_where_its_probe_ran():
    xeon = build.cpu_flags(XEON)
    assert set(build.AMX) <= set(build.advertised(xeon))
    assert not set(build.AMX) & set(build.choose(xeon, amx_ran=False))
    assert set(build.AMX) <= set(build.choose(xeon, amx_ran=True))
    assert build.choose(xeon, amx_ran=False) == build.choose(build.cpu_flags(EPYC), amx_ran=False)


def test_an_option_needs_every_flag_it_compiles_and_the_option_it_extends():
    no_bw = build.cpu_flags(EPYC.replace("avx512bw", ""))
    assert not {"AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16"} & set(build.advertised(no_bw))
    no_avx = build.cpu_flags(EPYC.replace(" avx ", " "))
    assert "AVX" not in build.advertised(no_avx) and "AVX2" not in build.advertised(no_avx)
    assert build.advertised(build.cpu_flags(f"flags : {BASE}")) == build.BASELINE


def test_cmake_names_every_option_and_never_builds_native():
    options = build.choose(build.cpu_flags(XEON), amx_ran=False)
    args = build.cmake_args(options).split()
    assert "-DGGML_NATIVE=OFF" in args
    named = {a.split("=")[0].removeprefix("-DGGML_"): a.split("=")[1] for a in args if a.startswith("-DGGML_")}
    assert set(build.X86_OPTIONS) <= set(named)
    assert all(named[o] == ("ON" if o in options else "OFF") for o in build.X86_OPTIONS)
    assert named["AMX_TILE"] == "OFF" and named["AVX512_BF16"] == "ON"


def test_the_cache_key_says_the_version_architecture_and_options():
    options = build.choose(build.cpu_flags(EPYC), amx_ran=False)
    key = build.key(options, arch="x86_64")
    assert key.startswith(f"llama-cpp-python-{build.VERSION}-x86_64-sse42.")
    assert key.endswith("avx512.avx512_vbmi.avx512_vnni.avx512_bf16")
    assert build.key(build.choose(build.cpu_flags(XEON), amx_ran=True), arch="x86_64").endswith(
        "amx_tile.amx_int8.amx_bf16"
    )
    assert build.key((), arch="x86_64").endswith("-generic")


def test_fallbacks_drop_amx_then_avx512_then_all_but_x86_64_v3():
    tries = build.fallbacks(build.choose(build.cpu_flags(XEON), amx_ran=True))
    assert [bool(set(t) & set(build.AMX)) for t in tries] == [True, False, False, False]
    assert "AVX512" in tries[1] and tries[2] == build.BASELINE and tries[3] == ()  # this Xeon's rest is x86-64-v3
    odd = build.choose(build.cpu_flags(f"flags : {BASE} {AVX512} sha_ni popcnt"), amx_ran=False)
    assert len(build.fallbacks(odd)) == 3 and build.fallbacks(()) == [()]  # no AMX to drop: never tried twice


def test_the_amx_probe_decides_by_how_its_child_ended():
    xeon = build.cpu_flags(XEON)
    assert build.amx_runs(build.cpu_flags(EPYC)) == (False, "AMX not advertised")
    faults = [sys.executable, "-c", f"import os; os.kill(os.getpid(), {int(signal.SIGILL)})"]
    assert build.amx_runs(xeon, probe=faults) == (False, "AMX advertised but the probe was killed by SIGILL")
    assert build.amx_runs(xeon, probe=[sys.executable, "-c", "pass"]) == (True, "AMX tile instructions ran")


def test_the_amx_probe_compiles_here():
    """The C probe builds with this machine's gcc (it runs only where AMX is advertised)."""
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"amx-probe-{os.getpid()}"
    source = out.with_suffix(".c")
    source.write_text(build.AMX_PROBE)
    try:
        assert os.system(f"gcc -O1 -mamx-tile -mamx-int8 {source} -o {out}") == 0
    finally:
        source.unlink()
        out.unlink(missing_ok=True)


def test_a_build_that_fails_its_trial_run_gives_way_to_a_safer_one(monkeypatch, tmp_path):
    """The Xeon's story: AMX advertised, its probe passes (say), the build dies in its trial decode;
    the next build, without AMX, runs and is the one installed and recorded."""
    built, installed = [], []
    monkeypatch.setattr(build, "CACHE", tmp_path / "wheels")
    monkeypatch.setattr(build, "MARKER", tmp_path / "marker.json")
    xeon = build.cpu_flags(XEON)
    monkeypatch.setattr(build, "cpu_flags", lambda text: xeon)
    monkeypatch.setattr(build, "amx_runs", lambda flags: (True, "AMX tile instructions ran"))

    def fake_build(options, python):
        built.append(options)
        wheel = tmp_path / "wheels" / build.key(options) / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
        wheel.parent.mkdir(parents=True)
        wheel.touch()
        return wheel

    monkeypatch.setattr(build, "build", fake_build)
    monkeypatch.setattr(build, "install", lambda wheel, python: installed.append(wheel.parent.name))
    monkeypatch.setattr(build.subprocess, "run", lambda *a, **k: None)  # the uninstall of a failed build
    trial = iter([(False, "the test decode was killed by SIGILL: tilezero"), (True, "decoded 8 tokens")])
    monkeypatch.setattr(build, "library_runs", lambda python: next(trial))
    assert build.main() == 0
    assert [set(o) & set(build.AMX) for o in built] == [set(build.AMX), set()]
    marker = json.loads((tmp_path / "marker.json").read_text())
    assert (
        marker == {"wanted": build.key(built[0]), "installed": build.key(built[1])}
        and installed[-1] == marker["installed"]
    )
    failed = json.loads((tmp_path / "wheels" / build.key(built[0]) / "BUILD.json").read_text())
    assert failed["runs_here"] is False and "SIGILL" in failed["probe"] and failed["amx"] == "AMX tile instructions ran"
