"""Build llama-cpp-python for the CPU it runs on, and keep a build only if it runs here.

`bash scripts/setup.sh --llama` runs this with .venv's python. A native build (-march=native)
compiles every instruction set the CPU advertises, and a CPU may advertise one it does not run:
on a virtual Intel Xeon the AMX flags are in cpuid and the kernel grants the tile permission, yet
`tilezero` faults, and a native build died with SIGILL in ggml's AMX matrix product. So:

1. the build names each of ggml's x86 options (GGML_NATIVE=OFF), on for the instruction sets the
   CPU advertises (/proc/cpuinfo), and AMX only where a small program using the tile
   instructions runs to its end in a child process (`amx_runs`);
2. the wheel is cached under a key that says the llama-cpp-python version, the architecture and
   every option it was built with (BUILD.json beside it says on which CPU, and how each probe went);
3. once installed, llama.cpp decodes the embedded model in a child process (mtp_viz.llama_worker,
   the process our peers run in, a prompt long enough for the batched products); a build that
   dies or fails there is uninstalled and the next safer option set is tried (`fallbacks`).

The decisions are plain functions of the CPU flags, tested in tests/test_llama_build.py."""

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VERSION = "0.3.36"
REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("MTP_VIZ_CACHE", Path.home() / ".cache" / "mtp-viz")) / "wheels"
MARKER = REPO / ".venv" / "llama-cpp-build.json"  # what the installed llama.cpp was built with
EXTRA = ["diskcache==5.6.3"]  # llama-cpp-python's runtime dependency we use (--no-deps otherwise)

# ggml's x86 options (ggml/CMakeLists.txt, in the order its CPU backend adds them) and the
# /proc/cpuinfo flags each compiles in: GGML_AVX512 passes -mavx512{f,cd,vl,dq,bw}.
X86_OPTIONS = {
    "SSE42": ("sse4_2",),
    "F16C": ("f16c",),
    "FMA": ("fma",),
    "BMI2": ("bmi2",),
    "AVX": ("avx",),
    "AVX2": ("avx2",),
    "AVX_VNNI": ("avx_vnni",),
    "AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "AVX512_VBMI": ("avx512vbmi",),
    "AVX512_VNNI": ("avx512_vnni",),
    "AVX512_BF16": ("avx512_bf16",),
    "AMX_TILE": ("amx_tile",),
    "AMX_INT8": ("amx_int8",),
    "AMX_BF16": ("amx_bf16",),
}
NEEDS = {  # an option is only built beside the one it extends
    "AVX2": "AVX",
    "AVX_VNNI": "AVX2",
    "AVX512": "AVX2",
    "AVX512_VBMI": "AVX512",
    "AVX512_VNNI": "AVX512",
    "AVX512_BF16": "AVX512",
    "AMX_TILE": "AVX512",
    "AMX_INT8": "AMX_TILE",
    "AMX_BF16": "AMX_TILE",
}
AMX = ("AMX_TILE", "AMX_INT8", "AMX_BF16")
AVX512 = ("AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AVX_VNNI")
BASELINE = ("SSE42", "F16C", "FMA", "BMI2", "AVX", "AVX2")  # x86-64-v3
PROBE_TIMEOUT_S = 300.0

AMX_PROBE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
struct tile_config { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };
int main(void) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) return 2;
    struct tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 3; t++) { config.rows[t] = 16; config.colsb[t] = 64; }
    int8_t a[16 * 64], b[16 * 64];
    int32_t c[16 * 16];
    memset(a, 1, sizeof a);
    memset(b, 2, sizeof b);
    _tile_loadconfig(&config);
    _tile_zero(0);
    _tile_loadd(1, a, 64);
    _tile_loadd(2, b, 64);
    _tile_dpbssd(0, 1, 2);
    _tile_stored(0, c, 64);
    _tile_release();
    return c[0] == 128 && c[255] == 128 ? 0 : 3;
}
"""


def cpu_flags(cpuinfo: str) -> set[str]:
    """The flags of the first processor in /proc/cpuinfo's text."""
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.partition(":")[2].split())
    return set()


def advertised(flags: set[str]) -> tuple[str, ...]:
    """ggml's options whose instruction sets the CPU advertises (with the options they extend)."""
    on: list[str] = []
    for option, needed in X86_OPTIONS.items():
        if set(needed) <= flags and NEEDS.get(option, option) in [*on, option]:
            on.append(option)
    return tuple(on)


def choose(flags: set[str], amx_ran: bool) -> tuple[str, ...]:
    """What to build: what the CPU advertises, AMX only if the probe ran its tile instructions."""
    return tuple(o for o in advertised(flags) if amx_ran or o not in AMX)


