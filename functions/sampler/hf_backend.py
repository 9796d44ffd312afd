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

Sampling: per row, ``temperature == 0`` is argmax; otherwise logits / temperature, then
top-k, then top-p (nucleus over the sorted, top-k-filtered distribution), then one uniform
draw from the row's own ``torch.Generator`` (seeded from ``(job seed, sample index)``) is
inverted through the CDF. Logprobs are always those of the raw distribution:
``logit[id] - logsumexp(logits)`` in float32 (the formula of ``openrl.model.numerics``).

Threading: all model work (forwards, adapter loads/unloads) runs on one worker thread, so
``MultiLoRAModel``'s routing state is never shared between two forwards.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from functions.sampler.engine import (
    TOPK_MASK_LOGPROB,
    ModelLimits,
    SampledSequence,
    SampleJob,
    SampleResult,
)
from functions.sampler.stops import StopChecker, resolve_stop
from openrl.errors import OpenRLError, ServerError
from openrl.model.lora import MultiLoRAModel, load_peft_adapter

log = logging.getLogger(__name__)

#: prompt positions per vocabulary-projection chunk when scoring a prompt.
PROMPT_CHUNK_TOKENS = 1024


def row_seed(seed: int, index: int) -> int:
    """63-bit generator seed of sample ``index`` of a job seeded with ``seed``.

    A hash of ``(seed, index)`` only, so it is stable across processes and batches.
    """
    digest = hashlib.sha256(f"openrl-sampler:{int(seed)}:{int(index)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass(eq=False)
class _Job:
    """Book-keeping of one job inside the backend (event-loop side + worker side)."""

    job: SampleJob
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
    job: _Job
    index: int
    gen: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_lps: list[list[float]] = field(default_factory=list)


class _Batch:
    """The running rows and their KV cache (touched only by the worker thread).

    Attributes:
        rows: B running rows.
        cache: the ``DynamicCache``; each layer's ``keys``/``values`` are
            [B, kv_heads, L, head_dim] (edited in place when rows leave or join).
        mask: int64 [B, L], 1 where the cache column holds a real token of the row.
        next_tok: int64 [B], the last drawn token of each row (not yet in the cache).
        pos: int64 [B], position id of ``next_tok`` (= tokens of the row in the cache).
    """

    def __init__(self) -> None:
        self.rows: list[_Row] = []
        self.cache: Any = None
        self.mask: Tensor | None = None
        self.next_tok: Tensor | None = None
        self.pos: Tensor | None = None

    def __len__(self) -> int:
        return len(self.rows)


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
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        if tokenizer is None:
            tokenizer = _load_tokenizer(base_model_dir)
        self.tokenizer = tokenizer
        eos: set[int] = set()
        try:
            gen_cfg = GenerationConfig.from_pretrained(str(base_model_dir))
            eos |= _ids(gen_cfg.eos_token_id)
        except (OSError, ValueError):
            pass
        eos |= _ids(getattr(cfg, "eos_token_id", None))
        if tokenizer is not None:
            eos |= _ids(getattr(tokenizer, "eos_token_id", None))
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
        self._batch = _Batch()  # worker thread only
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
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self.model.remove_adapter, key)

    # ------------------------------------------------------------------ requests

    async def sample(self, job: SampleJob) -> SampleResult:
        """Queue a validated job (``max_tokens`` set) and wait for its result.

        Raises:
            ServerError: the backend is closed or a step failed.
        """
        if self._closed:
            raise ServerError("the sampler backend is closed")
        self._ensure_loop()
        seed = job.seed if job.seed is not None else secrets.randbits(63)
        ids, strs = resolve_stop(job.stop, self.limits.eos_token_ids)
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
            self._batch = _Batch()
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
            n, p = j.job.num_samples, len(j.job.prompt)
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
        self._batch = _Batch()

    # ------------------------------------------------------------------ worker thread

    @torch.no_grad()
    def _step(self, admit: list[_Job], cancelled: set[_Job]) -> tuple[list[_Job], int]:
        """One iteration: drop cancelled rows, prefill ``admit``, decode one token for all.

        Returns:
            (jobs completed in this step, rows still running).
        """
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
        T = max(len(j.job.prompt) for j in group)
        G = len(group)
        ids = torch.zeros((G, T), dtype=torch.long)
        mask = torch.zeros((G, T), dtype=torch.long)
        for g, j in enumerate(group):
            p = j.job.prompt
            ids[g, T - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[g, T - len(p) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        adapters = [j.job.adapter for j in group]
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
                if j.job.temperature > 0:
                    gen = torch.Generator(device="cpu").manual_seed(row_seed(j.seed, i))
                rows.append(_Row(job=j, index=i, gen=gen))
                src.append(g)
        src_t = torch.tensor(src, dtype=torch.long)
        toks, finished = self._process(rows, last.index_select(0, src_t.to(last.device)), done)
        keep = [r for r, f in enumerate(finished) if not f]
        if not keep:
            return
        keep_t = src_t[keep]
        new = _Batch()
        new.rows = [rows[r] for r in keep]
        if len(keep) != len(rows) or G != len(rows):
            _select_rows(cache, keep_t.to(self.device))
        new.cache = cache
        new.mask = mask.index_select(0, keep_t)
        new.next_tok = toks[keep]
        new.pos = mask.sum(-1).index_select(0, keep_t)
        self._merge(new)

    def _score_prompt(self, j: _Job, hidden: Tensor) -> None:
        """Fill ``j.result``'s prompt-side fields from the prompt's hidden states [P, H]."""
        job = j.job
        P = len(job.prompt)
        prompt = torch.tensor(job.prompt, dtype=torch.long, device=hidden.device)
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
                lps.append((logits.gather(-1, prompt[s + 1 : e + 1, None]) - lse)[:, 0])
            if K:
                v, i = logits.topk(K, dim=-1)
                tk_ids.append(i)
                tk_lps.append(v - lse)
            if tgt is not None:
                t = tgt[s:e]
                g = logits.gather(-1, t.clamp(min=0)) - lse
                tgt_lps.append(torch.where(t >= 0, g, torch.zeros((), dtype=g.dtype, device=g.device)))
            if alt_k:
                drawn = _draw_k(logits, job.temperature, alt_k, alt_gen)  # [c, k]
                alt_ids.append(drawn)
                alt_lps.append(logits.gather(-1, drawn) - lse)
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
        adapters = [r.job.job.adapter for r in b.rows]
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
        toks = _draw(logits, rows).to(logits.device)
        lp = (logits.gather(-1, toks[:, None]) - lse)[:, 0].tolist()
        kmax = max(r.job.job.topk_sample_logprobs for r in rows)
        if kmax:
            tv, ti = logits.topk(kmax, dim=-1)
            tv = (tv - lse).tolist()
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
            elif len(row.tokens) >= job.job.max_tokens:
                reason = "length"
            finished.append(reason is not None)
            if reason is not None:
                job.seqs[row.index] = SampledSequence(
                    tokens=row.tokens,
                    logprobs=row.logprobs,
                    stop_reason=reason,
                    topk=(row.topk_ids, row.topk_lps) if k else None,
                )
                job.remaining -= 1
                if job.remaining == 0:
                    job.result.sequences = list(job.seqs)
                    done.append(job)
        return toks.cpu(), finished

    def _keep(self, b: _Batch, keep: list[int]) -> None:
        """Keep only rows ``keep`` of the batch; trim all-padding leading cache columns."""
        if not keep:
            self._batch = _Batch()
            return
        if len(keep) != len(b.rows):
            idx = torch.tensor(keep, dtype=torch.long)
            b.rows = [b.rows[i] for i in keep]
            _select_rows(b.cache, idx.to(self.device))
            b.mask = b.mask.index_select(0, idx)
            b.next_tok = b.next_tok.index_select(0, idx)
            b.pos = b.pos.index_select(0, idx)
        used = b.mask.any(dim=0).nonzero()
        c = int(used[0]) if used.numel() else 0
        if c > 0:
            b.mask = b.mask[:, c:]
            for layer in b.cache.layers:
                layer.keys = layer.keys[..., c:, :]
                layer.values = layer.values[..., c:, :]

    def _merge(self, new: _Batch) -> None:
        """Append ``new``'s rows to the running batch, left-padding the shorter cache."""
        b = self._batch
        if not b.rows:
            self._batch = new
            return
        L, Ln = b.mask.shape[1], new.mask.shape[1]
        T = max(L, Ln)

        def lpad(x: Tensor, n: int, dim: int) -> Tensor:
            if n == 0:
                return x
            shape = list(x.shape)
            shape[dim] = n
            return torch.cat([x.new_zeros(shape), x], dim=dim)

        for layer, nl in zip(b.cache.layers, new.cache.layers):
            layer.keys = torch.cat([lpad(layer.keys, T - L, 2), lpad(nl.keys, T - Ln, 2)], 0)
            layer.values = torch.cat([lpad(layer.values, T - L, 2), lpad(nl.values, T - Ln, 2)], 0)
        b.mask = torch.cat([lpad(b.mask, T - L, 1), lpad(new.mask, T - Ln, 1)], 0)
        b.rows = b.rows + new.rows
        b.next_tok = torch.cat([b.next_tok, new.next_tok])
        b.pos = torch.cat([b.pos, new.pos])


# ---------------------------------------------------------------------- helpers


def _select_rows(cache: Any, idx: Tensor) -> None:
    """Keep (or repeat) batch rows ``idx`` of every layer of a ``DynamicCache``, in place."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, idx)
        layer.values = layer.values.index_select(0, idx)



def _draw(logits: Tensor, rows: list[_Row]) -> Tensor:
    """One token per row from float32 logits [R, V] (see the module docstring); int64 [R].

    A row's token depends only on its own logits, parameters and generator: rows with
    top-k/top-p filtering invert the CDF over the sorted distribution, the others over the
    vocabulary order, whatever the other rows of the batch do.
    """
    R, V = logits.shape
    out = torch.empty(R, dtype=torch.long)
    greedy = [r for r, row in enumerate(rows) if row.job.job.temperature == 0]
    if greedy:
        x = logits
        if len(greedy) != R:
            x = logits.index_select(0, torch.tensor(greedy, dtype=torch.long, device=logits.device))
        out[greedy] = x.argmax(dim=-1).cpu()
    plain, filtered = [], []
    for r, row in enumerate(rows):
        j = row.job.job
        if j.temperature > 0:
            (filtered if (0 < j.top_k < V or j.top_p < 1.0) else plain).append(r)
    for group, sort in ((plain, False), (filtered, True)):
        if group:
            out[group] = _draw_group(logits, rows, group, sort)
    return out


def _draw_group(logits: Tensor, rows: list[_Row], group: list[int], sort: bool) -> Tensor:
    """Tokens (int64 [n], CPU) for rows ``group`` (temperature > 0) of logits [R, V]."""
    V = logits.shape[1]
    dev = logits.device
    jobs = [rows[r].job.job for r in group]
    temp = torch.tensor([j.temperature for j in jobs], dtype=torch.float32, device=dev)
    if len(group) != logits.shape[0]:
        logits = logits.index_select(0, torch.tensor(group, dtype=torch.long, device=dev))
    x = logits / temp[:, None]
    u = torch.cat([torch.rand(1, generator=rows[r].gen) for r in group]).to(dev)  # [n] in [0, 1)
    order = None
    if sort:
        x, order = x.sort(dim=-1, descending=True, stable=True)
        ranks = torch.arange(V, device=dev)[None, :]
        kt = torch.tensor([j.top_k if 0 < j.top_k < V else V for j in jobs], device=dev)[:, None]
        x = x.masked_fill(ranks >= kt, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        pt = torch.tensor([float(j.top_p) for j in jobs], dtype=torch.float32, device=dev)[:, None]
        # drop a token when the mass strictly before it already reaches top_p (keeps >= 1)
        drop = ((probs.cumsum(dim=-1) - probs) >= pt) & (pt < 1.0)
        x = x.masked_fill(drop, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    cdf = probs.cumsum(dim=-1)
    target = (u * cdf[:, -1])[:, None]
    choice = torch.searchsorted(cdf, target, right=True).clamp(max=V - 1)  # [n, 1]
    # never land on a zero-probability token through rounding at the top end
    zero = probs.gather(-1, choice) <= 0
    if bool(zero.any()):
        last_nz = (probs > 0).long().cumsum(-1).argmax(-1, keepdim=True)
        choice = torch.where(zero, last_nz, choice)
    tok = choice if order is None else order.gather(-1, choice)
    return tok[:, 0].cpu()


def _draw_k(logits: Tensor, temperature: float, k: int, gen: torch.Generator) -> Tensor:
    """k independent draws per row from softmax(logits / temperature) (argmax when 0);
    int64 [N, k]."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True).expand(-1, k).contiguous()
    probs = torch.softmax(logits / temperature, dim=-1).cpu()
    return torch.multinomial(probs, k, replacement=True, generator=gen).to(logits.device)


def _ids(x: Any) -> set[int]:
    if x is None:
        return set()
    if isinstance(x, int):
        return {x}
    return {int(i) for i in x}


def _load_tokenizer(directory: Path):
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any((directory / n).is_file() for n in names):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(directory))
    except Exception:  # a model without a usable tokenizer still samples (no stop strings)
        log.warning("no usable tokenizer in %s; stop strings are disabled", directory, exc_info=True)
        return None
