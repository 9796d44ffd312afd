"""The ``openrl`` console script.

Subcommands::

    openrl models build [--dir DIR] [--seed N] [--force] [--quiet]
    openrl models list [--json]
    openrl models add NAME DIR [--dtype D] [--max-context-length N] / openrl models remove NAME
    openrl serve [--host H] [--port P] [--storage URL] [--no-build] [--model NAME=DIR ...]
                 [--device auto|cpu|cuda] [--trainer-gpu-memory F] [--sampler-gpu-memory F]
                 [--deterministic] [--idle-timeout SECONDS]
    openrl run [--model NAME=DIR ...] [--idle-timeout SECONDS] SCRIPT [-- ARGS]
    openrl status [--base-url URL] [--api-key KEY] [--json]
    openrl status --cluster [--kubeconfig PATH] [--context C] [--namespace NS] [--nats-url URL] [--json]
    openrl stop [--timeout SECONDS]
    openrl runs list [--limit N] / openrl checkpoints list RUN
    openrl adapters import DIR --base-model NAME [--project-id P] [--json]

``--state-dir DIR`` (default ``$OPENRL_HOME`` or ``~/.openrl``) is accepted before or after
the subcommand; handlers receive it resolved to an absolute path in ``args.state_dir``.

Adding a subcommand: write a function ``(subparsers, common) -> None`` that calls
``subparsers.add_parser(name, parents=[common], ...)`` and ``set_defaults(func=handler)``, and
decorate it with :func:`command`. ``handler(args) -> int | None`` returns the exit status
(None means 0). Import heavy modules inside the handler so ``openrl --help`` stays fast.

Errors the user can cause (a bad flag, a busy port, a state directory that cannot be used, a
model directory that is not one, a stack still running) are one line on stderr,
``openrl <command>: error: <cause>; <what to do>``, and a non-zero exit (2 for usage, 1 for
the rest); no traceback. Set ``OPENRL_DEBUG=1`` to get the traceback of an unexpected error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from openrl.errors import CLIError, OpenRLError
from openrl.model.registry import RegistryError, overlay_path, state_dir

Configure = Callable[["argparse._SubParsersAction", argparse.ArgumentParser], None]
_COMMANDS: list[Configure] = []


def command(configure: Configure) -> Configure:
    """Register a subcommand: ``configure(subparsers, common)`` adds its parser (see module doc)."""
    _COMMANDS.append(configure)
    return configure


# -- models ---------------------------------------------------------------------------------


def _cmd_models_build(args: argparse.Namespace) -> int:
    from openrl.model import modelbuild

    out = Path(args.dir).expanduser() if args.dir else args.state_dir / "models" / modelbuild.DEFAULT_MODEL_NAME
    if not args.force and modelbuild.is_built(out):
        marker = modelbuild.read_marker(out) or {}
        print(f"{out}: already built (seed {marker.get('seed')}, {marker.get('param_count')} parameters); --force rebuilds")
        return 0
    path = modelbuild.build_model(out, seed=args.seed, force=args.force, progress=not args.quiet)
    marker = modelbuild.read_marker(path) or {}
    print(f"{path}: built (seed {marker.get('seed')}, {marker.get('param_count')} parameters, {marker.get('build_seconds')} s)")
    return 0


def _cmd_models_list(args: argparse.Namespace) -> int:
    from openrl.model import modelbuild
    from openrl.model.registry import ModelRegistry

    reg = ModelRegistry.load(args.registry, models_dir=args.state_dir / "models")

    def state(e) -> str:
        if e.build:
            return "built" if modelbuild.is_built(e.path) else "missing (openrl models build)"
        return "present" if e.path.is_dir() else "missing"

    if args.json:
        rows = [
            {**e.capability(), "path": str(e.path), "tokenizer_id": e.tokenizer_id, "dtype": e.dtype,
             "built": modelbuild.is_built(e.path), "state": state(e),
             "source": str(reg.overlay if e.name in reg.overlay_names else reg.source)}
            for e in reg
        ]
        print(json.dumps(rows, indent=2))
        return 0
    print(f"# registry: {reg.source}")
    print(f"# user overlay: {reg.overlay or overlay_path(reg.models_dir)}"
          + (f" ({len(reg.overlay_names)} entries, marked *)" if reg.overlay else " (none; openrl models add)"))
    for e in reg:
        flags = ",".join(f for f, on in (("train", e.trainable), ("sample", e.sampleable)) if on) or "-"
        mark = "*" if e.name in reg.overlay_names else ""
        print(f"{e.name}{mark}\t{e.max_context_length}\t{e.dtype}\t{flags}\t{e.path}\t{state(e)}")
    return 0


def _cmd_models_add(args: argparse.Namespace) -> int:
    from openrl.model.registry import add_model

    _announce(add_model(args.name, args.dir, models_dir=args.state_dir / "models", dtype=args.dtype,
                        max_context_length=args.max_context_length), args.state_dir, sys.stdout)
    return 0


def _cmd_models_remove(args: argparse.Namespace) -> int:
    from openrl.model.registry import remove_model

    ov = remove_model(args.name, models_dir=args.state_dir / "models")
    print(f"{args.name}: removed from {ov}")
    return 0


def _announce(entry, state: Path, out) -> None:
    from openrl.model.registry import ModelRegistry, overlay_path

    ov = overlay_path(state / "models")
    base = ModelRegistry.load(models_dir=state / "models", overlay=False)
    note = f" (overrides the entry in {base.source})" if entry.name in base else ""
    print(f"{entry.name}: {entry.path} (dtype {entry.dtype}, max_context_length {entry.max_context_length}) "
          f"registered in {ov}{note}", file=out)


def model_spec(text: str) -> tuple[str, str]:
    """Parse ``--model NAME=DIR`` (split at the first ``=``) into ``(NAME, DIR)``.

    Raises:
        argparse.ArgumentTypeError: no ``=``, or an empty name or directory.
    """
    name, sep, directory = text.partition("=")
    if not sep or not name.strip() or not directory.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=DIR (e.g. Qwen/Qwen3-4B-Instruct-2507=/models/qwen3-4b), "
                                         f"got {text!r}")
    return name.strip(), directory.strip()


def register_models(specs: Sequence[tuple[str, str]], state: Path):
    """Validate and write each ``(NAME, DIR)`` of ``--model`` to ``<state>/models.toml``
    (:func:`openrl.model.registry.add_model`), before the stack starts; reports each on stderr
    once its config has passed. The quick checks (directory, file names) run here; the
    ``AutoConfig`` check of a config not remembered yet is left to a
    :class:`~openrl.cli.model_check.DeferredConfigCheck` that runs while the stack starts
    (``openrl serve`` / ``openrl run``).

    Returns:
        The (not yet started) :class:`~openrl.cli.model_check.DeferredConfigCheck`, or None when
        every config was remembered (the entries are then announced here).

    Raises:
        CLIError: a directory is not a loadable causal LM (the ``--model`` it came from, what is
            wrong, what it needs).
        RegistryError: an invalid name, or an overlay that does not load.
    """
    from openrl.cli.model_check import MODEL_HINT, DeferredConfigCheck
    from openrl.model.modelcheck import ModelDirError, config_check_needed
    from openrl.model.registry import CHECKED_CONFIGS, add_model, overlay_entries

    models_dir = state / "models"
    previous = overlay_entries([n for n, _ in specs or ()], models_dir=models_dir)
    entries, pending = [], []
    for name, directory in specs or ():
        later = config_check_needed(directory, models_dir / CHECKED_CONFIGS)
        try:
            entry = add_model(name, directory, models_dir=models_dir, check_config=not later)
        except ModelDirError as exc:
            raise CLIError(f"--model {name}={directory}: {exc}; {MODEL_HINT}") from None
        if later:
            pending.append((name, directory))
        entries.append(entry)
    if not pending:
        for entry in entries:
            _announce(entry, state, sys.stderr)
        return None
    # announced once every config passed (a failed check puts all of this command's entries back)
    return DeferredConfigCheck(pending, previous, models_dir,
                               announce=lambda: [_announce(e, state, sys.stderr) for e in entries])


def _start_with_model_check(args: argparse.Namespace, start: Callable[[argparse.Namespace], int | None]) -> int | None:
    """Register ``--model`` (its config check deferred), then ``start(args)`` with
    ``args.model_check`` set to the check's wait (the stack calls it once its processes are
    spawned, before it reports ready)."""
    check = register_models(args.model, args.state_dir)
    args.model_check = check.start().wait if check is not None else None
    try:
        return start(args)
    finally:
        if check is not None:
            check.close()


@command
def _configure_models(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("models", parents=[common], help="build, list, add and remove base models")
    msub = p.add_subparsers(dest="models_command", metavar="{build,list,add,remove}", required=True)

    b = msub.add_parser(
        "build",
        parents=[common],
        help="build the offline tiny Qwen3 model + Qwen tokenizer",
        description="Write the ~9.8M-parameter Qwen3-architecture model (random weights from --seed) and "
        "the Qwen tokenizer in Hugging Face layout. Default directory: <state_dir>/models/tiny-qwen3.",
    )
    b.add_argument("--dir", help="output directory (default <state_dir>/models/tiny-qwen3)")
    b.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    b.add_argument("--force", action="store_true", help="rebuild / replace an existing directory")
    b.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    b.set_defaults(func=_cmd_models_build)

    ls = msub.add_parser("list", parents=[common], help="list registered base models and whether they are built")
    ls.add_argument("--registry", help="registry TOML (default $OPENRL_MODEL_REGISTRY or the packaged one)")
    ls.add_argument("--json", action="store_true", help="JSON output")
    ls.set_defaults(func=_cmd_models_list)

    from openrl.model.registry import DTYPE_NAMES

    a = msub.add_parser(
        "add",
        parents=[common],
        help="register a local Hugging Face causal-LM directory under a Tinker base-model name",
        description="Check DIR (config.json that transformers loads as a causal LM, weights, tokenizer; "
        "weights are not loaded) and write NAME -> DIR to <state_dir>/models.toml, which the gateway, "
        "trainer and sampler merge on top of the packaged registry. An existing NAME is replaced.",
    )
    a.add_argument("name", help="Tinker base-model name, e.g. Qwen/Qwen3-4B-Instruct-2507")
    a.add_argument("dir", help="model directory (Hugging Face layout)")
    a.add_argument("--dtype", default="auto", choices=DTYPE_NAMES,
                   help="base-weight dtype (default auto: bfloat16 on CUDA, float32 on CPU)")
    a.add_argument("--max-context-length", type=int, default=None,
                   help="prompt + completion limit in tokens (default 4096)")
    a.set_defaults(func=_cmd_models_add)

    rm = msub.add_parser("remove", parents=[common], help="remove a model added with `openrl models add`")
    rm.add_argument("name")
    rm.set_defaults(func=_cmd_models_remove)


def _idle_timeout(text: str) -> float:
    """``--idle-timeout SECONDS``: a number >= 0.

    Raises:
        argparse.ArgumentTypeError: not a number, or negative.
    """
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (a number >= 0), got {text!r}") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return v


def _add_supervisor_flags(p: argparse.ArgumentParser) -> None:
    """``--idle-timeout`` and ``--sleep-after`` (serve and run)."""
    p.add_argument("--idle-timeout", type=_idle_timeout, default=None, metavar="SECONDS",
                   help="stop the trainer / sampler after their work queue stayed empty this long and start them "
                        "again when requests queue up (scale to zero; frees the GPU); 0 keeps them up "
                        "(default $OPENRL_IDLE_TIMEOUT, else 1800; idle workers sleep long before, see --sleep-after)")
    p.add_argument("--sleep-after", type=_idle_timeout, default=None, metavar="SECONDS",
                   help="let the trainer / sampler sleep after no request was in flight this long: the process "
                        "stays, its weights (and the trainer's runs) move to host memory so the GPU is free, and "
                        "the next request wakes it (a host-to-device copy instead of a cold start); 0 = never "
                        "(default $OPENRL_SLEEP_AFTER, else 60). Scale to zero still follows after --idle-timeout")


def _add_gpu_flags(p: argparse.ArgumentParser) -> None:
    """``--device``, ``--trainer-gpu-memory``, ``--sampler-gpu-memory`` (serve and run)."""
    p.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"],
                   help="where the trainer and sampler run (default $OPENRL_DEVICE, else auto: CUDA when available)")
    p.add_argument("--trainer-gpu-memory", type=float, default=None, metavar="FRACTION",
                   help="share of the GPU's memory the trainer may allocate when it shares the GPU with the "
                        "sampler (default $OPENRL_TRAINER_GPU_MEMORY, else 0.45)")
    p.add_argument("--sampler-gpu-memory", type=float, default=None, metavar="FRACTION",
                   help="share of the GPU's memory vLLM takes (gpu_memory_utilization: weights, LoRA slots, KV "
                        "cache; default $OPENRL_SAMPLER_GPU_MEMORY, else 0.40)")
    p.add_argument("--deterministic", action="store_true", default=None,
                   help="deterministic mode: packing never changes a run's numbers and a seeded sample is the "
                        "same alone or among others (each datum and each sampled sequence runs in its own "
                        "forward: slower; default $OPENRL_DETERMINISTIC, else off; a models.toml entry's "
                        "`deterministic` overrides it per base model)")


def _port(text: str) -> int:
    """``--port N``: a TCP port, 1..65535, or 0: any free port (the stack prints the URL it got
    and writes it to ``<state>/ports.json``).

    Raises:
        argparse.ArgumentTypeError: not an integer in that range.
    """
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a TCP port number (1-65535, or 0: any free port), "
                                         f"got {text!r}") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port number (1-65535, or 0: any free port), got {v}")
    return v


def usable_state_dir(path: Path) -> Path:
    """Create ``path`` (the state directory) if needed and check that it can be written.

    Raises:
        CLIError: it cannot be created or written (the cause, and what to do).
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise CLIError(f"state dir {path} cannot be used ({exc.strerror or exc}); pass --state-dir DIR (or set "
                       "OPENRL_HOME) with a directory you can write") from None
    return path


