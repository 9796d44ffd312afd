"""Timelines from the stack's sampled Python stacks (bench/profile_site/sitecustomize.py, ``--stacks``).

Each ``stacks_<pid>.txt`` holds samples of every thread's stack, each headed ``@ <seconds since the
process started>`` (taken every ``every`` seconds), each thread ``T <name>`` (the main thread first).
A sample stands for its busy thread: the main thread, unless it only waits (an event loop's
``select``, a lock, a sleep), then the first other thread that does not wait. It is labelled by that
thread's innermost frame in a "project" file (vllm, openrl, functions, torch, transformers, ...; an import in
progress is labelled ``import <file that imports>``); consecutive samples with one label form a segment.

Usage::

    python3 bench/stack_samples.py DIR [--min-s 1.0] [--out FILE.md] [--json FILE.jsonl]

Output: per process (pid, argv, first and last sample), the segments of at least ``--min-s`` seconds:
start offset from ``t0`` (s), length (s: from the segment's first sample to the next segment's first),
label, and the three innermost frames of the segment's first sample; then the seconds per label,
largest first.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>.+)$')
PROJECT = ("/vllm/", "/openrl/", "/functions/", "/torch/", "/transformers/", "/triton/", "/flashinfer/",
           "/safetensors/", "/peft/", "/tinker/", "/nats/")


def short(path: str) -> str:
    """``.../site-packages/vllm/v1/worker/gpu_worker.py`` -> ``vllm/v1/worker/gpu_worker.py``."""
    for key in PROJECT:
        i = path.rfind(key)
        if i >= 0:
            return path[i + 1:]
    return path.rsplit("/", 2)[-1] if "/" in path else path


Frames = list[tuple[str, int, str]]  # innermost first
Sample = tuple[float, str, Frames]  # (s since t0, the busy thread's name ("" for the main thread), its frames)
WAITS = {("selectors.py", "select"), ("threading.py", "wait"), ("queue.py", "get"), ("threading.py", "_wait_for_tstate_lock"),
         ("connection.py", "_recv"), ("connection.py", "poll"), ("socket.py", "accept"), ("thread.py", "_worker")}


def waiting(frames: Frames) -> bool:
    """Whether a thread only waits: its innermost frame is a select / wait / sleep of the standard library."""
    if not frames:
        return True
    f, _, fn = frames[0]
    return (f.rsplit("/", 1)[-1], fn) in WAITS or fn in ("sleep", "_sleep") or "zmq" in f


def parse(path: Path) -> tuple[dict, list[Sample]]:
    """One file -> (header, samples): per sample the busy thread (see the module docstring)."""
    head: dict = {}
    raw: list[tuple[float, list[tuple[str, Frames]]]] = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("# {"):
            head = json.loads(line[2:])
        elif line.startswith("@ "):
            raw.append((float(line[2:]), []))
        elif line.startswith("T ") and raw:
            raw[-1][1].append((line[2:], []))
        else:
            m = FRAME.match(line)
            if m and raw:
                if not raw[-1][1]:  # an older file: the main thread only, no T lines
                    raw[-1][1].append(("MainThread", []))
                raw[-1][1][-1][1].append((m["file"], int(m["line"]), m["func"]))
    samples: list[Sample] = []
    for t, threads in raw:
        busy = next((th for th in threads if not waiting(th[1])), threads[0] if threads else ("?", []))
        samples.append((t, "" if threads and busy is threads[0] else busy[0], busy[1]))
    return head, samples


def label(frames: list[tuple[str, int, str]]) -> str:
    """The innermost project frame (``file:func``); an import names the file that imports."""
    if not frames:
        return "(no python frame)"
    importing = any(f.startswith("<frozen importlib") for f, _, _ in frames[:3])
    for f, ln, fn in frames:
        if f.startswith("<frozen"):
            continue
        if importing:
            # the first real file above importlib's frames is the module body being executed; find the
            # first project file that is not itself a module body (<module>), i.e. the one that imports
            if fn == "<module>":
                continue
            return f"import from {short(f)}:{fn}"
        if any(k in f for k in PROJECT):
            return f"{short(f)}:{fn}"
    f, ln, fn = frames[0]
    return f"{short(f)}:{fn}"


def timeline(head: dict, samples: list[Sample], min_s: float) -> tuple[list[dict], Counter]:
    """Segments (consecutive samples of one label) and seconds per label; a sample stands for the time
    until the next one (the last one: ``every``)."""
    every = float(head.get("every", 0.5))
    segs: list[dict] = []
    per: Counter = Counter()
    for i, (t, thread, fr) in enumerate(samples):
        dt = (samples[i + 1][0] - t) if i + 1 < len(samples) else every
        lab = (f"[{thread}] " if thread else "") + label(fr)
        per[lab] += dt
        if segs and segs[-1]["label"] == lab:
            segs[-1]["s"] += dt
        else:
            segs.append({"at_s": round(t, 2), "s": dt, "label": lab,
                         "inner": [f"{short(f)}:{ln} {fn}" for f, ln, fn in fr[:3]]})
    return [dict(x, s=round(x["s"], 2)) for x in segs if x["s"] >= min_s], per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--min-s", type=float, default=1.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    lines: list[str] = []
    rows: list[dict] = []
    for p in sorted(Path(a.dir).glob("stacks_*.txt")):
        head, samples = parse(p)
        if not samples:
            continue
        segs, per = timeline(head, samples, a.min_s)
        every = float(head.get("every", 0.5))
        span = samples[-1][0] - samples[0][0] + every
        argv = " ".join(head.get("orig_argv") or head.get("argv") or [])[:160]
        lines.append(f"### pid {head.get('pid')} (parent {head.get('ppid')}): {argv}\n")
        lines.append(f"t0 {head.get('t0')}; {len(samples)} samples every {every} s over {span:.1f} s\n")
        lines.append("| at (s) | for (s) | busy thread in | innermost frames |\n|---:|---:|---|---|")
        for s in segs:
            lines.append(f"| {s['at_s']} | {s['s']} | `{s['label']}` | {' < '.join(s['inner'])} |")
        lines.append("\nseconds by label: " + ", ".join(f"`{k}` {v:.1f}" for k, v in per.most_common(12)) + "\n")
        rows.append({"pid": head.get("pid"), "ppid": head.get("ppid"), "t0": head.get("t0"), "argv": argv,
                     "samples": len(samples), "every": every, "span_s": round(span, 2), "segments": segs, "by_label": dict(per.most_common(30))})
    text = "\n".join(lines) if lines else f"no samples in {a.dir}\n"
    if a.out:
        Path(a.out).write_text(text)
    if a.json:
        Path(a.json).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(text)


if __name__ == "__main__":
    main()
