"""The vLLM backend's serving knobs (no vLLM or GPU needed): defaults, environment names,
CUDA-graph capture sizes, the compile-cache location, and how the engine picks the batch
width when the sampler function gives none."""

from __future__ import annotations

import pytest

from functions.sampler import engine as sampler_engine
from functions.sampler.backends.vllm import (
    DEFAULT_GPU_MEMORY,
    DEFAULT_MAX_LORAS,
    DEFAULT_MAX_NUM_SEQS,
    capture_sizes,
    configure_vllm_env,
    engine_settings,
)


def test_defaults_fit_a_gpu_shared_with_the_trainer():
    kw = engine_settings(env={})
    assert kw["gpu_memory_utilization"] == DEFAULT_GPU_MEMORY == 0.40
    assert kw["max_num_seqs"] == DEFAULT_MAX_NUM_SEQS == 256
    assert kw["max_loras"] == DEFAULT_MAX_LORAS == 8 and kw["max_cpu_loras"] == 16
    assert kw["max_lora_rank"] == 32 and kw["enforce_eager"] is False
    sizes = kw["compilation_config"]["cudagraph_capture_sizes"]
    assert sizes[0] == 1 and sizes[-1] == 256 and 128 in sizes and sizes == sorted(set(sizes))


def test_environment_and_the_older_name():
    assert engine_settings(env={"OPENRL_VLLM_GPU_UTIL": "0.7"})["gpu_memory_utilization"] == 0.7
    both = {"OPENRL_SAMPLER_GPU_MEMORY": "0.9", "OPENRL_VLLM_GPU_UTIL": "0.7"}
    assert engine_settings(env=both)["gpu_memory_utilization"] == 0.9  # the new name wins
    assert engine_settings(gpu_memory_utilization=0.5, env=both)["gpu_memory_utilization"] == 0.5  # argument first
    kw = engine_settings(env={"OPENRL_SAMPLER_MAX_NUM_SEQS": "96", "OPENRL_VLLM_MAX_LORAS": "4"})
    assert kw["max_num_seqs"] == 96 and kw["max_loras"] == 4
    assert kw["compilation_config"]["cudagraph_capture_sizes"][-1] == 96
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        engine_settings(env={"OPENRL_SAMPLER_GPU_MEMORY": "1.5"})
    with pytest.raises(ValueError, match="max_lora_rank"):
        engine_settings(max_lora_rank=24, env={})


def test_capture_sizes_and_engine_kwargs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100]
    assert engine_settings(enforce_eager=True, env={}).get("compilation_config") is None
    kw = engine_settings(max_batch_rows=64, engine_kwargs={"compilation_config": {"level": 3}, "seed": 1}, env={})
    assert kw["compilation_config"] == {"level": 3, "cudagraph_capture_sizes": capture_sizes(64)} and kw["seed"] == 1
    own = engine_settings(engine_kwargs={"compilation_config": {"cudagraph_capture_sizes": [1, 8]}}, env={})
    assert own["compilation_config"]["cudagraph_capture_sizes"] == [1, 8]


def test_engine_args_from_the_environment(monkeypatch):
    """OPENRL_VLLM_ENGINE_ARGS (JSON) adds AsyncEngineArgs fields for A/B runs; a compilation_config
    is merged key by key with the capture sizes; explicit engine_kwargs win; not an object: an error."""
    env = {"OPENRL_VLLM_ENGINE_ARGS": '{"compilation_config":{"cudagraph_specialize_lora":false},"seed":3}'}
    kw = engine_settings(env=env)
    assert kw["compilation_config"] == {"cudagraph_specialize_lora": False, "cudagraph_capture_sizes": capture_sizes(256)}
    assert kw["seed"] == 3
    kw = engine_settings(engine_kwargs={"seed": 1, "compilation_config": {"cudagraph_specialize_lora": True}}, env=env)
    assert kw["seed"] == 1 and kw["compilation_config"]["cudagraph_specialize_lora"] is True
    with pytest.raises(ValueError, match="OPENRL_VLLM_ENGINE_ARGS"):
        engine_settings(env={"OPENRL_VLLM_ENGINE_ARGS": "[1]"})
    monkeypatch.setenv("OPENRL_VLLM_ENGINE_ARGS", '{"max_model_len": 4096}')
    assert engine_settings()["max_model_len"] == 4096  # through Settings


