"""Model registry: Tinker base-model names -> local Hugging Face directories.

The registry is a TOML file. The default, ``openrl/data/models.toml``, maps the Tinker names
openrl accepts (``Qwen/Qwen3-4B-Instruct-2507``, ``Qwen/Qwen3-0.6B``, ...) to the offline model
that :mod:`openrl.modelbuild` builds at ``<models_dir>/tiny-qwen3``. The environment variable
``OPENRL_MODEL_REGISTRY`` names another file. Format::

    [defaults]                      # optional; values every entry inherits
    max_context_length = 4096
    trainable = true
    sampleable = true

    [models."Qwen/Qwen3-0.6B"]
    path = "tiny-qwen3"             # relative to models_dir; "~" and ${VAR} are expanded
    tokenizer_id = "..."            # optional, defaults to path; resolved like path
    max_context_length = 4096
    trainable = true
    sampleable = true
    build = true                    # optional: `openrl models build` / ensure_built creates it
                                    # (default: true iff path is <models_dir>/tiny-qwen3)

``${OPENRL_HOME}`` expands to the environment variable, or ``~/.openrl`` when it is unset.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Iterator

from openrl.errors import UserError

#: Environment variable naming an alternative registry TOML file.
REGISTRY_ENV = "OPENRL_MODEL_REGISTRY"
#: Environment variable naming the state directory.
HOME_ENV = "OPENRL_HOME"
DEFAULT_STATE_DIR = "~/.openrl"

_ENTRY_KEYS = {"path", "tokenizer_id", "max_context_length", "trainable", "sampleable", "build"}
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")


class RegistryError(ValueError):
    """The registry file is missing, not TOML, or has an invalid entry (message names file and key)."""


def state_dir(explicit: str | os.PathLike | None = None) -> Path:
    """The openrl state directory: ``explicit`` if given, else ``$OPENRL_HOME``, else ``~/.openrl``.

    Returns an absolute path with ``~`` expanded; does not create it.
    """
    raw = explicit if explicit not in (None, "") else os.environ.get(HOME_ENV) or DEFAULT_STATE_DIR
    return Path(os.path.abspath(Path(raw).expanduser()))


def default_models_dir(state: str | os.PathLike | None = None) -> Path:
    """``<state_dir>/models`` (see :func:`state_dir`)."""
    return state_dir(state) / "models"


def default_registry_path() -> Path:
    """The registry file in use when none is given: ``$OPENRL_MODEL_REGISTRY`` or the packaged default."""
    env = os.environ.get(REGISTRY_ENV)
    if env:
        return Path(env).expanduser()
    return Path(str(resources.files("openrl") / "data" / "models.toml"))


@dataclass(frozen=True)
class ModelEntry:
    """One registered base model.

    Attributes:
        name: the Tinker base-model name (e.g. ``Qwen/Qwen3-4B-Instruct-2507``).
        path: absolute local directory of the Hugging Face checkpoint.
        tokenizer_id: absolute local directory of the tokenizer (what ``get_info`` returns; the
            SDK passes it to ``AutoTokenizer.from_pretrained``). Never contains ':'.
        max_context_length: prompt + completion limit, in tokens.
        trainable: training runs may be created on it.
        sampleable: sampling sessions may be created on it.
        build: the directory is the offline model that :func:`ensure_built` creates.
    """

    name: str
    path: Path
    tokenizer_id: str
    max_context_length: int
    trainable: bool = True
    sampleable: bool = True
    build: bool = False

    def capability(self) -> dict:
        """This entry as a ``supported_models`` item of ``get_server_capabilities``."""
        return {
            "model_name": self.name,
            "max_context_length": self.max_context_length,
            "trainable": self.trainable,
            "sampleable": self.sampleable,
        }


def _expand(raw: str, where: str) -> str:
    def sub(m: re.Match) -> str:
        var = m.group(1) or m.group(2)
        val = os.environ.get(var)
        if val:
            return val
        if var == HOME_ENV:
            return DEFAULT_STATE_DIR
        raise RegistryError(f"{where}: environment variable ${{{var}}} is not set")

    return os.path.expanduser(_VAR.sub(sub, raw))


def _local_path(raw: Any, models_dir: Path, where: str) -> Path:
    if not isinstance(raw, str) or not raw.strip():
        raise RegistryError(f"{where}: must be a non-empty string")
    p = Path(_expand(raw.strip(), where))
    if not p.is_absolute():
        p = models_dir / p
    p = Path(os.path.abspath(p))
    if ":" in str(p):
        raise RegistryError(f"{where}: {p} contains ':' (the Tinker SDK cuts tokenizer ids at the first colon)")
    return p


class ModelRegistry:
    """Tinker base-model names -> :class:`ModelEntry`, loaded from TOML (see module docstring)."""

    def __init__(self, entries: dict[str, ModelEntry], *, models_dir: Path, source: Path | None = None):
        self._entries = dict(entries)
        self.models_dir = Path(models_dir)
        self.source = source

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, *, models_dir: str | os.PathLike | None = None) -> "ModelRegistry":
        """Load a registry file.

        Args:
            path: the TOML file; default :func:`default_registry_path` (``$OPENRL_MODEL_REGISTRY``
                or the packaged ``openrl/data/models.toml``).
            models_dir: directory that relative ``path`` values resolve against; default
                ``<state_dir>/models`` (see :func:`state_dir`). The embedded stack passes
                ``<state_dir>/models``.

        Raises:
            RegistryError: the file cannot be read, is not TOML, or an entry is invalid.
        """
        src = Path(path).expanduser() if path is not None else default_registry_path()
        try:
            text = src.read_text(encoding="utf-8")
        except OSError as e:
            raise RegistryError(f"cannot read model registry {src}: {e}") from e
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise RegistryError(f"model registry {src} is not valid TOML: {e}") from e
        mdir = Path(os.path.abspath(Path(models_dir).expanduser())) if models_dir is not None else default_models_dir()
        return cls.from_dict(data, models_dir=mdir, source=src)

    @classmethod
    def from_dict(cls, data: dict, *, models_dir: str | os.PathLike, source: Path | None = None) -> "ModelRegistry":
        """Build a registry from the parsed TOML structure (``{"defaults": {...}, "models": {name: {...}}}``).

        Raises:
            RegistryError: an entry is invalid (unknown key, wrong type, missing path).
        """
        where0 = str(source) if source else "<registry>"
        models_dir = Path(os.path.abspath(Path(models_dir).expanduser()))
        unknown_top = set(data) - {"defaults", "models"}
        if unknown_top:
            raise RegistryError(f"{where0}: unknown top-level keys {sorted(unknown_top)} (expected 'defaults', 'models')")
        defaults = data.get("defaults", {})
        models = data.get("models", {})
        if not isinstance(defaults, dict) or not isinstance(models, dict):
            raise RegistryError(f"{where0}: 'defaults' and 'models' must be tables")
        built_default = Path(os.path.abspath(models_dir / "tiny-qwen3"))
        entries: dict[str, ModelEntry] = {}
        for name, raw in models.items():
            where = f"{where0}: models.{name!r}"
            if not isinstance(raw, dict):
                raise RegistryError(f"{where}: must be a table")
            spec = {**defaults, **raw}
            unknown = set(spec) - _ENTRY_KEYS
            if unknown:
                raise RegistryError(f"{where}: unknown keys {sorted(unknown)} (allowed: {sorted(_ENTRY_KEYS)})")
            if "path" not in spec:
                raise RegistryError(f"{where}: 'path' is required")
            path = _local_path(spec["path"], models_dir, f"{where}.path")
            tok = _local_path(spec["tokenizer_id"], models_dir, f"{where}.tokenizer_id") if "tokenizer_id" in spec else path
            mcl = spec.get("max_context_length", 4096)
            if isinstance(mcl, bool) or not isinstance(mcl, int) or mcl <= 0:
                raise RegistryError(f"{where}.max_context_length: must be a positive integer, got {mcl!r}")
            flags = {}
            for key, default in (("trainable", True), ("sampleable", True), ("build", path == built_default)):
                val = spec.get(key, default)
                if not isinstance(val, bool):
                    raise RegistryError(f"{where}.{key}: must be true or false, got {val!r}")
                flags[key] = val
            entries[name] = ModelEntry(
                name=name, path=path, tokenizer_id=str(tok), max_context_length=mcl, **flags
            )
        return cls(entries, models_dir=models_dir, source=source)

    def resolve(self, name: str) -> ModelEntry:
        """The entry for a Tinker base-model name.

        Raises:
            UserError: field ``base_model``, for a name not in the registry (the message lists the known names).
        """
        entry = self._entries.get(name) if isinstance(name, str) else None
        if entry is None:
            raise UserError("base_model", f"unknown base model {name!r}; known: {', '.join(self.names())}")
        return entry

    def get(self, name: str) -> ModelEntry | None:
        """The entry for ``name``, or None."""
        return self._entries.get(name)

    def names(self) -> list[str]:
        """Registered base-model names, in file order."""
        return list(self._entries)

    def entries(self) -> list[ModelEntry]:
        """All entries, in file order."""
        return list(self._entries.values())

    def capabilities(self) -> list[dict]:
        """The ``supported_models`` list of ``get_server_capabilities``:
        ``[{"model_name", "max_context_length", "trainable", "sampleable"}, ...]``."""
        return [e.capability() for e in self._entries.values()]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[ModelEntry]:
        return iter(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"ModelRegistry({self.names()!r}, models_dir={str(self.models_dir)!r}, source={str(self.source)!r})"


def ensure_built(registry: ModelRegistry, *, seed: int = 0, progress: bool = True) -> list[Path]:
    """Build (with :func:`openrl.modelbuild.build_model`) every missing model directory of the
    registry's ``build = true`` entries; each distinct directory once.

    A directory that holds an openrl build of an older recipe is rebuilt; one that is not an
    openrl build at all raises.

    Args:
        registry: the loaded registry.
        seed: weight seed for directories built now.
        progress: show the build's tqdm bar.

    Returns:
        The directories built by this call (empty if all were present).

    Raises:
        FileExistsError: a ``build = true`` directory exists, is non-empty and is not an openrl build.
    """
    from openrl import modelbuild

    built: list[Path] = []
    seen: set[Path] = set()
    for entry in registry:
        if not entry.build or entry.path in seen:
            continue
        seen.add(entry.path)
        if modelbuild.is_built(entry.path):
            continue
        modelbuild.build_model(entry.path, seed=seed, progress=progress)
        built.append(entry.path)
    return built
