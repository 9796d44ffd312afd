"""Run the gateway: ``python -m functions.gateway [--host 127.0.0.1] [--port 8000]``.

Configuration comes from OPENRL_* environment variables (see functions/gateway/app.py).
"""

import argparse

import uvicorn

from functions.gateway.app import app_from_env


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m functions.gateway")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    uvicorn.run(app_from_env(), host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
