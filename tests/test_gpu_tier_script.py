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


def test_the_extras_name_the_builds_users_install():
    # #33: the `tensorflow` extra pulled `tensorflow-cpu`, which pip put next
    # to a user's CUDA `tensorflow` (both write the `tensorflow` module).
    import re

    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert extras["tensorflow"] == ["tensorflow>=2.16"]
    assert extras["tensorflow-cpu"] == ["tensorflow-cpu>=2.16"]
    assert extras["tensorflow-cuda"] == ["tensorflow[and-cuda]>=2.16"]
    assert extras["jax-cuda12"] == ["jax[cuda12]>=0.6"]
    # The CPU machines' commands install the CPU builds, never both.
    setup = (ROOT / "scripts" / "setup_env.sh").read_text()
    installed = re.search(r'^extras="([^"]+)"', setup,
                          re.MULTILINE).group(1).split(",")
    assert 'pip install -q -c constraints.txt -e ".[$extras]"' in setup
    assert '"${uv[@]}" -c constraints.txt -e ".[$extras]"' in setup
    assert "tensorflow-cpu" in installed and "tensorflow" not in installed
    # Every extra docs/gpu.md names exists.
    named = re.findall(r'keras_distribute\[([\w-]+)\]',
                       (ROOT / "docs" / "gpu.md").read_text())
    assert named and set(named) <= set(extras), named
