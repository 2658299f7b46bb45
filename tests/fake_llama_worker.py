"""A stand-in for `python -m mtp_viz.llama_worker`, speaking its protocol, for the tests of what a
native crash or a hang becomes (tests/test_native_peers.py). By $FAKE_LLAMA_MODE: `ok` answers
every request with the tokens 5, 6, 7; `crash-after:N` answers N requests, then dies by SIGILL as
llama.cpp did on a CPU whose AMX faults; `hang-after:N` answers N, then never again. Its pid goes
to $FAKE_LLAMA_PIDS (one a line)."""

import json
import os
import signal
import sys
import time

from mtp_viz.child import exit_with_parent


def main() -> None:
    exit_with_parent()
    if os.environ.get("FAKE_LLAMA_PIDS"):
        with open(os.environ["FAKE_LLAMA_PIDS"], "a") as f:
            f.write(f"{os.getpid()}\n")
    mode, _, after = os.environ.get("FAKE_LLAMA_MODE", "ok").partition("-after:")
    print(json.dumps({"ready": True, "system_info": "CPU : AVX = 1 | AMX_INT8 = 1 |"}), flush=True)
    for answered, line in enumerate(sys.stdin):
        if mode != "ok" and answered >= int(after):
            print("ggml_backend_amx_mul_mat: about to run tilezero", file=sys.stderr, flush=True)
            if mode == "crash":
                os.kill(os.getpid(), signal.SIGILL)
            time.sleep(3600)
        request = json.loads(line)
        print(json.dumps({"tokens": [5, 6, 7][: request["max_new_tokens"]], "wall_time_s": 0.01}), flush=True)


if __name__ == "__main__":
    main()
