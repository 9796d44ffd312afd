"""``--model NAME=DIR``'s config check, run beside the stack's start.

``openrl serve`` / ``openrl run`` write each ``--model`` entry to ``<state>/models.toml`` after the
quick checks (the directory, ``config.json``'s presence, weights, tokenizer: file names only) and
load ``config.json`` with ``transformers.AutoConfig`` in a process of their own
(``python -m openrl.model.modelcheck``) while nats-server, the workers and the gateway start. That
check imports torch and transformers: on a GPU host with a cold page cache 17 s (H100,
2026-12-07, docs/benchmarks.md "Fifteenth session") that used to come before the first worker
started. A config remembered in ``<state>/models/.checked-configs.json`` is not checked again (no
process at all).

A check that fails stops the stack before it reports ready (:meth:`DeferredConfigCheck.wait`
raises the same one-line :class:`~openrl.errors.CLIError` as before) and puts the overlay's
entries back as they were, so nothing stored before the command is lost.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

from openrl.errors import CLIError

#: What a failed ``--model`` check tells the user to give instead (one line with the cause).
MODEL_HINT = "give the directory of a Hugging Face causal LM (config.json, safetensors weights, tokenizer)"


class DeferredConfigCheck:
    """The ``AutoConfig`` checks of the ``--model`` entries not remembered yet.

    Args:
        pending: ``(name, directory)`` per entry to check.
        previous: the overlay's entries before the command, for every ``--model`` name
            (:func:`openrl.model.registry.overlay_entries`): all are put back when a check fails.
        models_dir: the models directory (its overlay and ``.checked-configs.json``).
        announce: reports the command's entries once every check passed.
    """

    def __init__(self, pending: list[tuple[str, str]], previous: dict[str, dict | None], models_dir: Path,
                 announce: Callable[[], object] = lambda: None):
        self.pending, self.previous, self.models_dir, self.announce = pending, previous, models_dir, announce
        self.proc: subprocess.Popen | None = None

    def start(self) -> "DeferredConfigCheck":
        """Start ``python -m openrl.model.modelcheck`` on the pending directories."""
        from openrl.model.registry import CHECKED_CONFIGS

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "openrl.model.modelcheck", "--checked", str(self.models_dir / CHECKED_CONFIGS),
             *[d for _, d in self.pending]],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        return self

    def wait(self) -> None:
        """Wait for the check (seconds: the torch import).

        Raises:
            CLIError: a config does not load or is not a causal LM (``--model NAME=DIR: cause;
                hint``), or the check process itself failed (its exit status and last output).
                The overlay's entries are put back first.
        """
        assert self.proc is not None, "start() first"
        out, err = self.proc.communicate()
        if self.proc.returncode == 0:
            self.announce()
            return
        self._restore()
        by_dir = {d: n for n, d in self.pending}
        try:
            failed = json.loads(out.strip().splitlines()[-1])
            name, directory, cause = by_dir[failed["path"]], failed["path"], failed["error"]
        except (ValueError, IndexError, KeyError, TypeError):
            tail = " | ".join((err or out).strip().splitlines()[-3:]) or "no output"
            dirs = " ".join(f"--model {n}={d}" for n, d in self.pending)
            raise CLIError(f"{dirs}: the config check (python -m openrl.model.modelcheck) exited with status "
                           f"{self.proc.returncode}: {tail}") from None
        raise CLIError(f"--model {name}={directory}: {cause}; {MODEL_HINT}")

    def close(self) -> None:
        """Stop the check if it still runs (the stack failed to start for another reason)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()

    def _restore(self) -> None:
        from openrl.model.registry import restore_overlay_entries

        restore_overlay_entries(self.previous, models_dir=self.models_dir)