# -- serve ----------------------------------------------------------------------------------


def _cmd_serve(args: argparse.Namespace) -> int | None:
    usable_state_dir(args.state_dir)
    if not args.storage:
        args.storage = f"file://{args.state_dir / 'storage'}"
    args.build = not args.no_build

    def serve(a: argparse.Namespace) -> int | None:
        from openrl.transport import embedded  # lazy: pulls in the whole stack (the config check already runs)

        return embedded.main(a)

    return _start_with_model_check(args, serve)


@command
def _configure_serve(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "serve",
        parents=[common],
        help="run the whole stack in one process (gateway, trainer, sampler, embedded NATS)",
    )
    p.add_argument("--host", default="127.0.0.1", help="gateway bind address (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000,
                   help="gateway port (default 8000; 0: any free port, printed and written to <state>/ports.json)")
    p.add_argument("--storage", default=None, help="weight storage URL (default file://<state_dir>/storage)")
    p.add_argument("--no-build", action="store_true", help="do not build missing base models at start")
    p.add_argument("--push", action="store_true", help="functions as HTTP receivers behind a local dispatcher "
                   "(the Knative Eventing push path) instead of JetStream pull workers")
    p.add_argument("--model", action="append", type=model_spec, default=[], metavar="NAME=DIR",
                   help="register a local model directory first (as `openrl models add NAME DIR`); repeatable")
    _add_gpu_flags(p)
    _add_supervisor_flags(p)
    p.set_defaults(func=_cmd_serve)


