"""The engine lock shared with snapshot packs (functions/trainer/pass_window.py): a pack runs
inside a pass's open window without waiting for the lock, the pass lets the lock go only after
the packs it let in, and every other pack takes the lock. Events, no timing."""

from __future__ import annotations

import asyncio

from functions.trainer.pass_window import PassWindow, single_device


class OneDevice:  # what single_device() looks for on a TrainerEngine
    model = object()
    runs: dict = {}


class MultiGPU:  # DistributedTrainerEngine: no model in this process
    pass


def test_single_device():
    assert single_device(OneDevice()) and not single_device(MultiGPU())


async def test_pack_inside_an_open_window_runs_beside_the_pass_and_the_pass_waits_for_it():
    lock = asyncio.Lock()
    w = PassWindow(lock)
    in_pack, pack_may_end, order = asyncio.Event(), asyncio.Event(), []

    async def a_pass():
        async with lock:
            async with w.open(OneDevice()):
                await in_pack.wait()  # the pack got in while this pass holds the lock
                order.append("pass computed")
            order.append("pass window closed")  # only after the pack ended

    async def a_pack():
        while not w._open:
            await asyncio.sleep(0)
        async with w.pack(OneDevice()) as beside:
            assert beside and lock.locked()
            in_pack.set()
            await pack_may_end.wait()
            order.append("pack done")

    p, k = asyncio.create_task(a_pass()), asyncio.create_task(a_pack())
    await in_pack.wait()
    for _ in range(20):
        await asyncio.sleep(0)
    assert order == ["pass computed"]  # the pass's window waits for the pack
    pack_may_end.set()
    await asyncio.wait_for(asyncio.gather(p, k), 30)
    assert order == ["pass computed", "pack done", "pass window closed"] and w.beside == 1
    assert not lock.locked()


async def test_pack_outside_a_window_waits_for_the_lock():
    lock = asyncio.Lock()
    w = PassWindow(lock)
    await lock.acquire()  # an optimizer step, say: no window
    got = asyncio.Event()

    async def a_pack():
        async with w.pack(OneDevice()) as beside:
            assert not beside and lock.locked()
            got.set()

    k = asyncio.create_task(a_pack())
    for _ in range(20):
        await asyncio.sleep(0)
    assert not got.is_set()
    lock.release()
    await asyncio.wait_for(k, 30)
    assert got.is_set() and w.beside == 0


async def test_disabled_window_and_multi_gpu_engines_take_the_lock():
    for window, pass_engine, pack_engine in ((PassWindow(asyncio.Lock(), enabled=False), OneDevice(), OneDevice()),
                                             (PassWindow(asyncio.Lock()), MultiGPU(), OneDevice()),
                                             (PassWindow(asyncio.Lock()), OneDevice(), MultiGPU())):
        lock = window.lock
        packed = asyncio.Event()

        async def a_pack():
            async with window.pack(pack_engine) as beside:
                assert not beside
                packed.set()

        async with lock:
            async with window.open(pass_engine):
                k = asyncio.create_task(a_pack())
                for _ in range(20):
                    await asyncio.sleep(0)
                assert not packed.is_set()  # it waits for the lock the pass holds
        await asyncio.wait_for(k, 30)
        assert window.beside == 0
