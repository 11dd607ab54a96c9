"""``python -m serve.triton --write-repository DIR``: a self-contained model repository that a Triton
deployment copies. The test writes it outside the checkout, installs the package (pip, from a copy of the
sources) into a fresh environment outside the checkout, starts tritonserver on the written copy from a
working directory outside the checkout, and serves requests under all four model names."""

from __future__ import annotations

import dataclasses
import json
import queue
import shutil
import subprocess
import sys
import urllib.request
import venv
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.e2e

from serve.config import EngineConfig  # noqa: E402
from serve.triton.__main__ import main  # noqa: E402
from serve.triton.install import TritonLaunchError  # noqa: E402
from serve.triton.llmapi_config import parse_model_yaml  # noqa: E402
from serve.triton.repository import SERVED_MODELS, read_config_parameters, write_repository  # noqa: E402
from serve.triton.server import TritonServer  # noqa: E402
from tests.triton_support import skip_module_without_triton  # noqa: E402

skip_module_without_triton()

CHECKOUT = Path(__file__).resolve().parents[2]


def _installed_env(root: Path) -> Path:
    """A venv outside the checkout with morphserve pip-installed (not editable) from a copy of the
    sources; third-party packages come from the test's own environment through a .pth line."""
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
    site = env_dir / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    src = root / "src"
    src.mkdir()
    for item in ("pyproject.toml", "README.md", "serve", "policy", "builder", "workload", "sim"):
        copy = shutil.copytree if (CHECKOUT / item).is_dir() else shutil.copy2
        copy(CHECKOUT / item, src / item)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(site), str(src)], check=True, cwd=root)
    shutil.rmtree(src)
    assert (site / "serve" / "model" / "kernels"
            / "linear_avx2.cpp").is_file(), "installed copies build the CPU kernels"
    third_party = next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    (site / "third_party.pth").write_text(third_party + "\n")
    return env_dir / "bin"


def _only_text_output(srv: TritonServer, model: str) -> str:
    """One gRPC streamed request to ``model`` naming only ``text_output``, as TensorRT-LLM's clients do; asserts
    the responses carry nothing else. (On Python 3.12 the backend stub crashes when it has to drop an output the
    request did not name, so a model that builds more than was asked loses its process here.)"""
    import tritonclient.grpc as grpcclient  # noqa: PLC0415

    batched = model in ("tensorrt_llm_bls", "ensemble")  # max_batch_size > 0: [1, 1]-shaped inputs
    fields: dict[str, np.ndarray] = {"text_input": np.array(["The capital of France is"], dtype=object)}
    if model == "tensorrt_llm":
        fields["sampling_param_max_tokens"] = np.array([6], dtype=np.int32)
        fields["sampling_param_exclude_input_from_output"] = np.array([True])
    else:
        fields["max_tokens"] = np.array([6], dtype=np.int32)
        if model != "morphserve":
            fields["exclude_input_in_output"] = np.array([True])
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url=srv.grpc_url)
    tensors = []
    for name, arr in fields.items():
        arr = arr.reshape(1, 1) if batched else arr
        t = grpcclient.InferInput(name, list(arr.shape), "BYTES" if arr.dtype == object else
                                  {"int32": "INT32", "bool": "BOOL"}[str(arr.dtype)])
        t.set_data_from_numpy(arr)
        tensors.append(t)
    client.start_stream(callback=lambda result, error: results.put(error or result), stream_timeout=120)
    client.async_stream_infer(model, tensors, outputs=[grpcclient.InferRequestedOutput("text_output")])
    client.stop_stream()
    client.close()
    text = ""
    while not results.empty():
        result = results.get()
        assert not isinstance(result, Exception), (model, result)
        outputs = [o.name for o in result.get_response().outputs]
        assert outputs in ([], ["text_output"]), (model, outputs)
        if outputs:
            text = result.as_numpy("text_output").reshape(-1)[0].decode("utf-8")
    return text