# -- run ------------------------------------------------------------------------------------


def _cmd_run(args: argparse.Namespace) -> int:
    if args.script_args and args.script_args[0] == "--":
        args.script_args = args.script_args[1:]
    if not Path(args.script).is_file():
        raise CLIError(f"{args.script}: no such script; give the path of a Python file (e.g. examples/rl_loop.py)")
    usable_state_dir(args.state_dir)

    def run(a: argparse.Namespace) -> int | None:
        from openrl.transport import embedded

        return embedded.run_script(a)

    return _start_with_model_check(args, run)


@command
def _configure_run(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "run",
        parents=[common],
        help="start the embedded stack, run a Python script against it (TINKER_BASE_URL/TINKER_API_KEY set), stop",
    )
    p.add_argument("script", help="Python script, e.g. examples/rl_loop.py")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script (after --)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000, help="gateway port (default 8000; 0: any free port)")
    p.add_argument("--storage", default=None, help="weight storage URL (default file://<state_dir>/storage)")
    p.add_argument("--no-build", action="store_true")
    p.add_argument("--push", action="store_true", help="functions as HTTP receivers behind a local dispatcher")
    _add_gpu_flags(p)
    _add_supervisor_flags(p)
    p.add_argument("--model", action="append", type=model_spec, default=[], metavar="NAME=DIR",
                   help="register a local model directory first (as `openrl models add NAME DIR`); repeatable; "
                   "before SCRIPT")
    p.set_defaults(func=_cmd_run)


