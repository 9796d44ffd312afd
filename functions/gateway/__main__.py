"""Run the gateway: ``python -m functions.gateway [--host 127.0.0.1] [--port 8000]``.

Configuration comes from OPENRL_* environment variables (see functions/gateway/app.py).
"""

import argparse

import uvicorn

from functions.gateway.app import app_from_env


def main() -> None:
    """Parse ``--host`` / ``--port``, set up logs and tracing, serve :func:`app_from_env` with uvicorn."""
    ap = argparse.ArgumentParser(prog="python -m functions.gateway")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    from openrl.observe import logs
    from openrl.observe import tracing

    logs.setup("gateway")
    tracing.setup("openrl-gateway")
    from openrl.edge.auth import AuthConfigError

    try:
        app = app_from_env()
    except AuthConfigError as exc:  # no API keys (or a bad key file): refuse to start, say why
        tracing.shutdown()
        raise SystemExit(f"openrl gateway: {exc}") from None
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5,
                    log_config=None)
    finally:
        tracing.shutdown()


if __name__ == "__main__":
    main()
