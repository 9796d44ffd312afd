"""A run's adapter is made outside the trainer's engine lock (issue 32: 8 parallel create_model
calls took 1.2 s each on an H100, queued behind packed passes, against 0.3 s alone)."""

from __future__ import annotations


async def test_a_create_prepares_its_adapter_while_a_pass_holds_the_engine(micro_model_dir, tmp_path):
    """``create_model`` makes its adapter (``prepare_run``: the seeded init and host-to-device
    copy) without the engine lock, so it does not wait for the packed
    pass that holds it, nor hold up the next one; it attaches the adapter once the lock is free.
    The real trainer function on CPU with the micro model; ``prepare_run`` is wrapped to record
    whether the lock was held while it ran (then runs for real)."""
    import asyncio

    from functions.trainer.function import TrainerFunction
    from openrl.contract import payloads
    from openrl.model.registry import ModelRegistry

    reg = ModelRegistry.from_dict({"models": {"micro": {"path": str(micro_model_dir)}}}, models_dir=tmp_path)
    f = TrainerFunction()
    await f.start({"registry_obj": reg, "storage_url": (tmp_path / "store").as_uri(), "device": "cpu",
                   "flush_interval_s": 0, "preload": []})
    try:
        engine = f.engines[await asyncio.to_thread(f._engine_for, "micro")]
        prepared = asyncio.Event()
        real = engine.prepare_run
        loop = asyncio.get_running_loop()

        def recorder(spec):
            out = real(spec)
            loop.call_soon_threadsafe(prepared.set)
            return out

        engine.prepare_run = recorder
        async with f._lock:  # a pass in progress
            create = asyncio.ensure_future(f._create("m1", payloads.CreateModel(
                model_id="m1", base_model="micro", lora_config={"rank": 4, "seed": 7})))
            await asyncio.wait_for(prepared.wait(), 60)  # prepared while the pass still holds the engine
            assert not create.done() and not engine.has_run("m1")
        assert (await asyncio.wait_for(create, 60))["model_id"] == "m1"
        assert engine.has_run("m1") and engine.run_spec("m1").seed == 7
    finally:
        await f.stop()
