"""docs/gpu.md's GPU-tier command on a machine without a GPU (CI): it runs,
every GPU test is skipped with its reason, and the JUnit results land under
`$OUT` (#33). The tier itself runs where a GPU is lent."""

import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

import pytest

from conftest import BACKEND
from test_docs_blocks import ROOT

pytestmark = pytest.mark.skipif(
    BACKEND not in ("jax", "torch"),
    reason="the GPU tier covers the torch and JAX CUDA builds")


def _recipe() -> str:
    text = (ROOT / "docs" / "gpu.md").read_text()
    blocks = [b.split("```")[0] for b in text.split("```bash\n")[1:]]
    found = [line.split("#")[0].strip() for block in blocks
             for line in block.splitlines()
             if line.startswith("bash scripts/gpu_check.sh")]
    assert found, "docs/gpu.md shows no `bash scripts/gpu_check.sh`"
    return found[0]


def test_the_gpu_check_command_skips_with_its_reason_without_a_gpu(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), KD_GPU_BACKENDS=BACKEND,
               PYTHON=sys.executable, JAX_PLATFORMS="cpu",
               CUDA_VISIBLE_DEVICES="")
    env.pop("KD_GPU_TIER_DRY_RUN", None)
    done = subprocess.run(_recipe(), shell=True, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"the {BACKEND} backend sees no GPU here" in done.stdout
    suite = ElementTree.parse(tmp_path / f"gpu-{BACKEND}.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert int(suite.get("tests")) >= 5
    assert int(suite.get("skipped")) == int(suite.get("tests"))
    assert (tmp_path / "versions.txt").read_text().startswith("keras ")
