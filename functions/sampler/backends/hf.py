"""Transformers sampler backend: batched, continuously batched decoding with a KV cache.

One background task per backend (on the event loop of its callers) owns a *batch* of
running rows (one row = one sequence being generated; a job with ``num_samples = n`` has n
rows). Each iteration of the loop runs one *step* on a single worker thread:

1. **admit** pending jobs while the batch has room (``max_batch_rows`` rows, and at most
   ``max_prefill_tokens`` prompt tokens per step; a job bigger than the batch runs alone):
   their prompts are prefilled (jobs that need per-position prompt logits one by one, the
   others together, left-padded), the first token of every row is drawn from the last
   position, and the new rows' KV caches are merged into the batch's cache (the shorter one
   left-padded along the sequence axis);
2. **decode** one token for every running row in a single batched forward
   (``input_ids`` [B, 1], ``attention_mask`` [B, L+1], ``position_ids`` = each row's own
   length, one adapter per row through ``MultiLoRAModel.use_adapters``);
3. rows that hit a stop condition or ``max_tokens`` leave the batch (their cache rows are
   dropped, and cache columns that became padding for every row are trimmed); a job
   completes when its last row does.

New jobs therefore join at step boundaries (continuous batching); rows finish
independently. Left padding is exact: padded key positions are masked out of attention and
positions come from each row's own token count, so a row's numbers do not depend on what it
is batched with (up to float reduction order).

Sampling (``hf_draw.py``): per row, ``temperature == 0`` is argmax; otherwise logits /
temperature, then top-k, then top-p, then one uniform draw from the row's own
``torch.Generator`` (seeded from ``(job seed, sample index)``) inverted through the CDF.
Logprobs are always those of the raw distribution, through
``openrl.model.logprobs.logprobs_from_logits`` (``logit[id] - logsumexp(logits)`` in
float32, the trainer's formula). The running batch and its KV cache: ``hf_batch.py``.

Threading: all model work (forwards, adapter loads/unloads) runs on one worker thread, so
``MultiLoRAModel``'s routing state is never shared between two forwards.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from functions.sampler.backends.common import load_tokenizer, row_seed, token_ids
from functions.sampler.backends import hf_solo
from functions.sampler.backends.hf_batch import RunningBatch, select_cache_rows
from functions.sampler.backends.hf_draw import draw, draw_k
from functions.sampler.stops import StopChecker, resolve_stop
from functions.sampler.types import (
    TOPK_MASK_LOGPROB,
    ModelLimits,
    SampledSequence,
    SampleResult,
)
from openrl.contract.payloads import Sample
from openrl.errors import OpenRLError, ServerError
from openrl.model.determinism import configure as configure_deterministic
from openrl.model.logprobs import logprobs_from_logits
from openrl.model.lora import MultiLoRAModel, load_peft_adapter

log = logging.getLogger(__name__)

#: prompt positions per vocabulary-projection chunk when scoring a prompt.
PROMPT_CHUNK_TOKENS = 1024


@dataclass(eq=False)
class _Job:
    """Book-keeping of one job inside the backend (event-loop side + worker side)."""

    job: Sample
    future: asyncio.Future
    stop: StopChecker
    seed: int
    seqs: list[SampledSequence | None]
    remaining: int
    result: SampleResult | None = None  # prompt-side fields, filled at prefill

    @property
    def needs_prompt_logits(self) -> bool:
        j = self.job
        return bool(j.prompt_logprobs or j.topk_prompt_logprobs or j.target_prompt_ids or j.prompt_alt_tokens_k)


@dataclass(eq=False)
class _Row:
    """One sequence being generated (sample ``index`` of ``job``) and what it drew so far."""

    job: _Job
    index: int
    gen: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_lps: list[list[float]] = field(default_factory=list)


class HFBackend:
    """``SamplerBackend`` on a transformers causal LM wrapped in ``MultiLoRAModel``.

    Args:
        base_model_dir: HF model directory (``config.json`` + safetensors; a tokenizer there
            enables stop strings).
        device: torch device string.
        dtype: model dtype (float32 on CPU).
        max_batch_rows: most rows decoded together.
        max_context: cap on prompt + generated tokens (default ``max_position_embeddings``).
        max_prefill_tokens: most prompt tokens prefilled in one step (at least one job).
        batch_window_s: how long the loop waits, when it wakes from idle, for more jobs to
            arrive before the first step (seconds).
        tokenizer: a tokenizer to use instead of loading one from ``base_model_dir``.
        deterministic: the deterministic mode (``hf_solo.py``): each job prefilled alone and its
            sequences decoded in the job's own forward, so a seeded request is bitwise the same alone or
            among others, and each finished sequence's logprobs scored as the trainer scores the
            datum ``prompt + tokens`` (slower; ``max_batch_rows`` still caps the rows running at
            once).
    """

    def __init__(
        self,
        base_model_dir: Path,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_rows: int = 64,
        max_context: int | None = None,
        max_prefill_tokens: int = 8192,
        batch_window_s: float = 0.003,
        tokenizer: Any = None,
        deterministic: bool = False,
    ):
        from transformers import AutoModelForCausalLM, GenerationConfig

        base_model_dir = Path(base_model_dir)
        base = AutoModelForCausalLM.from_pretrained(str(base_model_dir), dtype=dtype)
        base.to(device).eval()
        cfg = base.config.get_text_config(decoder=True) if hasattr(base.config, "get_text_config") else base.config
        if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
            raise ValueError("the transformers sampler backend supports full-attention models only")
        self.model = MultiLoRAModel(base)
        self.device = torch.device(device)
        if deterministic:  # the trainer's switches (eager attention on CUDA): the same kernels as its forward
            configure_deterministic(base, self.device)
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        if tokenizer is None:
            tokenizer = load_tokenizer(base_model_dir)
        self.tokenizer = tokenizer
        eos: set[int] = set()
        try:
            gen_cfg = GenerationConfig.from_pretrained(str(base_model_dir))
            eos |= token_ids(gen_cfg.eos_token_id)
        except (OSError, ValueError):
            pass
        eos |= token_ids(getattr(cfg, "eos_token_id", None))
        if tokenizer is not None:
            eos |= token_ids(getattr(tokenizer, "eos_token_id", None))
        vocab = base.get_input_embeddings().num_embeddings
        ctx = int(getattr(cfg, "max_position_embeddings", 0) or 2**31)
        if max_context is not None:
            ctx = min(ctx, int(max_context))
        self.limits = ModelLimits(
            vocab_size=int(vocab),
            max_context=ctx,
            eos_token_ids=frozenset(i for i in eos if 0 <= i < vocab),
            has_tokenizer=tokenizer is not None,
        )
        self.max_batch_rows = max(1, int(max_batch_rows))
        self.max_prefill_tokens = max(1, int(max_prefill_tokens))
        self.batch_window_s = float(batch_window_s)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="openrl-hf-sampler")
        self._batch = RunningBatch()  # worker thread only
        self.deterministic = bool(deterministic)
        self._solos: list[RunningBatch] = []  # the mode's batches, one per job (worker thread only)
        self._pending: list[_Job] = []  # event loop only, FIFO
        self._running: set[_Job] = set()  # admitted and not finished (event loop only)
        self._active_rows = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closed = False
        self.steps = 0  # forwards run (prefill groups + decode steps), for tests/metrics

    # ------------------------------------------------------------------ adapters

    async def load_adapter(self, key: str, directory: Path) -> None:
        """Load the PEFT adapter in ``directory`` as ``key`` (on the worker thread).

        Raises:
            UserError: the adapter does not fit this base model (field ``checkpoint``).
        """
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, load_peft_adapter, self.model, key, Path(directory))

    async def unload_adapter(self, key: str) -> None:
        """Drop adapter ``key`` from the model (on the worker thread; no-op if absent)."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self.model.remove_adapter, key)

    # ------------------------------------------------------------------ requests

    async def sample(self, job: Sample) -> SampleResult:
        """Queue a validated job (``sampling_params.max_tokens`` set) and wait for its result.

        Raises:
            ServerError: the backend is closed or a step failed.
        """
        if self._closed:
            raise ServerError("the sampler backend is closed")
        self._ensure_loop()
        sp = job.sampling_params
        seed = sp.seed if sp.seed is not None else secrets.randbits(63)
        ids, strs = resolve_stop(sp.stop_list, self.limits.eos_token_ids)
        fut = asyncio.get_running_loop().create_future()
        j = _Job(
            job=job,
            future=fut,
            stop=StopChecker(ids, strs, self.tokenizer if strs else None),
            seed=int(seed),
            seqs=[None] * job.num_samples,
            remaining=job.num_samples,
        )
        self._pending.append(j)
        self._wake.set()
        try:
            return await fut
        finally:
            if not fut.done():
                fut.cancel()
            if j in self._pending:
                self._pending.remove(j)

    async def sleep(self) -> bool:
        """Idle sleep: the model (base weights and loaded adapters) to host memory, the CUDA cache
        emptied (on the worker thread, between steps). False (declined) while jobs are queued or
        running; a no-op on a CPU model."""
        if self._pending or self._running:
            return False
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._move, torch.device("cpu"))
        return True

    async def wake(self) -> None:
        """Move the model back to its device (on the worker thread).

        Raises:
            torch.cuda.OutOfMemoryError: too little free device memory now.
        """
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._move, self.device)

    def _move(self, device: torch.device) -> None:
        if self.device.type == "cpu":
            return
        self._reset_batch()
        self.model.to_device(device)  # base weights and the loaded adapters
        if device.type == "cpu":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    async def close(self) -> None:
        """Stop the loop; fail queued and running jobs; shut the worker thread down."""
        self._closed = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self._fail_all(ServerError("the sampler backend is closed"))
        self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------ the loop

    def _ensure_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is not None and self._loop is loop and not self._task.done():
            return
        if self._loop is not loop:  # a new event loop (e.g. a new test): start afresh
            self._pending.clear()
            self._running.clear()
            self._active_rows = 0
            self._reset_batch()
        self._loop = loop
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._run(), name="openrl-hf-sampler-loop")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            if not self._pending and not self._running:
                self._wake.clear()
                await self._wake.wait()
                if self.batch_window_s > 0:
                    await asyncio.sleep(self.batch_window_s)
            admit = self._take_admissible()
            self._running.update(admit)
            cancelled = {j for j in self._running if j.future.done()}
            try:
                done, self._active_rows = await loop.run_in_executor(self._executor, self._step, admit, cancelled)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a failed forward: fail everything running, keep serving
                log.exception("sampler step failed")
                err = e if isinstance(e, OpenRLError) else ServerError(f"sampling failed: {type(e).__name__}: {e}")
                for j in list(self._running):
                    if not j.future.done():
                        j.future.set_exception(err)
                self._running.clear()
                self._active_rows = 0
                await loop.run_in_executor(self._executor, self._reset_batch)
                continue
            for j in cancelled:
                self._running.discard(j)
            for j in done:
                self._running.discard(j)
                if not j.future.done():
                    j.future.set_result(j.result)

    def _take_admissible(self) -> list[_Job]:
        admit: list[_Job] = []
        rows, tokens = self._active_rows, 0
        while self._pending:
            j = self._pending[0]
            if j.future.done():  # caller went away before admission
                self._pending.pop(0)
                continue
            n, p = j.job.num_samples, len(j.job.prompt_tokens)
            fits = rows + n <= self.max_batch_rows and tokens + p <= self.max_prefill_tokens
            if not fits and (rows > 0 or admit):
                break
            admit.append(self._pending.pop(0))
            rows += n
            tokens += p
        return admit

    def _fail_all(self, err: Exception) -> None:
        for j in list(self._pending) + list(self._running):
            if not j.future.done():
                j.future.set_exception(err)
        self._pending.clear()
        self._running.clear()

    def _reset_batch(self) -> None:
        self._batch = RunningBatch()
        self._solos = []

    # ------------------------------------------------------------------ worker thread

    @torch.no_grad()
    def _step(self, admit: list[_Job], cancelled: set[_Job]) -> tuple[list[_Job], int]:
        """One iteration: drop cancelled rows, prefill ``admit``, decode one token for all.

        Returns:
            (jobs completed in this step, rows still running).
        """
        if self.deterministic:
            return hf_solo.step(self, admit, cancelled)
        done: list[_Job] = []
        b = self._batch
        if cancelled and b.rows:
            self._keep(b, [i for i, r in enumerate(b.rows) if r.job not in cancelled])
        if admit:
            self._admit(admit, done)
        if self._batch.rows:
            self._decode(done)
        return done, len(self._batch.rows)

    def _logits(self, hidden: Tensor) -> Tensor:
        """float32 logits of hidden states [..., H] (routing must be set by the caller)."""
        logits = self.model.lm_head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _forward(self, ids: Tensor, mask: Tensor, pos: Tensor, cache: Any) -> tuple[Tensor, Any]:
        """Decoder forward (routing set by the caller) extending ``cache`` (None = a new
        one); returns (last hidden state [B, T, H], the cache)."""
        from transformers import DynamicCache

        if cache is None:
            cache = DynamicCache()
        out = self.model.base.base_model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=pos.to(self.device),
            past_key_values=cache,
            use_cache=True,
        )
        return out.last_hidden_state, cache

    def _admit(self, admit: list[_Job], done: list[_Job]) -> None:
        groups = [[j] for j in admit if j.needs_prompt_logits]
        plain = [j for j in admit if not j.needs_prompt_logits]
        if plain:
            groups.append(plain)
        for group in groups:
            self._prefill(group, done)

    def _prefill(self, group: list[_Job], done: list[_Job]) -> None:
        T = max(len(j.job.prompt_tokens) for j in group)
        G = len(group)
        ids = torch.zeros((G, T), dtype=torch.long)
        mask = torch.zeros((G, T), dtype=torch.long)
        for g, j in enumerate(group):
            p = j.job.prompt_tokens
            ids[g, T - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[g, T - len(p) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        adapters = [j.job.model_path for j in group]
        with self.model.use_adapters(adapters):
            hidden, cache = self._forward(ids, mask, pos, None)
            self.steps += 1
            last = self._logits(hidden[:, -1])  # [G, V]
            if G == 1 and group[0].needs_prompt_logits:
                self._score_prompt(group[0], hidden[0])
            else:
                for j in group:
                    j.result = SampleResult(sequences=[])
        # one row per sample; row r of job g starts from the job's prompt cache
        rows: list[_Row] = []
        src: list[int] = []
        for g, j in enumerate(group):
            for i in range(j.job.num_samples):
                gen = None
                if j.job.sampling_params.temperature > 0:
                    gen = torch.Generator(device="cpu").manual_seed(row_seed(j.seed, i))
                rows.append(_Row(job=j, index=i, gen=gen))
                src.append(g)
        src_t = torch.tensor(src, dtype=torch.long)
        toks, finished = self._process(rows, last.index_select(0, src_t.to(last.device)), done)
        keep = [r for r, f in enumerate(finished) if not f]
        if not keep:
            return
        keep_t = src_t[keep]
        new = RunningBatch()
        new.rows = [rows[r] for r in keep]
        if len(keep) != len(rows) or G != len(rows):
            select_cache_rows(cache, keep_t.to(self.device))
        new.cache = cache
        new.mask = mask.index_select(0, keep_t)
        new.next_tok = toks[keep]
        new.pos = mask.sum(-1).index_select(0, keep_t)
        self._merge(new)

    def _score_prompt(self, j: _Job, hidden: Tensor) -> None:
        """Fill ``j.result``'s prompt-side fields from the prompt's hidden states [P, H]."""
        job = j.job
        P = len(job.prompt_tokens)
        prompt = torch.tensor(job.prompt_tokens, dtype=torch.long, device=hidden.device)
        want_lp = job.prompt_logprobs
        K = job.topk_prompt_logprobs
        tgt = None
        if job.target_prompt_ids is not None:
            tgt = torch.tensor(job.target_prompt_ids, dtype=torch.long, device=hidden.device)  # [P-1, Kt]
        alt_k = job.prompt_alt_tokens_k
        alt_gen = None
        if alt_k:
            alt_gen = torch.Generator(device="cpu").manual_seed(row_seed(j.seed, -1))
        lps: list[Tensor] = []
        tk_ids: list[Tensor] = []
        tk_lps: list[Tensor] = []
        tgt_lps: list[Tensor] = []
        alt_ids: list[Tensor] = []
        alt_lps: list[Tensor] = []
        # position t (0..P-2) of the hidden states predicts prompt[t + 1]
        for s in range(0, P - 1, PROMPT_CHUNK_TOKENS):
            e = min(P - 1, s + PROMPT_CHUNK_TOKENS)
            logits = self._logits(hidden[None, s:e])[0]  # [c, V] (batch dim kept for LoRA routing)
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            if want_lp:
                lps.append(logprobs_from_logits(logits, prompt[s + 1 : e + 1, None], lse)[:, 0])
            if K:
                i = logits.topk(K, dim=-1).indices
                tk_ids.append(i)
                tk_lps.append(logprobs_from_logits(logits, i, lse))
            if tgt is not None:
                t = tgt[s:e]
                g = logprobs_from_logits(logits, t.clamp(min=0), lse)
                tgt_lps.append(torch.where(t >= 0, g, torch.zeros((), dtype=g.dtype, device=g.device)))
            if alt_k:
                drawn = draw_k(logits, job.sampling_params.temperature, alt_k, alt_gen)  # [c, k]
                alt_ids.append(drawn)
                alt_lps.append(logprobs_from_logits(logits, drawn, lse))
        first = P - job.prompt_logprobs_last_n if job.prompt_logprobs_last_n is not None else 1
        res = SampleResult(sequences=[])
        if want_lp:
            vals = torch.cat(lps).tolist() if lps else []
            res.prompt_logprobs = [float("nan")] + [v if t + 1 >= first else float("nan") for t, v in enumerate(vals)]
        if K:
            ids = torch.cat(tk_ids).tolist() if tk_ids else []
            vals = torch.cat(tk_lps).tolist() if tk_lps else []
            empty_i, empty_v = [0] * K, [TOPK_MASK_LOGPROB] * K
            out_i, out_v = [empty_i], [empty_v]
            for t in range(P - 1):
                if t + 1 >= first:
                    out_i.append(ids[t])
                    out_v.append(vals[t])
                else:
                    out_i.append(list(empty_i))
                    out_v.append(list(empty_v))
            res.topk_prompt = (out_i, out_v)
        if tgt is not None:
            res.target_prompt_logprobs = torch.cat(tgt_lps).tolist() if tgt_lps else []
        if alt_k:
            res.prompt_alt_tokens = (
                torch.cat(alt_ids).tolist() if alt_ids else [],
                torch.cat(alt_lps).tolist() if alt_lps else [],
            )
        j.result = res

    def _decode(self, done: list[_Job]) -> None:
        b = self._batch
        B = len(b.rows)
        ones = torch.ones((B, 1), dtype=b.mask.dtype)
        mask = torch.cat([b.mask, ones], dim=1)
        adapters = [r.job.job.model_path for r in b.rows]
        with self.model.use_adapters(adapters):
            hidden, b.cache = self._forward(b.next_tok[:, None], mask, b.pos[:, None], b.cache)
            self.steps += 1
            logits = self._logits(hidden[:, -1])
        b.mask = mask
        b.pos = b.pos + 1
        toks, finished = self._process(b.rows, logits, done)
        b.next_tok = toks
        if any(finished):
            self._keep(b, [i for i, f in enumerate(finished) if not f])

    def _process(self, rows: list[_Row], logits: Tensor, done: list[_Job]) -> tuple[Tensor, list[bool]]:
        """Draw one token per row from float32 logits [R, V], record it, check stops.

        Returns (tokens int64 [R] on CPU, finished flags)."""
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        toks = draw(logits, [r.job.job.sampling_params for r in rows], [r.gen for r in rows]).to(logits.device)
        lp = logprobs_from_logits(logits, toks[:, None], lse)[:, 0].tolist()
        kmax = max(r.job.job.topk_sample_logprobs for r in rows)
        if kmax:
            ti = logits.topk(kmax, dim=-1).indices
            tv = logprobs_from_logits(logits, ti, lse).tolist()
            ti = ti.tolist()
        toks_l = toks.tolist()
        finished: list[bool] = []
        for r, row in enumerate(rows):
            job = row.job
            row.tokens.append(toks_l[r])
            row.logprobs.append(lp[r])
            k = job.job.topk_sample_logprobs
            if k:
                row.topk_ids.append(ti[r][:k])
                row.topk_lps.append(tv[r][:k])
            reason = None
            if job.stop.check(row.tokens):
                reason = "stop"
            elif len(row.tokens) >= job.job.sampling_params.max_tokens:
                reason = "length"
            finished.append(reason is not None)
            if reason is not None:
                job.seqs[row.index] = SampledSequence(
                    tokens=row.tokens,
                    logprobs=hf_solo.rescore(self, row) if self.deterministic else row.logprobs,
                    stop_reason=reason,
                    topk=(row.topk_ids, row.topk_lps) if k else None,
                )
                job.remaining -= 1
                if job.remaining == 0:
                    job.result.sequences = list(job.seqs)
                    done.append(job)
        return toks.cpu(), finished

    def _keep(self, b: RunningBatch, keep: list[int]) -> None:
        """Keep only rows ``keep`` of the batch (an empty list empties it)."""
        if not keep:
            self._batch = RunningBatch()
            return
        b.keep(keep, self.device)

    def _merge(self, new: RunningBatch) -> None:
        """Append ``new``'s rows to the running batch (the mode: as one batch per job)."""
        if self.deterministic:  # the mode prefills one job at a time: ``new`` is that job's batch
            self._solos.append(new)
        elif not self._batch.rows:
            self._batch = new
        else:
            self._batch.merge(new)


__all__ = ["PROMPT_CHUNK_TOKENS", "HFBackend", "row_seed"]
