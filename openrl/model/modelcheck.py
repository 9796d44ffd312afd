"""Is a directory a Hugging Face causal LM that the trainer and sampler can load?

:func:`validate_model_dir` is what ``openrl models add`` and ``--model NAME=DIR`` run before a
directory enters the registry. It reads ``config.json`` (with ``transformers.AutoConfig``) and
looks at file names; it never loads weights, so it takes well under a second for any model
size. A directory passes when it has:

- ``config.json`` that ``AutoConfig.from_pretrained`` loads, whose config class
  ``transformers.AutoModelForCausalLM`` supports (the ``MODEL_FOR_CAUSAL_LM`` mapping), that is
  not an encoder-decoder, and whose ``architectures`` (when listed) name a causal-LM class: one
  of that mapping's classes, or a ``*ForCausalLM`` / ``*LMHeadModel`` /
  ``*ForConditionalGeneration`` class (multimodal checkpoints whose text model
  ``AutoModelForCausalLM`` loads, e.g. Gemma 3, Qwen3.5);
- weights: ``model.safetensors``, or ``model.safetensors.index.json`` whose shards all exist
  (``pytorch_model.bin`` / ``pytorch_model.bin.index.json`` are accepted too);
- a tokenizer: ``tokenizer.json``, or ``tokenizer_config.json`` with a vocabulary file
  (``vocab.json``, ``vocab.txt``, ``tokenizer.model``, ``spiece.model``, ``*.tiktoken``, ...).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from openrl.errors import RegistryError

#: Weight files, in the order they are looked for: (single file, shard index).
WEIGHT_FILES = (("model.safetensors", "model.safetensors.index.json"),
                ("pytorch_model.bin", "pytorch_model.bin.index.json"))
#: Vocabulary files that make ``tokenizer_config.json`` a loadable tokenizer without ``tokenizer.json``.
VOCAB_FILES = ("vocab.json", "vocab.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
               "tiktoken.model")
_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


class ModelDirError(RegistryError):
    """A directory is not a loadable causal LM; the message names what is missing or wrong."""


def validate_model_dir(path: str | os.PathLike, checked: str | os.PathLike | None = None, *,
                       config: bool = True) -> None:
    """Check that ``path`` is a Hugging Face causal-LM directory (see the module docstring).

    Loads only ``config.json``, never the weights.

    Args:
        path: the model directory.
        checked: a JSON file remembering the ``config.json`` files that passed the config check
            (by directory, the file's sha256 and the transformers version). A config remembered
            there is not loaded again: the check imports transformers and torch, which on a GPU
            host is seconds of every ``openrl serve --model`` start before its workers start
            (``openrl models add`` / ``--model`` pass ``<models_dir>/.checked-configs.json``).
            The weight and tokenizer checks (file names) run every time.
        config: False skips the ``AutoConfig`` check (only that ``config.json`` exists is
            checked): ``openrl serve --model`` runs it in a process of its own while the workers
            start (:func:`config_check_needed`, :func:`main`).

    Raises:
        ModelDirError: ``path`` is not a directory, or has no ``config.json``, a config that
            ``AutoConfig`` cannot load or that is not a causal LM, no weights (or missing shards),
            or no tokenizer. The message names the directory and exactly what is missing.
    """
    d = Path(path).expanduser()
    if not d.exists():
        raise ModelDirError(f"{d} does not exist")
    if not d.is_dir():
        raise ModelDirError(f"{d} is not a directory")
    if not (d / "config.json").is_file():
        raise ModelDirError(f"{d} has no config.json (not a Hugging Face model directory)")
    if config:
        check_config(d, checked)
    _check_weights(d)
    _check_tokenizer(d)


def config_check_needed(path: str | os.PathLike, checked: str | os.PathLike) -> bool:
    """Whether ``path``'s ``config.json`` is not remembered in ``checked`` (its
    :func:`check_config` would load it). Reads only the two files; never raises."""
    d = Path(path).expanduser()
    try:
        return _config_key(d) not in _read_keys(Path(checked))
    except OSError:
        return True


def check_config(path: str | os.PathLike, checked: str | os.PathLike | None = None) -> None:
    """The ``AutoConfig`` part of :func:`validate_model_dir`, skipped for a config remembered in
    ``checked`` and remembered there once it passes.

    Raises:
        ModelDirError: the config does not load, or is not a causal LM (the message names it).
    """
    d = Path(path).expanduser()
    key = _config_key(d) if checked is not None else None
    known = _read_keys(Path(checked)) if key is not None else []
    if key not in known:
        _check_config(d)
        if key is not None:
            _write_keys(Path(checked), [k for k in known if k != key][-63:] + [key])


def _config_key(d: Path) -> str:
    """``<dir>|<sha256 of config.json>|transformers <version>``: what a config check depends on."""
    import hashlib
    import importlib.metadata

    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        version = "none"
    digest = hashlib.sha256((d / "config.json").read_bytes()).hexdigest()
    return f"{d.resolve()}|{digest}|transformers {version}"


def _read_keys(checked: Path) -> list[str]:
    """The remembered keys; none when the file is missing or unreadable (then everything is checked again)."""
    try:
        return [k for k in json.loads(checked.read_text(encoding="utf-8")) if isinstance(k, str)]
    except (OSError, ValueError, TypeError):
        return []


def _write_keys(checked: Path, keys: list[str]) -> None:
    """Replace the file atomically. A file that cannot be written only means the next start checks again."""
    try:
        checked.parent.mkdir(parents=True, exist_ok=True)
        tmp = checked.with_name(f"{checked.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(keys, indent=0), encoding="utf-8")
        os.replace(tmp, checked)
    except OSError:
        pass


def _check_config(d: Path) -> None:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(str(d), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises ValueError, KeyError, OSError, ...
        raise ModelDirError(f"{d}/config.json does not load with transformers.AutoConfig: {e}") from e
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelDirError(f"{d}/config.json's model_type {model_type!r} is not a causal LM "
                            "(transformers.AutoModelForCausalLM has no class for it)")
    if getattr(config, "is_encoder_decoder", False):
        raise ModelDirError(f"{d}/config.json describes an encoder-decoder model (is_encoder_decoder), "
                            "not a causal LM")
    archs = list(getattr(config, "architectures", None) or [])
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if archs and not any(a in causal or a.endswith(_CAUSAL_SUFFIXES) for a in archs):
        raise ModelDirError(f"{d}/config.json's architectures {archs} is not a causal LM "
                            f"(expected e.g. {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]})")


def _check_weights(d: Path) -> None:
    for single, index in WEIGHT_FILES:
        if (d / single).is_file():
            return
        if (d / index).is_file():
            try:
                weight_map = json.loads((d / index).read_text(encoding="utf-8"))["weight_map"]
                shards = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ModelDirError(f"{d}/{index} is not a shard index (a JSON object with 'weight_map'): {e}") from e
            missing = [s for s in shards if not (d / s).is_file()]
            if missing:
                raise ModelDirError(f"{d}/{index} names shards that are missing: {missing}")
            if not shards:
                raise ModelDirError(f"{d}/{index} names no shards")
            return
    names = ", ".join(f for pair in WEIGHT_FILES for f in pair)
    raise ModelDirError(f"{d} has no weights ({names})")


def _check_tokenizer(d: Path) -> None:
    if (d / "tokenizer.json").is_file():
        return
    vocab = [f for f in VOCAB_FILES if (d / f).is_file()] + [p.name for p in d.glob("*.tiktoken")]
    if (d / "tokenizer_config.json").is_file() and vocab:
        return
    if (d / "tokenizer_config.json").is_file():
        raise ModelDirError(f"{d} has no tokenizer: tokenizer_config.json but no tokenizer.json and no "
                            f"vocabulary file ({', '.join(VOCAB_FILES)}, *.tiktoken)")
    raise ModelDirError(f"{d} has no tokenizer (tokenizer.json, or tokenizer_config.json with "
                        f"{' / '.join(VOCAB_FILES)} / *.tiktoken)")


def main(argv: list[str] | None = None) -> int:
    """``python -m openrl.model.modelcheck --checked FILE DIR [DIR ...]``: :func:`check_config` of
    each directory, in a process of its own (``openrl serve --model`` runs it while its workers
    start: the check's torch import then costs the start nothing).

    Returns:
        0 when every config passed; 3 after printing the first failure to stdout as one JSON
        object ``{"path": DIR, "error": message}``.
    """
    import argparse

    p = argparse.ArgumentParser(prog="python -m openrl.model.modelcheck")
    p.add_argument("--checked", default=None, help="the remembered configs (.checked-configs.json)")
    p.add_argument("dirs", nargs="+")
    args = p.parse_args(argv)
    for d in args.dirs:
        try:
            check_config(d, args.checked)
        except ModelDirError as exc:
            print(json.dumps({"path": d, "error": str(exc)}), flush=True)
            return 3
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
