"""examples/quickstart.ipynb runs top to bottom (nbclient, a kernel of this interpreter) with small
sizes swapped into its `parameters` cell, and shows what it promises: a generated text, each
step's metrics, the reward curve and the run plot."""
from __future__ import annotations

import base64
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"

pytestmark = pytest.mark.slow  # the real SmolLM2, loaded in a kernel process


def small_parameters(run_dir: pathlib.Path) -> str:
    return "\n".join([
        "STEPS = 2", "PROMPTS = 2", "SAMPLES = 2", "MAX_NEW_TOKENS = 8", "MAX_PROMPT_LENGTH = 96",
        "GENERATE_TOKENS = 8", "VAL_PROMPTS = 2", "TEST_FREQ = 2", f"RUN_DIR = {str(run_dir)!r}",
    ])


def outputs_of(cell) -> tuple[str, list[bytes]]:
    text, images = [], []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            text.append(out["text"])
        elif out["output_type"] in ("execute_result", "display_data"):
            data = out["data"]
            text.append(data.get("text/plain", ""))
            if "image/png" in data:
                images.append(base64.b64decode(data["image/png"]))
    return "".join(text), images


@pytest.mark.optimized_xla  # the kernel inherits the environment: SmolLM2 steps compiled as a user's are
def test_quickstart_notebook_runs(tmp_path, monkeypatch, smollm2_gguf):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")

    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit it with outputs cleared"
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and nb.cells.index(params[0]) == 1  # the first code cell, after the title
    run_dir = tmp_path / "run"
    params[0].source = small_parameters(run_dir)

    # the kernel inherits this environment: one CPU device (conftest asks for 8 in this process)
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT / "examples")}})
    client.execute()

    code = [c for c in nb.cells if c.cell_type == "code"]
    texts = [outputs_of(c)[0] for c in code]
    images = [img for c in code for img in outputs_of(c)[1]]
    everything = "\n".join(texts)
    generated = [line for line in everything.splitlines() if line.startswith("generated: ")]
    assert generated and len(generated[0]) > len("generated: ''"), everything
    assert "step 1: reward" in everything and "step 2: reward" in everything, everything
    assert "before training: val-core/" in everything and "val " in everything.split("step 2: reward")[1]
    assert "critic/score/mean" in everything  # the metrics table
    assert "after: " in everything
    assert len(images) >= 2 and all(img[:8] == b"\x89PNG\r\n\x1a\n" for img in images)
    assert (run_dir / "plot.png").is_file() and (run_dir / "metrics.jsonl").is_file()
