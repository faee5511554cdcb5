"""A fake `nvidia-cuda-mps-control` for tests: the same two faces as the real program.

    fake_mps_control.py -f      the control daemon, in the foreground: listens on
                                $CUDA_MPS_PIPE_DIRECTORY/control, logs to
                                $CUDA_MPS_LOG_DIRECTORY/control.log
    fake_mps_control.py         the client: reads commands, one per line, from stdin, sends each
                                to the daemon and prints its answer; exit code 1 when there is
                                no daemon (the real client says the same)

The subset of the real command interface it speaks:

    get_server_list                              the PIDs of MPS servers, one per line (none:
                                                 the fake starts no servers)
    get_default_active_thread_percentage         the default (100.0 until set)
    set_default_active_thread_percentage N       N in 1..100
    get_default_device_pinned_mem_limit DEV
    set_default_device_pinned_mem_limit DEV LIM  LIM like 4096M or 2G
    quit                                         the daemon removes its socket and exits 0

Anything else gets "Unrecognized command" (an error, exit code 1 in the client).

Fault injection (tests): FAKE_MPS_REFUSE=<text> makes the daemon print <text> on stderr and exit
with code 1 at once (a daemon that will not start); FAKE_MPS_MUTE=1 makes it listen but never
answer.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import time
from pathlib import Path

LIMIT = re.compile(r"^\d+(\.\d+)?[MG]$")


def _pipe() -> Path:
    return Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")) / "control"


def _answer(state: dict[str, str], line: str) -> tuple[bool, str]:
    words = line.split()
    if not words:
        return True, ""
    name, args = words[0], words[1:]
    if name == "get_server_list" and not args:
        return True, ""
    if name == "get_default_active_thread_percentage" and not args:
        return True, state["percentage"]
    if name == "set_default_active_thread_percentage" and len(args) == 1:
        if not args[0].isdigit() or not 1 <= int(args[0]) <= 100:
            return False, f"Invalid percentage {args[0]}"
        state["percentage"] = f"{float(args[0]):.1f}"
        return True, state["percentage"]
    if name == "get_default_device_pinned_mem_limit" and len(args) == 1:
        return True, state.get(f"limit{args[0]}", "0")
    if name == "set_default_device_pinned_mem_limit" and len(args) == 2:
        if not LIMIT.match(args[1]):
            return False, f"Invalid limit {args[1]}"
        state[f"limit{args[0]}"] = args[1]
        return True, ""
    if name == "quit" and not args:
        return True, ""
    return False, f"Unrecognized command {line!r}"


def daemon() -> int:
    refuse = os.environ.get("FAKE_MPS_REFUSE")
    if refuse:
        print(refuse, file=sys.stderr, flush=True)
        return 1
    path = _pipe()
    log_dir = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"))
    path.unlink(missing_ok=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(8)
    state = {"percentage": "100.0"}
    with (log_dir / "control.log").open("a") as log:
        log.write(f"[{time.time():.3f}] control daemon started, pid {os.getpid()}\n")
        log.flush()
        while True:
            connection, _ = server.accept()
            with connection, connection.makefile("rw") as stream:
                if os.environ.get("FAKE_MPS_MUTE"):
                    time.sleep(3600)
                for line in stream:
                    ok, text = _answer(state, line.strip())
                    log.write(f"[{time.time():.3f}] {line.strip()} -> {'ok' if ok else text}\n")
                    log.flush()
                    stream.write(f"{'OK' if ok else 'ERR'} {text}".replace("\n", "\\n") + "\n")
                    stream.flush()
                    if ok and line.strip() == "quit":
                        path.unlink(missing_ok=True)
                        return 0


def client() -> int:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(str(_pipe()))
    except OSError:
        print("Cannot find MPS control daemon process", file=sys.stderr)
        return 1
    failed = False
    with connection, connection.makefile("rw") as stream:
        for line in sys.stdin:
            stream.write(line.strip() + "\n")
            stream.flush()
            reply = stream.readline()
            if not reply:
                print("the control daemon closed the connection", file=sys.stderr)
                return 1
            status, _, text = reply.rstrip("\n").partition(" ")
            text = text.replace("\\n", "\n")
            if status != "OK":
                print(text, file=sys.stderr)
                failed = True
            elif text:
                print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(daemon() if sys.argv[1:] == ["-f"] else client())
