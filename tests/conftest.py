"""Session fixtures: one real broker, one real vLLM engine (with the mia_stream plugin active), one HF oracle.

Every test that needs an engine shares the session engine: starting one costs about 80 s on 2 cores.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# named steering vectors (and detector probes) the tests register go to a directory of this run, never the user's cache; the engines
# the fixtures start inherit it
os.environ.setdefault("MIA_STREAM_VECTORS", tempfile.mkdtemp(prefix="mia-test-vectors-"))
os.environ.setdefault("MIA_STREAM_PROBES", tempfile.mkdtemp(prefix="mia-test-probes-"))  # (likewise, probes)

# Engine limits the producer tests rely on: prompts longer than MAX_BATCHED_TOKENS are chunked.
MAX_BATCHED_TOKENS = 256
MAX_MODEL_LEN = 1024
# A small KV cache (24 blocks of 128 tokens = 3072 tokens) so that a test can force preemption.
KV_BLOCKS = 24


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200 with scripts/gpu_check.py)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dir() -> str:
    from mia_stream.model import default_model_dir

    return str(default_model_dir())


@pytest.fixture(scope="session")
def broker_address():
    """A real broker in this process (its own thread), on ipc sockets in a fresh run dir."""
    from mia_stream.broker import run_broker_in_thread

    run_dir = tempfile.mkdtemp(prefix="mia-test-", dir="/tmp")  # short: unix socket paths are limited
    try:
        with run_broker_in_thread(address=run_dir):
            yield run_dir
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def engine(model_dir, broker_address):
    """The session's real vLLM engine (CPU, float32, torch.compile on, prefix caching on, chunked prefill)."""
    os.environ["MIA_STREAM_BROKER"] = broker_address
    os.environ.setdefault("MIA_STREAM_QUANTIZE", "1")  # test_quantize's captures (the workspace is off by default)
    from vllm import LLM

    llm = LLM(model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN,
              max_num_batched_tokens=MAX_BATCHED_TOKENS, max_num_seqs=16, enable_prefix_caching=True,
              num_gpu_blocks_override=KV_BLOCKS, seed=0,
              disable_log_stats=False)  # the preemption test reads vllm:num_preemptions
    yield llm
    llm.llm_engine.engine_core.shutdown()  # stop the engine-core process before pytest closes its streams


@pytest.fixture(scope="session")
def hf_model(model_dir):
    """The independent oracle: Hugging Face transformers on the same weights, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
