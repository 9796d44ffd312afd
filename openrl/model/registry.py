"""Model registry: Tinker base-model names -> local Hugging Face directories.

The registry is a TOML file. The default, ``openrl/data/models.toml``, maps the Tinker names
openrl accepts (``Qwen/Qwen3-4B-Instruct-2507``, ``Qwen/Qwen3-0.6B``, ...) to the offline model
that :mod:`openrl.model.modelbuild` builds at ``<models_dir>/tiny-qwen3``. The environment variable
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
    dtype = "auto"                  # optional: base-weight dtype, one of DTYPE_NAMES
                                    # ("auto" = bfloat16 on CUDA, float32 on CPU; openrl.model.device)
    deterministic = true            # optional: this model's deterministic mode (issue 33), overriding
                                    # OPENRL_DETERMINISTIC / --deterministic (ModelEntry.is_deterministic)

``${OPENRL_HOME}`` expands to the environment variable, or ``~/.openrl`` when it is unset.

User overlay. One rule: the file ``models.toml`` *next to* the models directory,
``<models_dir>/../models.toml`` (:func:`overlay_path`), is merged on top of the registry file.
With the default ``models_dir = <state_dir>/models`` that is ``<state_dir>/models.toml``, and
every process of the embedded stack (gateway, trainer, sampler, ``openrl models list``) loads
with ``models_dir=<state_dir>/models``, so all of them see the same overlay. Its entries (same
format, its own ``[defaults]``) replace base entries of the same name and add new ones;
``openrl models add`` / ``remove`` and ``--model NAME=DIR`` rewrite it (:func:`add_model`,
:func:`remove_model`; comments in it are not kept). A missing overlay is no overlay.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from openrl.config import DEFAULT_HOME, Settings
from openrl.errors import RegistryError, UserError  # RegistryError: re-exported (its home is openrl.errors)

#: Environment variable naming an alternative registry TOML file.
REGISTRY_ENV = "OPENRL_MODEL_REGISTRY"
#: Environment variable naming the state directory.
HOME_ENV = "OPENRL_HOME"
DEFAULT_STATE_DIR = DEFAULT_HOME  # the one default, in openrl.config

#: Accepted ``dtype`` values; the same as :data:`openrl.model.device.DTYPE_NAMES` (not imported from
#: there: that module imports torch, and the gateway and ``openrl --help`` should not).
DTYPE_NAMES = ("auto", "bfloat16", "float16", "float32")
#: File name of the user overlay, next to the models directory (see module docstring).
OVERLAY_NAME = "models.toml"

_ENTRY_KEYS = {"path", "tokenizer_id", "max_context_length", "trainable", "sampleable", "build", "dtype",
               "deterministic"}
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def state_dir(explicit: str | os.PathLike | None = None) -> Path:
    """The openrl state directory: ``explicit`` if given, else ``$OPENRL_HOME``, else ``~/.openrl``.

    Returns an absolute path with ``~`` expanded; does not create it.
    """
    if explicit in (None, ""):
        return Settings().home_dir
    return Path(os.path.abspath(Path(explicit).expanduser()))


def default_models_dir(state: str | os.PathLike | None = None) -> Path:
    """``<state_dir>/models`` (see :func:`state_dir`)."""
    return state_dir(state) / "models"


def default_registry_path() -> Path:
    """The registry file in use when none is given: ``$OPENRL_MODEL_REGISTRY`` or the packaged default."""
    env = Settings().registry_path
    if env:
        return env
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
        dtype: base-weight dtype name, one of :data:`DTYPE_NAMES` (``"auto"``: bfloat16 on CUDA,
            float32 on CPU; see :func:`openrl.model.device.resolve_dtype`).
        deterministic: this model's deterministic mode (issue 33): True / False override the
            server's ``Settings.deterministic``; None (unset) follows it (:meth:`is_deterministic`).
    """

    name: str
    path: Path
    tokenizer_id: str
    max_context_length: int
    trainable: bool = True
    sampleable: bool = True
    build: bool = False
    dtype: str = "auto"
    deterministic: bool | None = None

    def is_deterministic(self, server_default: bool) -> bool:
        """Whether this model's trainer and sampler run in the deterministic mode: the entry's
        ``deterministic`` when set, else ``server_default`` (``Settings.deterministic``)."""
        return server_default if self.deterministic is None else self.deterministic

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

    def __init__(self, entries: dict[str, ModelEntry], *, models_dir: Path, source: Path | None = None,
                 overlay: Path | None = None, overlay_names: Iterable[str] = ()):
        self._entries = dict(entries)
        self.models_dir = Path(models_dir)
        self.source = source
        #: the user overlay merged on top of ``source`` (None: there was none), and its names
        self.overlay = overlay
        self.overlay_names = frozenset(overlay_names)

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, *, models_dir: str | os.PathLike | None = None,
             overlay: str | os.PathLike | bool | None = True) -> "ModelRegistry":
        """Load a registry file and merge the user overlay on top (see module docstring).

        Args:
            path: the TOML file; default :func:`default_registry_path` (``$OPENRL_MODEL_REGISTRY``
                or the packaged ``openrl/data/models.toml``).
            models_dir: directory that relative ``path`` values resolve against; default
                ``<state_dir>/models`` (see :func:`state_dir`). The embedded stack passes
                ``<state_dir>/models``.
            overlay: True (default): merge :func:`overlay_path` of ``models_dir`` if it exists;
                a path: merge that file if it exists; False / None: no overlay.

        Raises:
            RegistryError: a file cannot be read, is not TOML, or an entry is invalid (the
                message names the file and key).
        """
        src = Path(path).expanduser() if path is not None else default_registry_path()
        data = _read_toml(src)
        mdir = Path(os.path.abspath(Path(models_dir).expanduser())) if models_dir is not None else default_models_dir()
        reg = cls.from_dict(data, models_dir=mdir, source=src)
        if overlay is True:
            ov: Path | None = overlay_path(mdir)
        else:
            ov = Path(overlay).expanduser() if overlay else None
        if ov is not None and ov.is_file() and not _same_file(ov, src):
            top = cls.from_dict(_read_toml(ov), models_dir=mdir, source=ov)
            reg._entries.update(top._entries)  # same name: replaced in place; new names: appended
            reg.overlay, reg.overlay_names = ov, frozenset(top._entries)
        return reg

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
        if "dtype" in defaults:
            _check_dtype(defaults["dtype"], f"{where0}: defaults.dtype")
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
            dtype = _check_dtype(spec.get("dtype", "auto"), f"{where}.dtype")
            det = spec.get("deterministic")
            if det is not None and not isinstance(det, bool):
                raise RegistryError(f"{where}.deterministic: must be true or false, got {det!r}")
            entries[name] = ModelEntry(
                name=name, path=path, tokenizer_id=str(tok), max_context_length=mcl, dtype=dtype,
                deterministic=det, **flags
            )
        return cls(entries, models_dir=models_dir, source=source)

    def resolve(self, name: str) -> ModelEntry:
        """The entry for a Tinker base-model name, or for ``<registered name>:peft:<context>``
        (the form tinker-cookbook's recipes and eval types use, e.g.
        ``Qwen/Qwen3.6-35B-A3B:peft:262144``): the registered entry with ``name`` kept as given
        and ``max_context_length`` capped at ``<context>`` (see :func:`split_peft_suffix`). The
        gateway checks datums and prompts against that length, so a run or sampling session
        made with such a name answers longer requests with a 400 naming the field.

        Raises:
            UserError: field ``base_model``, for a name not in the registry (the message lists the
                known names), or a ``:peft:`` suffix that is not a positive integer or exceeds the
                registered entry's ``max_context_length``.
        """
        entry = self._entries.get(name) if isinstance(name, str) else None
        if entry is not None:
            return entry
        base, context = split_peft_suffix(name) if isinstance(name, str) else (name, None)
        entry = self._entries.get(base) if context is not None else None
        if entry is None:
            raise UserError("base_model", f"unknown base model {name!r}; known: {', '.join(self.names())}")
        if context > entry.max_context_length:
            raise UserError("base_model", f"{name!r} asks a context of {context} tokens; {base!r} supports at "
                                          f"most {entry.max_context_length}")
        return replace(entry, name=name, max_context_length=context)

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
        return (f"ModelRegistry({self.names()!r}, models_dir={str(self.models_dir)!r}, source={str(self.source)!r}, "
                f"overlay={str(self.overlay) if self.overlay else None!r})")


