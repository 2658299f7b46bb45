"""What machine this is: for the trace and bench records, and as the key of choices measured here.

A figure means little without the hardware it was measured on, and a kernel choice measured on
one CPU can halve the speed of another, so both travel with `machine_info()`.
"""

import hashlib
import os
import platform
import re
from functools import cache

import torch
import transformers

DRAFTER_WEIGHTS = "drafter_weights"  # the format a run's drafter ran in: of the run, not of its machine


@cache
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@cache
def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return ""


VECTOR_ISAS = (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("sve", "SVE"), ("asimd", "NEON"))  # widest first


def vector_isa() -> str | None:
    """The widest vector extension the CPU offers ("AVX-512", "AVX2", ...): two CPUs of one model
    name ("AMD EPYC" in a VM) run the same kernels at very different speeds by it."""
    flags = set(cpu_flags().split())
    return next((name for flag, name in VECTOR_ISAS if flag in flags), None)


def gpu_name(device: torch.device | str | None = None) -> str | None:
    if not torch.cuda.is_available():
        return None
    device = torch.device(device or "cuda")
    return torch.cuda.get_device_name(device if device.type == "cuda" else None)


def blas() -> str:
    """The BLAS torch was built with, as its build config names it (e.g. oneMKL 2024.2)."""
    config = torch.__config__.show()
    for line in config.splitlines():
        if "Math Kernel Library Version" in line or "OpenBLAS" in line:
            return line.strip().lstrip("- ").replace("Intel(R) oneAPI Math Kernel Library", "oneMKL")
    found = re.search(r"BLAS_INFO=(\w+)", config)
    return found.group(1) if found else "unknown"


def machine_info(device: torch.device | str | None = None) -> dict:
    """The machine a figure was measured on (plain data, for JSON)."""
    return {
        "cpu": cpu_model(),
        "isa": vector_isa(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "gpu": gpu_name(device) if device is None or torch.device(device).type == "cuda" else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "blas": blas(),
    }


def machine_key() -> str:
    """A short stable key of what decides kernel speed here: CPU model and flags, threads, torch, BLAS."""
    parts = (cpu_model(), cpu_flags(), str(torch.get_num_threads()), torch.__version__, torch.__config__.show())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def machine_label(info: dict) -> str:
    """ "AMD EPYC, 2 threads" or "NVIDIA H200": how figures name their machine (the threads left
    out where they were not recorded)."""
    if info.get("gpu"):
        return str(info["gpu"])
    threads = f", {info['threads']} threads" if info.get("threads") is not None else ""
    isa = f" ({info['isa']})" if info.get("isa") else ""
    return f"{info.get('cpu', 'unknown CPU')}{isa}{threads}"


def describe(machine: dict) -> str:
    """ "AMD EPYC, 2 threads; lean forward, eager; linear fast 1-2→2, …; weights q4 (…)" for a trace's `machine`."""
    if not machine:
        return "machine not recorded"
    if machine.get("engine") == "vllm":
        spec = machine.get("speculative_config") or {}
        method = spec.get("method", "no speculation")
        k = f", k = {spec['num_speculative_tokens']}" if "num_speculative_tokens" in spec else ""
        return f"{machine_label(machine)}; vLLM {machine.get('vllm') or '?'} server, {method}{k}"
    compiled = f"compiled ({machine.get('compile_s', 0):.1f} s)" if machine.get("compiled") else "eager"
    note = f" [{machine['compile_note']}]" if machine.get("compile_note") else ""
    forward = machine.get("forward", "?")
    ours = f"{machine_label(machine)}; {forward} forward, {compiled}{note}; linear {machine.get('linear', '?')}"
    ours += f"; weights {machine['weights']}" if machine.get("weights") else ""
    ours += f"; drafter {machine[DRAFTER_WEIGHTS]}" if machine.get(DRAFTER_WEIGHTS) else ""
    return ours + "".join(f"; beside {p}" for p in dict.fromkeys(map(describe_peer, machine.get("peers", {}).values())))


def same_machine(a: dict, b: dict) -> bool:
    """Whether two runs' machine records name one machine and engine (what their drafters ran in aside)."""
    return {k: v for k, v in a.items() if k != DRAFTER_WEIGHTS} == {k: v for k, v in b.items() if k != DRAFTER_WEIGHTS}


def describe_peer(peer: dict) -> str:
    """ "llama.cpp (llama-cpp-python 0.3.36, AVX2 AVX512 …), 2 threads" for a bench peer's record."""
    if peer.get("engine") == "llama.cpp":
        build = f"llama-cpp-python {peer.get('llama_cpp_python', '?')}, {peer.get('cpu_features') or '?'}"
        return f"llama.cpp ({build}), {peer.get('threads', '?')} threads"
    return str(peer.get("engine", "another engine"))
