"""Shared fixtures: a real embedded stack (nats-server + gateway + trainer + sampler
processes on 127.0.0.1) and real ``tinker`` SDK clients pointed at it.

Nothing here is mocked: the SDK speaks HTTP to the gateway, the gateway publishes
CloudEvents on a real JetStream, the workers answer through the KV bucket.

With ``OPENRL_TEST_STACK_STATE=<state dir>`` the fixtures stand for an ``openrl serve``
running there instead (the GPU conformance run: ``tests/external_stack.py``,
``bench/gpu_conformance.py``); tests that start stacks of their own skip.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from external_stack import ExternalStack, external_state, skip_reason

os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BASE_MODEL = "Qwen/Qwen3-4B-Instruct-2507"
#: the state dir of the external stack under test (``$OPENRL_TEST_STACK_STATE``), else None
EXTERNAL = external_state()


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    """One build of the offline model for the whole test session (shared by stacks); with an
    external stack, its own models dir (where its serve built the offline model)."""
    from openrl.model.registry import ModelRegistry, ensure_built

    if EXTERNAL is not None:
        return EXTERNAL / "models"
    d = Path(os.environ.get("OPENRL_TEST_MODELS", tmp_path_factory.mktemp("models")))
    ensure_built(ModelRegistry.load(None, models_dir=d))
    return d


@pytest.fixture(scope="session")
def micro_model_dir(tmp_path_factory) -> Path:
    """The unit tests' micro model (tests/micro_model.py) with tied embeddings and a 256-token
    context (trainer-side tests)."""
    from micro_model import write_micro_qwen3

    return write_micro_qwen3(tmp_path_factory.mktemp("micro-qwen3"))


_SESSION_KEY = "tml-test-" + __import__("secrets").token_urlsafe(18)


def _make_stack(tmp_path_factory, models_dir: Path, **kw):
    """A Stack in a fresh state dir; its <state>/api_key is the session's shared test key, so
    every test stack accepts the ``api_key`` fixture. With an external stack the calling test
    skips (it needs a stack of its own)."""
    if EXTERNAL is not None:
        pytest.skip(skip_reason("starts its own stack"))
    from openrl.transport.embedded import Stack

    state = tmp_path_factory.mktemp("state")
    (state / "models").symlink_to(models_dir, target_is_directory=True)
    (state / "api_key").write_text(_SESSION_KEY + "\n")
    # every process appends its finished trace spans here (openrl/tracing.py; tests/stack/test_tracing.py)
    kw["extra_env"] = {"OPENRL_TRACE_FILE": str(state / "traces.jsonl"), **kw.get("extra_env", {})}
    return Stack(state_dir=state, port=0, **kw)  # any free port: the stack holds it before the gateway starts


@pytest.fixture(scope="session")
def stack(tmp_path_factory, models_dir):
    """The embedded stack with JetStream workers (the local pull path); the external stack
    (``ExternalStack``) when ``$OPENRL_TEST_STACK_STATE`` is set."""
    if EXTERNAL is not None:
        yield ExternalStack.from_state(EXTERNAL)
        return
    s = _make_stack(tmp_path_factory, models_dir).start()
    yield s
    s.stop()


@pytest.fixture(scope="session", params=["pull-file"] if EXTERNAL else ["pull-file", "push-file", "pull-gcs"])
def sdk_stack(request, tmp_path_factory, models_dir):
    """The SDK end-to-end suite runs once per variant:

    - ``pull-file``: JetStream pull workers, ``file://`` storage (the embedded default);
    - ``push-file``: the functions as HTTP CloudEvent receivers behind the local dispatcher
      (the path Knative Eventing takes), ``file://`` storage;
    - ``pull-gcs``: JetStream workers with ``gs://`` storage on a GCS emulator (the real
      google-cloud-storage client).

    With an external stack only ``pull-file``: the external stack itself.
    """
    mode, storage = request.param.split("-")
    if mode == "pull" and storage == "file":
        yield request.getfixturevalue("stack")
        return
    kw: dict = {"push": mode == "push"}
    if storage == "gcs":
        url = request.getfixturevalue("gcs_emulator")
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage as gcs

        os.environ["STORAGE_EMULATOR_HOST"] = url
        try:
            gcs.Client(project="openrl-test", credentials=AnonymousCredentials()).create_bucket("openrl-e2e")
        finally:
            del os.environ["STORAGE_EMULATOR_HOST"]
        kw.update(storage="gs://openrl-e2e/ckpt", extra_env={"STORAGE_EMULATOR_HOST": url})
    s = _make_stack(tmp_path_factory, models_dir, **kw).start()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def api_key(stack) -> str:
    """The stack's API key (<state>/api_key; the same for every embedded stack of the session)."""
    return stack.api_key


@pytest.fixture(scope="session")
def service(sdk_stack, api_key):
    import tinker

    client = tinker.ServiceClient(base_url=sdk_stack.base_url, api_key=api_key)
    yield client


@pytest.fixture(scope="session")
def tokenizer(service):
    tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0)
    return tc.get_tokenizer()


from fixtures_gcs import gcs_emulator  # noqa: E402,F401  (session fixture: a GCS emulator on 127.0.0.1)
from fixtures_keys import keyed_stack, keys  # noqa: E402,F401  (session fixtures: a stack with 3 API keys)