def test_written_repository_serves_outside_the_checkout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Also the operator's knobs end to end: --policy kv_high=0.7 lands in the written config.pbtxt and is the
    served engine's controller threshold (read back from its engine_loaded log line); a config.pbtxt with a
    bad policy key makes the server start fail with the key's name. Mode default with a few sequential
    requests never morphs, so the three names still give the same greedy text."""
    repo = tmp_path / "deploy" / "models"
    rc = main(["--write-repository", str(repo), "--engine-dir", "smollm2-135m", "--max-tokens-limit", "32",
               "--param", "num_threads=1", "--param", "num_kv_blocks=64", "--param", "max_model_len=256",
               "--morph-mode", "default", "--policy", "kv_high=0.7"])
    assert rc == 0, capsys.readouterr()
    for name in SERVED_MODELS:
        cfg = (repo / name / "config.pbtxt").read_text()
        code = repo / name / "1" / "model.py"
        assert code.is_file() and not code.is_symlink()
        assert str(CHECKOUT) not in cfg + code.read_text(), "the written repository points into the checkout"
        assert "sys.path" not in code.read_text()
    params = read_config_parameters((repo / "morphserve" / "config.pbtxt").read_text())
    assert params["max_tokens_limit"] == "32" and params["morph_mode"] == "default" and params["num_kv_blocks"] == "64"
    assert json.loads(params["policy"]) == {"kv_high": 0.7}
    assert main(["--write-repository", str(repo)]) == 1, "must refuse to overwrite a written repository"

    bin_dir = _installed_env(tmp_path)
    srv = TritonServer(repo, python_bin_dir=bin_dir, cwd=tmp_path, log_path=tmp_path / "server.log",
                       workdir=tmp_path / "work")
    assert srv.also_load == ["tensorrt_llm", "ensemble", "tensorrt_llm_bls"]
    written = parse_model_yaml((repo / "tensorrt_llm" / "1" / "model.yaml").read_text(),
                               tuple(f.name for f in dataclasses.fields(EngineConfig)))
    assert written.engine["morph_mode"] == "default" and written.engine["policy_overrides"] == {"kv_high": 0.7}
    assert written.engine["max_model_len"] == 256 and written.bls.decoupled
    assert params["llmapi_config"] == "../tensorrt_llm/1/model.yaml"
    srv.start()
    try:
        srv.wait_ready(timeout=300)
        answers = {}
        for model in SERVED_MODELS:
            if model == "tensorrt_llm":  # the LLM-API model's names
                fields = {"sampling_param_max_tokens": 6, "sampling_param_exclude_input_from_output": True}
            else:
                fields = {"max_tokens": 6, **({"exclude_input_in_output": True} if model != "morphserve" else {})}
            body = json.dumps({"text_input": "The capital of France is", **fields}).encode()
            req = urllib.request.Request(f"http://{srv.http_url}/v2/models/{model}/generate", data=body, method="POST")
            with urllib.request.urlopen(req, timeout=120) as r:
                answers[model] = json.loads(r.read())["text_output"]
        assert answers["morphserve"] and len(set(answers.values())) == 1, answers
        for model in SERVED_MODELS:  # a client naming one output gets that one, and the model keeps serving
            assert _only_text_output(srv, model) == answers["morphserve"], model
    finally:
        srv.stop()
    loaded = [json.loads(ln) for ln in (tmp_path / "server.log").read_text().splitlines()
              if ln.startswith("{") and '"engine_loaded"' in ln]
    assert loaded and Path(loaded[0]["package"]).is_relative_to(tmp_path / "venv"), loaded
    assert loaded[0]["policy"]["kv_high"] == 0.7 and loaded[0]["policy"]["mode"] == "default", loaded[0]["policy"]

    bad = tmp_path / "bad" / "models"  # as a hand-edited config.pbtxt would be: the CLI's check is bypassed
    write_repository(bad, {"engine_dir": "smollm2-135m", "morph_mode": "default", "policy": '{"kv_hgh": 0.7}'})
    srv = TritonServer(bad, python_bin_dir=bin_dir, cwd=tmp_path, log_path=tmp_path / "bad.log",
                       workdir=tmp_path / "bad-work")
    srv.start()
    try:
        with pytest.raises(TritonLaunchError, match="kv_hgh"):
            srv.wait_ready(timeout=300)
    finally:
        srv.stop()
