"""A primary backend with a secondary one for the jobs the primary cannot serve exactly.

vLLM (the primary on a GPU) has no equivalent for some of what the SDK can ask
(``target_prompt_logprobs``, ``prompt_alt_tokens_k``), and a vLLM build whose LoRA path does
not apply the unembedding (``lm_head``) LoRA would sample from a different policy than the
trainer trains. Rather than refuse those jobs or serve them inexactly, :class:`RoutedBackend`
sends them to a transformers backend (:class:`functions.sampler.backends.hf.HFBackend`) on
the same device, built on the first such job (it loads the base model a second time: about 8
GB for a bf16 Qwen3-4B) and kept. Everything else goes to the primary.

The primary decides: ``primary.route_reason(job)`` returns None (serve it) or the reason it
cannot (the field name, or ``"lm_head LoRA"``), which is counted in
:attr:`RoutedBackend.routed` and shown by ``openrl status`` (:meth:`describe`).

Adapters: every adapter is loaded into the primary at once (as before); the secondary loads
one from the same directory the first time a routed job uses it, and unloads it with the
primary.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Callable

from functions.sampler.types import SampleResult, SamplerBackend
from functions.sampler.backends.common import sleep_together
from openrl.contract.payloads import Sample
from openrl.errors import ServerError

log = logging.getLogger(__name__)

#: Seconds a failed start of the secondary backend is remembered before the next routed job
#: tries again (every routed job meanwhile fails at once with that start error).
SECONDARY_RETRY_S = 300.0


class RoutedBackend:
    """``SamplerBackend`` that routes each job to ``primary`` or to a lazily built secondary.

    Args:
        primary: a backend with ``route_reason(job) -> str | None`` (the vLLM backend).
        make_secondary: builds the secondary backend (blocking; run in a worker thread); its
            ``limits`` must admit every job the primary's do.
        secondary_name: how :meth:`describe` names the secondary (``"hf"``).
    """

    def __init__(self, primary, make_secondary: Callable[[], SamplerBackend], secondary_name: str = "hf"):
        self.primary = primary
        self.limits = primary.limits
        self._make_secondary = make_secondary
        self.secondary_name = secondary_name
        self._secondary: SamplerBackend | None = None
        self._secondary_error: tuple[float, str] | None = None  # (monotonic time, message)
        self._lock = asyncio.Lock()
        self._dirs: dict[str, Path] = {}  # adapter key -> directory it was loaded from
        self._in_secondary: set[str] = set()
        #: jobs sent to the secondary, by reason
        self.routed: Counter[str] = Counter()

    @property
    def name(self) -> str:
        """``"vllm"``, or ``"vllm+hf"`` once the secondary runs (``openrl status``)."""
        p = getattr(self.primary, "name", type(self.primary).__name__)
        return f"{p}+{self.secondary_name}" if self._secondary is not None else p

    def describe(self) -> dict:
        """What ``openrl status`` shows: the routed counts and the secondary's state."""
        d = {"routed": dict(self.routed)}
        if self._secondary_error is not None:
            d["secondary_error"] = self._secondary_error[1]
        d.update(getattr(self.primary, "describe", lambda: {})())
        return d

    async def load_adapter(self, key: str, directory: Path) -> None:
        """Load into the primary (its errors propagate: ``UserError("model_path", ...)``)."""
        await self.primary.load_adapter(key, directory)
        self._dirs[key] = Path(directory)

    async def unload_adapter(self, key: str) -> None:
        """Unload from the primary and, where it was loaded, the secondary."""
        self._dirs.pop(key, None)
        await self.primary.unload_adapter(key)
        if key in self._in_secondary and self._secondary is not None:
            self._in_secondary.discard(key)
            await self._secondary.unload_adapter(key)

    async def _ready_secondary(self, job: Sample, reason: str) -> SamplerBackend:
        async with self._lock:
            if self._secondary is None:
                err = self._secondary_error
                if err is not None and time.monotonic() - err[0] < SECONDARY_RETRY_S:
                    raise ServerError(err[1])
                log.info("starting the %s sampler backend for jobs the primary cannot serve (%s)",
                         self.secondary_name, reason)
                try:
                    self._secondary = await asyncio.to_thread(self._make_secondary)
                    self._secondary_error = None
                except Exception as e:
                    msg = (f"{reason}: this job needs the {self.secondary_name} sampler backend, which "
                           f"could not start: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                    self._secondary_error = (time.monotonic(), msg)
                    log.error("%s", msg)
                    raise ServerError(msg) from None
            sec = self._secondary
            key = job.model_path  # the adapter key
            if key is not None and key not in self._in_secondary:
                directory = self._dirs.get(key)
                if directory is None:
                    raise ServerError(f"adapter {key!r} is not loaded")
                await sec.load_adapter(key, directory)
                self._in_secondary.add(key)
            return sec

    async def sample(self, job: Sample) -> SampleResult:
        """Run ``job`` on the primary, or on the secondary when the primary names a reason.

        Raises:
            UserError / ServerError: from the backend that ran it; ServerError when the
                secondary is needed and cannot start (its start error, for
                :data:`SECONDARY_RETRY_S` seconds).
        """
        reason = self.primary.route_reason(job)
        if reason is None:
            return await self.primary.sample(job)
        self.routed[reason] += 1
        sec = await self._ready_secondary(job, reason)
        return await sec.sample(job)

    async def sleep(self) -> bool:
        """Idle sleep of the primary, then of the secondary where it runs
        (:func:`~functions.sampler.backends.common.sleep_together`: False when one declined).

        Raises:
            ServerError: a backend that cannot sleep.
        """
        return await sleep_together([self.primary] + ([self._secondary] if self._secondary is not None else []))

    async def wake(self) -> None:
        """Wake the primary and the secondary where it runs."""
        await self.primary.wake()
        if self._secondary is not None:
            await self._secondary.wake()

    async def close(self) -> None:
        """Close both backends."""
        try:
            await self.primary.close()
        finally:
            if self._secondary is not None:
                await self._secondary.close()