#: The ``:peft:<context>`` suffix of a base-model name (cookbook 0.6.1): decimal digits only.
PEFT_SUFFIX = ":peft:"
_CONTEXT = re.compile(r"[0-9]+")


def split_peft_suffix(name: str) -> tuple[str, int | None]:
    """Split ``"<base>:peft:<context>"`` into ``(base, context)``; ``(name, None)`` for a name
    without the suffix.

    Args:
        name: a base-model name as a client sent it.

    Returns:
        The name before the last ``:peft:`` and the context length in tokens (an int >= 1).

    Raises:
        UserError: field ``base_model``, when the suffix is present but ``<context>`` is not a
            positive decimal integer (empty, signed, fractional, 0) or the base part is empty.
    """
    base, sep, raw = name.rpartition(PEFT_SUFFIX)
    if not sep:
        return name, None
    if not base or len(raw) > 12 or not _CONTEXT.fullmatch(raw) or int(raw) < 1:
        raise UserError("base_model", f"{name!r}: expected <base model>{PEFT_SUFFIX}<context length>, the "
                                      f"context a positive integer number of tokens, got {raw!r}")
    return base, int(raw)


def _check_dtype(val: Any, where: str) -> str:
    if not isinstance(val, str) or val not in DTYPE_NAMES:
        raise RegistryError(f"{where}: must be one of {', '.join(DTYPE_NAMES)}, got {val!r}")
    return val


