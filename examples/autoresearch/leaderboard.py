"""The leaderboard: an append-only JSONL file, its rendered table (rich) and its plot (matplotlib).

``<out>/leaderboard.jsonl`` holds one JSON object per line, in the order things happened:

* ``{"event": "start", "id": "e0003", "time": ISO-8601, "config": {...}, "proposer": "optuna",
  "handle": 3, "rerun_of": null}``: an experiment started (``handle``: the proposer's own
  reference, e.g. the optuna trial number, or null; ``rerun_of``: the interrupted experiment
  whose config it runs again, or null);
* ``{"event": "step", "id": ..., "step": 0, "reward": 0.25, "loss": -0.1, "seconds": 1.9}``:
  one RL step finished (``reward``: the mean reward of the step's samples, in [0, 1];
  ``loss``: ``loss:sum``, null when every sample was empty; ``seconds``: wall time);
* ``{"event": "end", "id": ..., "status": S, "objective": 0.5, "steps": 3, "error": null}``:
  the experiment ended; ``S`` is ``completed``, ``pruned`` (stopped early by the proposer),
  ``stopped`` (the time budget ran out), ``failed`` (``error`` says why) or ``interrupted``
  (written on restart for an experiment that had started but not ended: the driver was
  stopped; its config is run again as a new experiment). ``objective`` is the reward of the
  last step (null if no step finished).

Readers take the file as it is; a line cut short by a crash is skipped.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

FINISHED = ("completed", "pruned", "stopped", "failed")


@dataclass
class Experiment:
    """One experiment as the leaderboard file tells it."""

    id: str
    config: dict
    proposer: str | None = None
    handle: object = None
    rerun_of: str | None = None  # the interrupted experiment whose config this one runs again
    steps: list[dict] = field(default_factory=list)
    status: str = "running"  # until an end record: running (or, after a crash, interrupted)
    objective: float | None = None
    error: str | None = None

    @property
    def best_reward(self) -> float | None:
        return max((s["reward"] for s in self.steps), default=None)


class Leaderboard:
    """Appends records to ``path`` (thread-safe, one flushed line per record) and reads them back."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def append(self, record: dict) -> None:
        line = json.dumps(record, allow_nan=False)
        with self._lock, self.path.open("a") as f:
            f.write(line + "\n")
            f.flush()

    def start(self, exp_id: str, config: dict, proposer: str, handle=None, rerun_of: str | None = None) -> None:
        self.append({"event": "start", "id": exp_id, "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                     "config": config, "proposer": proposer, "handle": handle, "rerun_of": rerun_of})

    def step(self, exp_id: str, rec: dict) -> None:
        self.append({"event": "step", "id": exp_id, **rec})

    def end(self, exp_id: str, status: str, objective: float | None, steps: int, error: str | None = None) -> None:
        self.append({"event": "end", "id": exp_id, "status": status, "objective": objective, "steps": steps,
                     "error": error})

    def experiments(self) -> dict[str, Experiment]:
        """Every experiment in the file, in start order."""
        out: dict[str, Experiment] = {}
        if not self.path.exists():
            return out
        for line in self.path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
            e = out.get(r.get("id"))
            if r.get("event") == "start":
                out[r["id"]] = Experiment(r["id"], r["config"], r.get("proposer"), r.get("handle"), r.get("rerun_of"))
            elif e is not None and r.get("event") == "step":
                e.steps.append({k: r.get(k) for k in ("step", "reward", "loss", "seconds")})
            elif e is not None and r.get("event") == "end":
                e.status, e.objective, e.error = r["status"], r.get("objective"), r.get("error")
        return out


def render_table(experiments: list[Experiment], title: str = "leaderboard"):
    """A rich Table: experiments by objective (best first; unfinished last)."""
    from rich.table import Table

    def key(e: Experiment):
        return (e.objective is None, -(e.objective or 0.0), e.id)

    t = Table(title=title, title_justify="left")
    for c in ("id", "status", "objective", "best", "steps", "lr", "rank", "loss", "group", "reward fn"):
        t.add_column(c, justify="right" if c in ("objective", "best", "steps", "lr", "rank", "group") else "left")
    for e in sorted(experiments, key=key):
        c = e.config
        t.add_row(e.id, e.status, "-" if e.objective is None else f"{e.objective:.3f}",
                  "-" if e.best_reward is None else f"{e.best_reward:.3f}", str(len(e.steps)),
                  f"{c.get('learning_rate', 0):.3g}", str(c.get("rank")), str(c.get("loss")), str(c.get("group_size")),
                  str(c.get("reward")))
    return t


def write_table(path: Path, experiments: list[Experiment]) -> str:
    """Render the table as plain text into ``path`` (and return it)."""
    from rich.console import Console

    console = Console(record=True, width=140, file=open("/dev/null", "w"), emoji=False, highlight=False)
    console.print(render_table(experiments))
    text = console.export_text()
    Path(path).write_text(text)
    return text


def preload_plotting() -> threading.Thread:
    """Import what :func:`plot` needs (matplotlib with its Agg backend: about 0.6 s of CPU on a
    2-core VM) in a background thread, so a driver that calls this while its experiments run
    does not pay for it after they end. ``plot`` works the same whether it ran or not."""

    def load() -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot  # noqa: F401
            import matplotlib.ticker  # noqa: F401
        except ImportError:
            pass  # plot() raises it where it always did, at the end

    t = threading.Thread(target=load, name="preload-matplotlib")
    t.start()
    return t


def plot(path: Path, experiments: list[Experiment]) -> None:
    """Mean reward over RL steps, one line per experiment (finished and unfinished), into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(9, 5))
    for e in experiments:
        if not e.steps:
            continue
        c = e.config
        style = "--" if e.status == "pruned" else "-"
        ax.plot([s["step"] for s in e.steps], [s["reward"] for s in e.steps], style, marker="o",
                label=f"{e.id} {c.get('loss')} lr={c.get('learning_rate', 0):.2g} r={c.get('rank')} "
                      f"g={c.get('group_size')} {c.get('reward')} [{e.status}]")
    ax.set(xlabel="RL step", ylabel="mean reward", title="autoresearch: reward per step (dashed: pruned)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
