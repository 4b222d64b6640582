"""Runs a Python api_server in-process with its internal key, so the key is in no process's argv.

``python shim.py --key-fd N (--module NAME | --script PATH) -- ARGS...`` reads the key from the
inherited pipe ``N`` (the launcher wrote it and closed its end before the spawn), closes the pipe,
sets ``sys.argv`` to ``[NAME or PATH, *ARGS, "--api-keys", KEY]`` and runs the module or script as
``__main__`` in this very process. ``/proc/PID/cmdline`` shows the argv this process was exec'd
with, never a later ``sys.argv``, so the key stays out of it; lmdeploy's CLI (``lmdeploy.cli``:
argparse over ``sys.argv[1:]``, ``--api-keys`` with ``nargs='*'``) reads it as if typed.

Stdlib only and run by path: it works under whatever interpreter runs lmdeploy, including one that
cannot import the gateway. ``--api-keys`` comes last so no ``nargs`` option in ARGS can swallow it.
"""

from __future__ import annotations

import os
import runpy
import sys

MAX_KEY_BYTES = 4096


def read_key(fd: int) -> str:
    data = b""
    try:
        while len(data) <= MAX_KEY_BYTES:
            chunk = os.read(fd, MAX_KEY_BYTES + 1 - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    key = data.decode("ascii", errors="replace").strip()
    if not key or len(data) > MAX_KEY_BYTES or any(c.isspace() or not c.isprintable() for c in key) or key.startswith("-"):
        raise SystemExit("shim: no usable key on the key pipe")
    return key


def parse(argv: list[str]) -> tuple[int, str, str, list[str]]:
    """(key fd, "module" or "script", target, ARGS); a plain parser: argparse would read ARGS too."""
    if "--" not in argv:
        raise SystemExit("usage: shim.py --key-fd N (--module NAME | --script PATH) -- ARGS...")
    split = argv.index("--")
    head, args = argv[:split], argv[split + 1 :]
    opts = dict(zip(head[::2], head[1::2]))
    if len(head) != 4 or "--key-fd" not in opts or len({"--module", "--script"} & opts.keys()) != 1:
        raise SystemExit("usage: shim.py --key-fd N (--module NAME | --script PATH) -- ARGS...")
    kind = "module" if "--module" in opts else "script"
    return int(opts["--key-fd"]), kind, opts[f"--{kind}"], args


def main(argv: list[str] | None = None) -> None:
    fd, kind, target, args = parse(sys.argv[1:] if argv is None else argv)
    key = read_key(fd)
    # This file's folder was put first on sys.path by running it by path; the target must not see it.
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:
        del sys.path[0]
    sys.argv = [target, *args, "--api-keys", key]
    del key
    if kind == "module":
        sys.path.insert(0, os.getcwd())  # as ``python -m`` does
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as running the script does
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":  # pragma: no cover - exercised through real launches
    main()