def _read_toml(src: Path) -> dict:
    try:
        text = src.read_text(encoding="utf-8")
    except OSError as e:
        raise RegistryError(f"cannot read model registry {src}: {e}") from e
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise RegistryError(f"model registry {src} is not valid TOML: {e}") from e


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


def ensure_built(registry: ModelRegistry, *, seed: int = 0, progress: bool = True) -> list[Path]:
    """Build (with :func:`openrl.model.modelbuild.build_model`) every missing model directory of the
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
    from openrl.model import modelbuild

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


# -- the user overlay (<models_dir>/../models.toml) -------------------------------------------


def overlay_path(models_dir: str | os.PathLike | None = None) -> Path:
    """The user overlay of a models directory: ``<models_dir>/../models.toml``.

    ``models_dir`` defaults to ``<state_dir>/models``, so the default is ``<state_dir>/models.toml``.
    """
    mdir = Path(os.path.abspath(Path(models_dir).expanduser())) if models_dir is not None else default_models_dir()
    return mdir.parent / OVERLAY_NAME


#: In the models directory: the config.json files that passed the config check
#: (:func:`openrl.model.modelcheck.validate_model_dir`'s ``checked``).
CHECKED_CONFIGS = ".checked-configs.json"


def add_model(name: str, directory: str | os.PathLike, *, models_dir: str | os.PathLike | None = None,
              dtype: str = "auto", max_context_length: int | None = None, check_config: bool = True) -> ModelEntry:
    """Validate a local Hugging Face directory and write (or replace) its entry in the overlay.

    Args:
        name: the Tinker base-model name (e.g. ``Qwen/Qwen3-4B-Instruct-2507``); an entry of the
            same name in the registry file is overridden.
        directory: the model directory; stored as an absolute path.
        models_dir: selects the overlay (:func:`overlay_path`); default ``<state_dir>/models``.
        dtype: one of :data:`DTYPE_NAMES`.
        max_context_length: stored when given; else the overlay's ``[defaults]`` or 4096 applies.
        check_config: False leaves out the ``AutoConfig`` load (the caller runs
            :func:`openrl.model.modelcheck.check_config` itself, and undoes the entry with
            :func:`restore_overlay_entries` when it fails).

    Returns:
        The entry as every process now resolves it.

    Raises:
        openrl.model.modelcheck.ModelDirError: the directory is not a loadable causal LM (see
            :func:`openrl.model.modelcheck.validate_model_dir`); the message names what is missing.
        RegistryError: an empty or padded name, an invalid dtype or max_context_length, a path
            containing ':', or an overlay that is not valid TOML / has an invalid entry.
    """
    from openrl.model.modelcheck import validate_model_dir

    if not isinstance(name, str) or not name or name != name.strip():
        raise RegistryError(f"model name {name!r}: must be a non-empty string without surrounding spaces")
    path = Path(os.path.abspath(Path(directory).expanduser()))
    mdir = Path(os.path.abspath(Path(models_dir).expanduser())) if models_dir is not None else default_models_dir()
    validate_model_dir(path, checked=mdir / CHECKED_CONFIGS, config=check_config)
    spec: dict[str, Any] = {"path": str(path), "dtype": dtype}
    if max_context_length is not None:
        spec["max_context_length"] = max_context_length
    ov = overlay_path(mdir)
    with _overlay_lock(ov):
        data = _read_toml(ov) if ov.exists() else {}
        models = data.setdefault("models", {})
        if not isinstance(models, dict):
            raise RegistryError(f"{ov}: 'models' must be a table")
        models[name] = spec
        reg = ModelRegistry.from_dict(data, models_dir=mdir, source=ov)  # validates before writing
        _write_toml(ov, data)
    return reg.resolve(name)


def remove_model(name: str, *, models_dir: str | os.PathLike | None = None) -> Path:
    """Remove ``name`` from the overlay of ``models_dir`` (default ``<state_dir>/models``).

    Returns:
        The overlay file's path.

    Raises:
        RegistryError: ``name`` is not in the overlay (entries of the registry file itself
            cannot be removed this way), or the overlay is not valid TOML.
    """
    ov = overlay_path(models_dir)
    with _overlay_lock(ov):
        data = _read_toml(ov) if ov.exists() else {}
        models = data.get("models")
        if not isinstance(models, dict) or name not in models:
            raise RegistryError(f"{name!r} is not in the user registry {ov} (openrl models add puts models there; "
                                f"entries of {default_registry_path()} are not removed this way)")
        del models[name]
        _write_toml(ov, data)
    return ov


def overlay_entries(names: Iterable[str], *, models_dir: str | os.PathLike | None = None) -> dict[str, dict | None]:
    """The overlay's own entries for ``names`` as stored (None: no entry), to hand to
    :func:`restore_overlay_entries`.

    Raises:
        RegistryError: the overlay is not valid TOML.
    """
    ov = overlay_path(models_dir)
    data = _read_toml(ov) if ov.exists() else {}
    models = data.get("models") if isinstance(data.get("models"), dict) else {}
    return {n: (dict(models[n]) if isinstance(models.get(n), dict) else None) for n in names}


def restore_overlay_entries(entries: Mapping[str, dict | None], *,
                            models_dir: str | os.PathLike | None = None) -> None:
    """Put the overlay's entries back as :func:`overlay_entries` saw them (None: removed), e.g.
    after ``--model NAME=DIR`` wrote NAME and its config check then failed: what was stored
    before is not lost.

    Raises:
        RegistryError: the overlay is not valid TOML.
    """
    ov = overlay_path(models_dir)
    with _overlay_lock(ov):
        data = _read_toml(ov) if ov.exists() else {}
        models = data.setdefault("models", {})
        if not isinstance(models, dict):
            raise RegistryError(f"{ov}: 'models' must be a table")
        for name, spec in entries.items():
            if spec is None:
                models.pop(name, None)
            else:
                models[name] = dict(spec)
        _write_toml(ov, data)


class _overlay_lock:
    """An exclusive ``flock`` on ``<overlay>.lock`` around a read-modify-write of the overlay."""

    def __init__(self, overlay: Path):
        self.path = overlay.with_name(f".{overlay.name}.lock")
        self.fd: int | None = None

    def __enter__(self) -> "_overlay_lock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock, the atomic rename still keeps readers safe
            return self
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the lock
            self.fd = None


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_OVERLAY_HEADER = (
    "# openrl user model registry, merged on top of the packaged one (openrl/model/registry.py).\n"
    "# Written by `openrl models add` / `openrl models remove` and --model NAME=DIR; comments are not kept.\n"
)


def _toml_str(s: str) -> str:
    return '"' + "".join(_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c)
                         for c in s) + '"'


def _toml_key(k: str) -> str:
    return k if _BARE_KEY.fullmatch(k) else _toml_str(k)


def _toml_value(v: Any, where: str) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return _toml_str(v)
    raise RegistryError(f"{where}: cannot write {type(v).__name__} value {v!r} (strings, numbers, booleans only)")


def _dump_toml(data: dict, where: str) -> str:
    """The registry structure (top-level tables of scalars or of tables of scalars) as TOML."""
    out = [_OVERLAY_HEADER]
    for top, table in data.items():
        if not isinstance(table, dict):
            raise RegistryError(f"{where}: top-level {top!r} must be a table")
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
        if scalars or not table:
            out.append(f"\n[{_toml_key(top)}]\n")
            out += [f"{_toml_key(k)} = {_toml_value(v, f'{where}: {top}.{k}')}\n" for k, v in scalars.items()]
        for sub, inner in table.items():
            if not isinstance(inner, dict):
                continue
            out.append(f"\n[{_toml_key(top)}.{_toml_key(sub)}]\n")
            for k, v in inner.items():
                if isinstance(v, dict):
                    raise RegistryError(f"{where}: {top}.{sub}.{k}: nested tables are not supported")
                out.append(f"{_toml_key(k)} = {_toml_value(v, f'{where}: {top}.{sub}.{k}')}\n")
    text = "".join(out)
    if tomllib.loads(text) != data:  # the writer is small; make sure it said what it meant
        raise RegistryError(f"{where}: internal error: the written TOML does not read back the same")
    return text


def _write_toml(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` atomically (temporary file + rename)."""
    text = _dump_toml(data, str(path))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except UnicodeEncodeError as e:
        tmp.unlink(missing_ok=True)
        raise RegistryError(f"{path}: a name or path is not valid UTF-8: {e}") from e
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise RegistryError(f"cannot write {path}: {e}") from e