# -- stop -----------------------------------------------------------------------------------


def _cmd_stop(args: argparse.Namespace) -> int:
    from openrl.transport import pidfile

    if not args.state_dir.is_dir():
        raise CLIError(f"state dir {args.state_dir} does not exist; pass the --state-dir the stack was "
                       "started with (default $OPENRL_HOME or ~/.openrl)")
    try:
        stopped = pidfile.stop(args.state_dir, timeout_s=args.timeout)
    except PermissionError as exc:
        raise CLIError(f"{exc}; run openrl stop as the user that started the stack") from None
    if not stopped:
        print(f"openrl stop: nothing of the stack of {args.state_dir} is running")
    else:
        print(f"openrl stop: stopped {', '.join(f'{e.name} (pid {e.pid})' for e in stopped)} "
              f"of the stack of {args.state_dir}")
    return 0


@command
def _configure_stop(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "stop", parents=[common],
        help="stop the stack of a state dir (openrl serve / run), or what is left of it",
        description="Stop every process recorded in <state_dir>/pids.json that still runs: SIGTERM to the "
        "openrl serve / run process (it stops the rest in order), then to the others, SIGKILL after --timeout.",
    )
    p.add_argument("--timeout", type=_idle_timeout, default=30.0, metavar="SECONDS",
                   help="seconds to wait after SIGTERM before SIGKILL (default 30)")
    p.set_defaults(func=_cmd_stop)


