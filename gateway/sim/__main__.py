"""``python -m gateway.sim --port P --model NAME``: run one simulated api_server."""

from __future__ import annotations

import sys

from .config import parse_args
from .server import run


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