def test_compile_cache_in_the_state_dir(tmp_path):
    env = {"OPENRL_HOME": str(tmp_path)}
    assert configure_vllm_env(env) == {"VLLM_CACHE_ROOT": str(tmp_path / "cache" / "vllm"),
                                       "TRITON_CACHE_DIR": str(tmp_path / "cache" / "triton"),
                                       "VLLM_NO_USAGE_STATS": "1", "VLLM_WORKER_MULTIPROC_METHOD": "fork",
                                       "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "cache" / "vllm")
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "cache" / "triton")
    env = {"OPENRL_HOME": str(tmp_path), "VLLM_CACHE_ROOT": "/elsewhere", "VLLM_NO_USAGE_STATS": "0",
           "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "TRITON_CACHE_DIR": "/kernels",
           "PYTORCH_NVML_BASED_CUDA_CHECK": "0"}
    assert configure_vllm_env(env) == {} and env["VLLM_CACHE_ROOT"] == "/elsewhere"
    assert env["TRITON_CACHE_DIR"] == "/kernels"
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn" and env["PYTORCH_NVML_BASED_CUDA_CHECK"] == "0"


def test_sampler_process_asks_nvml_before_cuda(monkeypatch):
    """``functions.sampler.new()`` (the entry of every sampler process, local and Knative) sets
    the NVML-based CUDA check before anything asks ``torch.cuda.is_available()``, so vLLM's
    engine core can be forked (configure_vllm_env); a value already set is kept."""
    import os

    import functions.sampler as sampler

    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "x")  # restored after the test
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK")
    sampler.new()
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "0")
    sampler.new()
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "0"


def test_compile_cache_tag_on_cpu_names_no_gpu():
    """The compile-cache tag's GPU name: None on a CPU device (no CUDA call at all)."""
    from functions.sampler.compile_sync import _gpu_name

    assert _gpu_name("cpu", have_vllm=True) is None and _gpu_name("cpu", have_vllm=False) is None


def test_engine_leaves_the_batch_width_to_the_backend(monkeypatch, tmp_path):
    """SamplerFunction builds its engine without max_batch_rows: the backend's own default
    applies (vLLM 256), not a fixed 64 (which halved 128-sample throughput through the stack)."""
    seen = {}

    class Fake:
        limits = None

        def __init__(self, base_model_dir, **kw):
            seen.update(kw)

    import types

    monkeypatch.setitem(__import__("sys").modules, "functions.sampler.backends.vllm",
                        types.SimpleNamespace(VLLMBackend=Fake))
    sampler_engine.make_backend("vllm", tmp_path, device="cuda")
    assert "max_batch_rows" not in seen
    sampler_engine.make_backend("vllm", tmp_path, device="cuda", max_batch_rows=32)
    assert seen["max_batch_rows"] == 32


def test_merge_triton_keeps_the_first_starts_kernels_for_the_next(tmp_path):
    """vLLM writes the kernels of a compiling start under its per-hash ``triton_cache``; a start that
    loads the compiled model looks in TRITON_CACHE_DIR (seen on the H100: every restart JIT-compiled
    the LoRA kernels again). merge_triton copies them there once, whole, and keeps what is there."""
    from openrl.storage.compile_cache import merge_triton

    root, tri = tmp_path / "vllm", tmp_path / "triton"
    hashed = root / "torch_compile_cache" / "a8137a33b6" / "rank_0_0" / "triton_cache"
    for key, files in {"K1": {"_lora_shrink.cubin": b"c1", "_lora_shrink.json": b"{}"},
                       "K2": {"__triton_launcher.so": b"so"},
                       "tmp.pid_7_123": {"half.cubin": b"?"}}.items():
        for name, data in files.items():
            (hashed / key).mkdir(parents=True, exist_ok=True)
            (hashed / key / name).write_bytes(data)
    (root / "torch_compile_cache" / "a8137a33b6" / "rank_0_0" / "inductor_cache" / "triton_cache").mkdir(parents=True)
    (tri / "K2").mkdir(parents=True)
    (tri / "K2" / "__triton_launcher.so").write_bytes(b"mine")

    assert merge_triton(root, tri) == 1  # K1; K2 is there already, tmp.* is still being written
    assert (tri / "K1" / "_lora_shrink.cubin").read_bytes() == b"c1" and (tri / "K1" / "_lora_shrink.json").exists()
    assert (tri / "K2" / "__triton_launcher.so").read_bytes() == b"mine"
    assert sorted(p.name for p in tri.iterdir()) == ["K1", "K2"]
    assert merge_triton(root, tri) == 0  # a second call copies nothing
    assert merge_triton(tmp_path / "missing", tri) == 0
