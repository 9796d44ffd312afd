"""Chaos soak, long version (issue 17 item 2): 4 concurrent SDK training runs on a supervised
embedded stack while seeded random faults (trainer SIGKILL / SIGTERM, sampler, gateway and
nats-server SIGKILL) hit it for ``--duration`` seconds; then every run is compared with a
fault-free twin, every saved checkpoint with its manifest, and the counts are printed as
one JSON line per binding (and written to ``--json``).

    python bench/chaos_soak.py --duration 600 --seed 1 [--binding pull,push] [--runs 4] [--json OUT]

The loop, the client's recovery policy and the checks are ``tests/chaos.py`` (the CI
version, one fault of each kind, is ``tests/stack/test_chaos_soak.py``). The stack runs in a
fresh state directory (``--state-dir`` to keep it: logs under ``<dir>/<binding>/logs``) and
builds the offline model there (or links ``--models``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run_binding(binding: str, state: Path, args) -> dict:
    """Start a supervised stack of ``binding`` (pull | push) in ``state``, soak it, stop it."""
    from chaos import SOAK_ENV, soak, summary
    from openrl.transport.embedded import Stack

    state.mkdir(parents=True, exist_ok=True)
    if args.models and not (state / "models").exists():
        (state / "models").symlink_to(Path(args.models).resolve(), target_is_directory=True)
    stack = Stack(state_dir=state, port=0, supervise=True, push=binding == "push",
                  extra_env=dict(SOAK_ENV)).start()
    try:
        counts = soak(stack, seed=args.seed, runs=args.runs, min_steps=args.min_steps, save_every=args.save_every,
                      duration_s=args.duration, gap_s=(args.gap_min, args.gap_max), check=not args.no_check)
    finally:
        stack.stop()
    print(summary(counts, binding), flush=True)
    return counts.as_dict()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/chaos_soak.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of fault injection per binding")
    ap.add_argument("--seed", type=int, default=1, help="seed of the fault loop's random.Random")
    ap.add_argument("--binding", default="pull,push", help="comma-separated: pull (JetStream), push (HTTP)")
    ap.add_argument("--runs", type=int, default=4, help="concurrent training runs")
    ap.add_argument("--min-steps", type=int, default=3, help="steps per run at least (they go on while faults run)")
    ap.add_argument("--save-every", type=int, default=2, help="save_state + sampler weights + sample every N steps")
    ap.add_argument("--gap-min", type=float, default=2.0, help="seconds before a fault, at least")
    ap.add_argument("--gap-max", type=float, default=10.0, help="seconds before a fault, at most")
    ap.add_argument("--state-dir", help="keep the stacks' state here (default: a temporary directory)")
    ap.add_argument("--models", help="a directory with the built offline model to link (default: build it)")
    ap.add_argument("--no-check", action="store_true", help="report counts without asserting the invariants")
    ap.add_argument("--json", help="write {binding: counts} here")
    args = ap.parse_args(argv)
    base = Path(args.state_dir) if args.state_dir else Path(tempfile.mkdtemp(prefix="openrl-chaos-"))
    out = {b: run_binding(b, base / b, args) for b in args.binding.split(",") if b}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