# -- status, runs, checkpoints (openrl/cli/status.py: REST clients of a gateway) -------------

from openrl.cli import status as cli_status  # noqa: E402

command(cli_status.configure)

from openrl.cli import adapters as cli_adapters  # noqa: E402

command(cli_adapters.configure)


# -- entry point ----------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line (the cause, then where the usage
    is) and exit 2, instead of the usage block and the error."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (all registered subcommands)."""
    # --state-dir is accepted at every level; SUPPRESS keeps a subparser's absent option from
    # overwriting a value given before the subcommand.
    common = Parser(add_help=False)
    common.add_argument(
        "--state-dir",
        default=argparse.SUPPRESS,
        help="state directory (default $OPENRL_HOME or ~/.openrl)",
    )
    parser = Parser(prog="openrl", parents=[common], description="openrl: a self-hosted Tinker API")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for configure in _COMMANDS:
        configure(sub, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``openrl`` command line; returns the exit status (0 ok, 1 error, 2 usage)."""
    t0 = time.monotonic()  # the command's start (serve / run record their start-up from it)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.t0 = t0
    args.state_dir = state_dir(getattr(args, "state_dir", None))
    try:
        rc = args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into head & co.: silence the flush at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (OpenRLError, RegistryError, FileExistsError, NotADirectoryError) as e:
        print(f"openrl {args.command}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # the machine refused something (a file, a port, a process): say what, no traceback
        if os.environ.get("OPENRL_DEBUG"):
            raise
        what = f"{e.strerror}: {e.filename}" if e.strerror and e.filename else (e.strerror or str(e) or type(e).__name__)
        print(f"openrl {args.command}: error: {what}; check the path / port / permissions it names "
              "(OPENRL_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1
    return 0 if rc is None else int(rc)


if __name__ == "__main__":
    sys.exit(main())
