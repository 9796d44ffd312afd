"""What the co-located hand-off saves (issue 12 item 6): a sampler snapshot of SIZE_MIB saved by a
trainer ``GCSStorage`` to the GCS emulator, then the sampler's ``get_dir`` (what it waits for before
loading the adapter) with write-through (the shared cache: sha256 check of the local copy) and
without (download from the bucket + sha256). Also the trainer's ``put_dir`` (upload) time, the
same in both. A part of the save -> sample path, not a product number.

    .venv/bin/python bench/handoff_gcs.py [--size-mib 252] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=252)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    from gcs_emulator import gcs_emulator  # tests/gcs_emulator.py: fake-gcs-server on 127.0.0.1
    from openrl.storage import TinkerPath, build_manifest, open_storage

    emu = gcs_emulator()
    url = emu.__enter__()
    stop = lambda: emu.__exit__(None, None, None)  # noqa: E731
    os.environ["STORAGE_EMULATOR_HOST"] = url
    from openrl.storage.gcs import make_client

    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    make_client().create_bucket(bucket)
    work = Path(tempfile.mkdtemp(prefix="handoff-"))
    data = os.urandom(a.size_mib << 20)
    rows = []
    try:
        for rep in range(a.reps):
            for wt in (True, False):
                cache = work / f"cache-{rep}-{wt}"
                trainer = open_storage(f"gs://{bucket}/ck", cache_dir=cache, write_through=wt)
                p = TinkerPath.parse(f"tinker://run{rep}/sampler_weights/{'wt' if wt else 'dl'}")
                tmp = Path(tempfile.mkdtemp(dir=trainer.scratch_dir() or work))
                (tmp / "adapter_model.safetensors").write_bytes(data)
                (tmp / "adapter_config.json").write_text("{}")
                m = build_manifest(tmp, p, owner="bench", ttl_seconds=None, extra={})
                t0 = time.perf_counter()
                trainer.put_dir(p, tmp, m)
                put_s = time.perf_counter() - t0
                shutil.rmtree(tmp)
                subprocess.run(["sync"], check=False)
                sampler = open_storage(f"gs://{bucket}/ck", cache_dir=cache)  # a fresh process's view
                t0 = time.perf_counter()
                sampler.get_dir(p)
                get_s = time.perf_counter() - t0
                rows.append({"write_through": wt, "put_s": round(put_s, 3), "sampler_get_dir_s": round(get_s, 3)})
                print(json.dumps({"rep": rep, **rows[-1]}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        stop()
    best = {wt: min(r["sampler_get_dir_s"] for r in rows if r["write_through"] is wt) for wt in (True, False)}
    print(json.dumps({"size_mib": a.size_mib, "sampler_get_dir_s_best": {"write_through": best[True],
                      "download": best[False]}, "saved_s": round(best[False] - best[True], 3)}))


if __name__ == "__main__":
    main()