def fallbacks(options: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The option sets to try, safest last: as chosen; without AMX; without AVX-512; x86-64-v3; none."""
    tries = [
        options,
        tuple(o for o in options if o not in AMX),
        tuple(o for o in options if o not in AMX + AVX512),
        tuple(o for o in options if o in BASELINE),
        (),
    ]
    return list(dict.fromkeys(tries))


def cmake_args(options: tuple[str, ...]) -> str:
    """Every x86 option named, on or off: nothing left to the build machine's -march=native."""
    named = " ".join(f"-DGGML_{o}={'ON' if o in options else 'OFF'}" for o in X86_OPTIONS)
    return f"-DGGML_NATIVE=OFF {named} -DLLAVA_BUILD=OFF"


def key(options: tuple[str, ...], arch: str | None = None) -> str:
    """The cached wheel's folder: version, architecture and the options it was built with."""
    built = ".".join(o.lower() for o in options) or "generic"
    return f"llama-cpp-python-{VERSION}-{arch or platform.machine()}-{built}"


def amx_runs(flags: set[str], probe: list[str] | None = None) -> tuple[bool, str]:
    """Whether AMX tile instructions run here, by running a program that uses them in a child."""
    if not {"amx_tile", "amx_int8"} <= flags:
        return False, "AMX not advertised"
    with tempfile.TemporaryDirectory() as tmp:
        if probe is None:
            source, binary = Path(tmp) / "amx.c", Path(tmp) / "amx"
            source.write_text(AMX_PROBE)
            built = subprocess.run(
                ["gcc", "-O1", "-mamx-tile", "-mamx-int8", str(source), "-o", str(binary)],
                capture_output=True,
                text=True,
            )
            if built.returncode:
                return False, f"AMX probe did not compile: {built.stderr.strip()[-200:]}"
            probe = [str(binary)]
        try:
            ran = subprocess.run(probe, capture_output=True, timeout=30)
        except subprocess.TimeoutExpired:
            return False, "AMX probe hung"
    if ran.returncode == 0:
        return True, "AMX tile instructions ran"
    return False, f"AMX advertised but the probe {ended(ran.returncode)}"


def ended(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with status {returncode}"


def library_runs(python: Path) -> tuple[bool, str]:
    """Whether the installed llama.cpp decodes the embedded model here, in the process our peers
    use (a prompt of 64 tokens: the batched products, where ggml's widest kernels run)."""
    find = "from mtp_viz.llama_peers import shipped_gguf; print(shipped_gguf('smollm2-135m') or '')"
    gguf = subprocess.run([str(python), "-c", find], capture_output=True, text=True, cwd=REPO).stdout.strip()
    if not gguf:
        return False, "the embedded model's GGUF is not installed (run bash scripts/setup.sh first)"
    prompt = {"prompt_ids": list(range(1, 65)), "max_new_tokens": 8, "eos": []}
    spec = {"gguf": gguf, "n_ctx": 256, "threads": os.cpu_count() or 1, "lookup": None, "warm_up": prompt}
    try:
        ran = subprocess.run(
            [str(python), "-m", "mtp_viz.llama_worker", json.dumps(spec)],
            input=json.dumps(prompt) + "\n",
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            cwd=REPO,
        )
    except subprocess.TimeoutExpired:
        return False, f"no answer in {PROBE_TIMEOUT_S:.0f} s"
    answers = [json.loads(line) for line in ran.stdout.splitlines() if line.startswith("{")]
    if ran.returncode == 0 and len(answers) == 2 and len(answers[1]["tokens"]) == 8:
        return True, f"decoded 8 tokens after a 64-token prompt ({answers[0]['system_info'].strip()})"
    tail = [line for line in ran.stderr.splitlines() if line.strip()][-1:] or ["(nothing on stderr)"]
    return False, f"the test decode {ended(ran.returncode)}: {tail[0][:200]}"


def build(options: tuple[str, ...], python: Path) -> Path:
    """The wheel for these options: from the cache, or built (~6 min on 2 cores) and cached."""
    folder = CACHE / key(options)
    wheels = sorted(folder.glob("llama_cpp_python-*.whl"))
    if wheels:
        return wheels[0]
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"building llama-cpp-python {VERSION} with {cmake_args(options)}", flush=True)
    env = {**os.environ, "CMAKE_ARGS": cmake_args(options)}
    pip = [str(python), "-m", "pip", "wheel", "-q", "--no-deps", "--no-cache-dir", "-w", str(tmp)]
    subprocess.run([*pip, f"llama-cpp-python=={VERSION}"], check=True, env=env)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return sorted(folder.glob("llama_cpp_python-*.whl"))[0]


def install(wheel: Path, python: Path) -> None:
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "llama-cpp-python"], check=False)
    subprocess.run([*pip, "--no-deps", str(wheel), *EXTRA], check=True)


def main() -> int:
    python = Path(sys.executable)
    flags = cpu_flags(Path("/proc/cpuinfo").read_text())
    amx_ran, amx_why = amx_runs(flags)
    wanted = choose(flags, amx_ran)
    installed = json.loads(MARKER.read_text()) if MARKER.is_file() else {}
    if installed.get("wanted") == key(wanted):
        ok, why = library_runs(python)
        if ok:
            print(f"llama-cpp-python {VERSION} in .venv: {installed['installed']} ({why})")
            return 0
    for options in fallbacks(wanted):
        wheel = build(options, python)
        install(wheel, python)
        ok, why = library_runs(python)
        record = {
            "key": key(options),
            "cmake_args": cmake_args(options),
            "cpu": cpu_model(),
            "amx": amx_why,
            "runs_here": ok,
            "probe": why,
            "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        (wheel.parent / "BUILD.json").write_text(json.dumps(record, indent=1))
        if ok:
            MARKER.write_text(json.dumps({"wanted": key(wanted), "installed": key(options)}))
            print(f"llama-cpp-python {VERSION} in .venv: {key(options)} ({amx_why}; {why})")
            return 0
        print(f"the build {key(options)} does not run on this CPU ({why}); trying a safer one", flush=True)
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "llama-cpp-python"], check=False)
    print("error: no llama-cpp-python build runs on this CPU (see the lines above)", file=sys.stderr)
    return 1


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
